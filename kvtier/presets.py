"""Named model shapes, GPUs and fetch media for the break-even calculator.

Parameter counts are the nominal ones the design's figures use (70B = 70e9), so
the calculator reproduces DESIGN "The numbers" exactly. GPU figures are DENSE
BF16 tensor throughput: the 2:4-sparsity headline (1,979 TFLOP/s on H100) is
twice the real figure for dense LLM weights and is never used here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What decides KV bytes and recompute FLOPs per token.

    `active_params` is what a mixture-of-experts runs per token (recompute uses it).
    `kv_elements_per_token` overrides 2 x layers x kv_heads x head_dim for caches
    that are not plain K and V, e.g. multi-head latent attention.
    """

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params: float
    active_params: float | None = None
    kv_elements_per_token: int | None = None

    @property
    def recompute_params(self) -> float:
        return self.active_params if self.active_params is not None else self.params

    def kv_elements(self) -> int:
        if self.kv_elements_per_token is not None:
            return self.kv_elements_per_token
        return 2 * self.layers * self.kv_heads * self.head_dim  # K and V


@dataclass(frozen=True, slots=True)
class Gpu:
    name: str
    dense_tflops: float  # BF16/FP16 dense tensor throughput per GPU, TFLOP/s


@dataclass(frozen=True, slots=True)
class Medium:
    name: str
    gbps: float  # achievable fetch bandwidth, GB/s (1e9 bytes/s)


# DeepSeek-V3 caches one compressed latent per token and layer: kv_lora_rank 512
# plus 64 decoupled RoPE dims, 61 layers -> 35,136 elements (70,272 B at bf16).
_DEEPSEEK_V3_LATENT = (512 + 64) * 61

MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama-3-8b", layers=32, kv_heads=8, head_dim=128, params=8e9),
        ModelShape("llama-3-70b", layers=80, kv_heads=8, head_dim=128, params=70e9),
        ModelShape("llama-3-405b", layers=126, kv_heads=8, head_dim=128, params=405e9),
        ModelShape("mistral-7b", layers=32, kv_heads=8, head_dim=128, params=7.24e9),
        # No GQA: every one of the 64 query heads has its own K and V.
        ModelShape("llama-2-70b", layers=80, kv_heads=64, head_dim=128, params=70e9),
        # MoE: 671B total, ~37B active per token; MLA cache (see above).
        ModelShape(
            "deepseek-v3", layers=61, kv_heads=1, head_dim=576, params=671e9,
            active_params=37e9, kv_elements_per_token=_DEEPSEEK_V3_LATENT,
        ),
    )
}

GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        Gpu("h100", 989.5),  # SXM BF16 dense; 1,979 is the 2:4-sparsity figure
        Gpu("h200", 989.5),  # same compute as H100, more and faster HBM
        Gpu("a100", 312.0),  # BF16 dense; 624 is the sparsity figure
    )
}

# DESIGN "The numbers": the media a KV block can be fetched from.
MEDIA: dict[str, Medium] = {
    m.name: m
    for m in (
        Medium("hbm3", 3350.0),
        Medium("dram", 64.0),  # host DRAM over PCIe5 x16
        Medium("rdma", 25.0),  # 200GbE / RDMA to a peer
        Medium("nvme", 7.0),  # one local NVMe drive
        Medium("object-store", 1.0),
    )
}


def model_preset(name: str) -> ModelShape:
    return _lookup(MODELS, name, "model")


def gpu_preset(name: str) -> Gpu:
    return _lookup(GPUS, name, "GPU")


def _lookup(table: dict, name: str, what: str):
    key = name.strip().lower().replace("_", "-")
    if key not in table:
        raise ValueError(f"unknown {what} preset {name!r}; choose one of: {', '.join(table)}")
    return table[key]
