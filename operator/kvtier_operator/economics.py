"""Tier verdicts for a policy, from the break-even calculator (`kvtier.breakeven`).

    dram  -> medium "dram" at hardware.media.dramGbps
    peer  -> medium "rdma" at hardware.media.rdmaGbps      ("off" when disabled)
    nvme  -> medium "nvme" at hardware.media.nvmeGbps, or the sidecars' measurement
             once shadow mode has one

Interactive traffic is judged by latency (fetch faster than recompute); batch traffic
by capacity (a DMA frees GPU-seconds), as the calculator decides. NVMe is special
because the design refuses it for interactive traffic: its condition carries the
numbers so an operator reading `kubectl describe` sees why. Pure.
"""
from __future__ import annotations

from kvtier import breakeven, presets
from kvtier.policy import KVCachePolicySpec, ModelSpec, TierVerdict

from kvtier_operator.conditions import Observation

NVME_CONDITION = "NvmeTier"
TIERS_CONDITION = "TiersEvaluated"


def resolved_shape(model: ModelSpec) -> presets.ModelShape:
    if model.preset is not None:
        return presets.model_preset(model.preset)
    assert model.shape is not None  # the model's CEL rule: exactly one of preset or shape
    return model.shape.model_copy(update={"name": model.id})


def tflops_per_gpu(spec: KVCachePolicySpec) -> tuple[float, str]:
    hw = spec.hardware
    if hw.gpu_preset is not None:
        gpu = presets.gpu_preset(hw.gpu_preset)
        return gpu.dense_tflops, gpu.name
    assert hw.dense_tflops_per_gpu is not None  # the hardware's CEL rule
    return hw.dense_tflops_per_gpu, "custom"


def replica_prefill_tokens_per_s(spec: KVCachePolicySpec) -> float:
    """Prefill tokens/s one replica recomputes at full load (the break-even arithmetic):
    the rollout's capacity estimate (a step's cold-cache prefill, a warm-up's budget)."""
    shape = resolved_shape(spec.model)
    tflops, _gpu = tflops_per_gpu(spec)
    return 1.0 / breakeven.prefill_s_per_token(shape.active_params or shape.params, tflops, spec.hardware.tp)


def report(spec: KVCachePolicySpec, measured_nvme_gbps: float | None = None) -> breakeven.BreakEvenReport:
    tflops, gpu = tflops_per_gpu(spec)
    media = spec.hardware.media
    nvme = measured_nvme_gbps if measured_nvme_gbps else media.nvme_gbps
    return breakeven.evaluate(
        resolved_shape(spec.model), tflops_per_gpu=tflops, tp=spec.hardware.tp, kv_dtype=spec.model.kv_dtype,
        traffic=spec.traffic_class, media={"dram": media.dram_gbps, "rdma": media.rdma_gbps, "nvme": nvme},
        gpu_name=gpu,
    )


def verdicts(
    spec: KVCachePolicySpec, measured_nvme_gbps: float | None = None
) -> tuple[list[TierVerdict], list[Observation]]:
    rep = report(spec, measured_nvme_gbps)
    out = [
        _verdict("dram", rep.medium("dram"), rep, enabled=True),
        _verdict("peer", rep.medium("rdma"), rep, enabled=spec.tiers.peer.enabled),
        _nvme_verdict(spec, rep, measured_nvme_gbps),
    ]
    summary = Observation(
        TIERS_CONDITION, "True", "BreakEvenComputed",
        f"break-even {rep.break_even_gbps:.2f} GB/s: {rep.kv_bytes_per_token} B of KV per token, "
        f"recompute {rep.prefill_us_per_token:.1f} us/token on {rep.tp} x {rep.gpu} "
        f"({rep.tflops_per_gpu:g} dense TFLOP/s); " + ", ".join(f"{v.tier} {v.verdict} {v.ratio:.2f}x" for v in out),
    )
    return out, [summary, _nvme_condition(spec, rep, out[2])]


def _verdict(tier: str, m: breakeven.MediumVerdict, rep: breakeven.BreakEvenReport, *, enabled: bool) -> TierVerdict:
    return TierVerdict(
        tier=tier, bandwidth_gbps=round(m.effective_gbps, 3), break_even_gbps=round(rep.break_even_gbps, 3),
        ratio=round(m.ratio, 3), verdict=m.verdict if enabled else "off",
        reason=m.reason if enabled else "disabled in spec.tiers",
    )


def _nvme_verdict(spec: KVCachePolicySpec, rep: breakeven.BreakEvenReport, measured: float | None) -> TierVerdict:
    m = rep.medium("nvme")
    base = _verdict("nvme", m, rep, enabled=spec.tiers.nvme.mode == "on")
    if spec.tiers.nvme.mode == "shadow":
        base.verdict = "shadow"
        base.reason = f"measuring only (would be {m.verdict}: {m.reason})"
    if measured:
        base.measured_gbps = round(measured, 3)
    return base


def _nvme_condition(spec: KVCachePolicySpec, rep: breakeven.BreakEvenReport, v: TierVerdict) -> Observation:
    m = rep.medium("nvme")
    numbers = (
        f"NVMe {m.effective_gbps:.2f} GB/s vs break-even {rep.break_even_gbps:.2f} GB/s ({m.ratio:.2f}x): "
        f"fetching a token's KV takes {m.fetch_us_per_token:.1f} us, recomputing it "
        f"{rep.prefill_us_per_token:.1f} us"
    )
    mode = spec.tiers.nvme.mode
    if spec.traffic_class == "interactive" and m.ratio < 1.0:
        what = {"off": "tier off", "shadow": "shadow mode measures only, never serves"}.get(mode, mode)
        return Observation(NVME_CONDITION, "False", "SlowerThanRecompute",
                           f"{numbers}; refused for interactive traffic ({what})")
    if mode == "off":
        return Observation(NVME_CONDITION, "False", "Off", numbers)
    if mode == "shadow":
        return Observation(NVME_CONDITION, "False", "ShadowMeasuring", f"{numbers}; shadow mode measures only")
    reason = "FasterThanRecompute" if m.ratio >= 1.0 else "AllowedForBatch"
    return Observation(NVME_CONDITION, "True" if v.verdict == "serve" else "False", reason, f"{numbers}; {m.reason}")
