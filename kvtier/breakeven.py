"""Tier economics: when is fetching a prefix's KV cheaper than recomputing it?

    kv_bytes_per_token = 2 x layers x kv_heads x head_dim x dtype_bytes
    recompute FLOPs    = 2 x params per token (ACTIVE params for a MoE)
    prefill s/token    = 2 x params / (tp x dense FLOP/s per GPU)
    break_even_gbps    = kv_bytes_per_token / prefill s/token

The prefix length cancels, so whether a medium is worth a tier is a static
property of model + hardware. Two rules judge a medium and they can disagree:

- latency: fetch time < recompute time, i.e. effective bandwidth > break-even.
  Concurrent fetches share a medium, so the effective bandwidth is gbps / N.
- capacity: GPU-seconds a fetch costs < GPU-seconds recompute costs. A DMA
  costs ~0 GPU-seconds, so for batch traffic a slow medium can still pay.

Interactive traffic is judged by latency; batch traffic by capacity.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict

from kvtier import presets
from kvtier.dtypes import DEFAULT_KV_DTYPE, KvDtype
from kvtier.presets import MEDIA, Medium, ModelShape

# Bytes per KV element, by `kvtier.dtypes.KvDtype` name.
KV_DTYPE_BYTES: dict[str, int] = {d.value: d.itemsize for d in KvDtype}
# Recompute is a forward pass: one multiply and one add per parameter per token.
FLOPS_PER_PARAM_PER_TOKEN = 2
# A fetch is a DMA by a copy engine: the SMs keep running, so it costs ~0 GPU-seconds.
DMA_GPU_COST_FRACTION = 0.0
# The design's example prefix: a 2,000-token system prompt + document.
DEFAULT_PREFIX_TOKENS = 2000

Traffic = Literal["interactive", "batch"]
Verdict = Literal["serve", "refused"]


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    _positive(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes)
    return presets.kv_bytes_per_token(layers, kv_heads, head_dim, dtype_bytes)


def prefill_s_per_token(params: float, tflops_per_gpu: float, tp: int = 1) -> float:
    """Seconds of wall time to recompute one token's KV on `tp` GPUs."""
    _positive(params=params, tflops_per_gpu=tflops_per_gpu, tp=tp)
    return FLOPS_PER_PARAM_PER_TOKEN * params / (tp * tflops_per_gpu * 1e12)


def break_even_gbps(kv_bytes: float, params: float, tflops_per_gpu: float, tp: int = 1) -> float:
    """Fetch bandwidth (GB/s, 1e9 B/s) at which fetching a token's KV takes as long as recomputing it."""
    _positive(kv_bytes_per_token=kv_bytes)
    return kv_bytes / prefill_s_per_token(params, tflops_per_gpu, tp) / 1e9


class CapacityRule(BaseModel):
    """GPU-seconds per token: what recompute would burn vs what the fetch burns."""

    gpu_s_saved_per_token: float
    fetch_gpu_s_per_token: float
    helps: bool


class MediumVerdict(BaseModel):
    name: str
    gbps: float
    effective_gbps: float  # gbps / concurrency
    ratio: float  # effective_gbps / break_even_gbps; > 1 means fetch beats recompute
    fetch_us_per_token: float
    verdict: Verdict
    reason: str
    capacity: CapacityRule | None = None  # batch traffic only


class BreakEvenReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    model: str
    gpu: str
    tflops_per_gpu: float
    tp: int
    kv_dtype: str
    traffic: Traffic
    concurrency: int
    kv_bytes_per_token: int
    recompute_params: float
    prefill_us_per_token: float
    break_even_gbps: float
    prefix_tokens: int
    prefix_bytes: int
    prefix_recompute_ms: float
    media: list[MediumVerdict]

    def medium(self, name: str) -> MediumVerdict:
        return next(m for m in self.media if m.name == name)


def evaluate(
    shape: ModelShape,
    *,
    tflops_per_gpu: float,
    tp: int = 1,
    kv_dtype: str = DEFAULT_KV_DTYPE.value,
    traffic: Traffic = "interactive",
    concurrency: int = 1,
    media: Iterable[Medium] | Mapping[str, float] | None = None,
    kv_bytes_override: int | None = None,
    prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
    gpu_name: str = "custom",
) -> BreakEvenReport:
    """The full verdict for one model on one machine. ValueError names a bad argument."""
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPE_BYTES)}, got {kv_dtype!r}")
    if traffic not in ("interactive", "batch"):
        raise ValueError(f"traffic must be 'interactive' or 'batch', got {traffic!r}")
    _positive(concurrency=concurrency, prefix_tokens=prefix_tokens, tp=tp, tflops_per_gpu=tflops_per_gpu)
    kv_bytes = kv_bytes_override if kv_bytes_override is not None else shape.kv_bytes_per_token(kv_dtype)
    _positive(kv_bytes_per_token=kv_bytes)
    params = shape.recompute_params
    prefill_s = prefill_s_per_token(params, tflops_per_gpu, tp)
    be = break_even_gbps(kv_bytes, params, tflops_per_gpu, tp)
    verdicts = [
        _judge(m, kv_bytes, prefill_s, be, tp=tp, traffic=traffic, concurrency=concurrency)
        for m in _media(media)
    ]
    return BreakEvenReport(
        model=shape.name, gpu=gpu_name, tflops_per_gpu=tflops_per_gpu, tp=tp, kv_dtype=kv_dtype,
        traffic=traffic, concurrency=concurrency, kv_bytes_per_token=int(kv_bytes),
        recompute_params=params, prefill_us_per_token=prefill_s * 1e6, break_even_gbps=be,
        prefix_tokens=prefix_tokens, prefix_bytes=int(kv_bytes) * prefix_tokens,
        prefix_recompute_ms=prefill_s * prefix_tokens * 1e3, media=verdicts,
    )


def _judge(
    medium: Medium, kv_bytes: int, prefill_s: float, be_gbps: float, *, tp: int, traffic: Traffic, concurrency: int
) -> MediumVerdict:
    effective = medium.gbps / concurrency
    ratio = effective / be_gbps
    fetch_s = kv_bytes / (effective * 1e9)
    faster = ratio >= 1.0
    capacity = None
    if faster:
        verdict, reason = "serve", f"fetch {ratio:.1f}x faster than recompute"
    else:
        verdict, reason = "refused", f"slower than recompute ({ratio:.1f}x): refused for {traffic} traffic"
    if traffic == "batch":
        # GPU-seconds are per GPU: all tp GPUs recompute together, or wait together.
        saved = prefill_s * tp
        cost = fetch_s * tp * DMA_GPU_COST_FRACTION
        capacity = CapacityRule(gpu_s_saved_per_token=saved, fetch_gpu_s_per_token=cost, helps=cost < saved)
        if not faster and capacity.helps:
            verdict = "serve"
            reason = f"slower than recompute ({ratio:.1f}x) but frees GPU-seconds: allowed for batch traffic"
    return MediumVerdict(
        name=medium.name, gbps=medium.gbps, effective_gbps=effective, ratio=ratio,
        fetch_us_per_token=fetch_s * 1e6, verdict=verdict, reason=reason, capacity=capacity,
    )


def _media(media: Iterable[Medium] | Mapping[str, float] | None) -> list[Medium]:
    if media is None:
        return list(MEDIA.values())
    if isinstance(media, Mapping):
        media = [Medium(name, float(gbps)) for name, gbps in media.items()]
    out = list(media)
    for m in out:
        _positive(**{f"medium {m.name} gbps": m.gbps})
    return out


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not (value > 0) or value != value or value == float("inf"):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
