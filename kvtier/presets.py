"""Named model shapes, GPUs and fetch media for the break-even calculator.

Parameter counts are the nominal ones (70B = 70e9) that docs/ARCHITECTURE.md "The
numbers" uses, so the calculator reproduces those figures exactly. GPU figures are DENSE
BF16 tensor throughput: the 2:4-sparsity headline (1,979 TFLOP/s on H100) is
twice the real figure for dense LLM weights and is never used here.
"""
from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field
from pydantic.json_schema import SkipJsonSchema

from kvtier.dtypes import KvDtype
from kvtier.camel_model import CamelModel, CelRule


KV_PLANES = 2
"""K and V: the planes of an ordinary attention cache."""


def kv_plane_elements(layers: int, kv_heads: int, head_dim: int) -> int:
    """Elements of one plane of one token's cache: layers x kv_heads x head_dim."""
    return layers * kv_heads * head_dim


def kv_elements_fit(layers: int, kv_heads: int, head_dim: int, kv_elements_per_token: int) -> bool:
    """An explicit per-token cache size is whole planes of layers x kv_heads x head_dim:
    one (a latent per layer, MLA) or two (K and V)."""
    plane = kv_plane_elements(layers, kv_heads, head_dim)
    return kv_elements_per_token in (plane, KV_PLANES * plane)


# The one formula of KV size per token, for `ModelShape`, the sidecar's `ServedModel`,
# the canonical layout's `KVShape` and the break-even calculator: planes (K and V, or
# one latent when `kv_elements_per_token` says so) x layers x kv_heads x head_dim.

def kv_elements_per_token(layers: int, kv_heads: int, head_dim: int,
                          kv_elements_override: int | None = None) -> int:
    if kv_elements_override is not None:
        return kv_elements_override
    return KV_PLANES * kv_plane_elements(layers, kv_heads, head_dim)


def kv_planes(layers: int, kv_heads: int, head_dim: int, kv_elements_override: int | None = None) -> int:
    """2 (K and V) for ordinary attention, 1 for a latent cache (MLA)."""
    return kv_elements_per_token(layers, kv_heads, head_dim, kv_elements_override) \
        // kv_plane_elements(layers, kv_heads, head_dim)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int,
                       kv_elements_override: int | None = None) -> int:
    return kv_elements_per_token(layers, kv_heads, head_dim, kv_elements_override) * dtype_bytes


# One shape for the presets below, the KVCachePolicy's `spec.model.shape` and the
# break-even calculator; it owns KV bytes per token for a dtype. `active_params` is what a mixture-of-experts runs per token
# (recompute uses it); `kv_elements_per_token` overrides 2 x layers x kv_heads x
# head_dim for caches that are not plain K and V, e.g. multi-head latent attention.
class ModelShape(CamelModel):
    """The dimensions that decide KV bytes per token and recompute FLOPs per token."""

    # A label for reports (the preset's or the policy's model id); never on the wire.
    name: SkipJsonSchema[str] = Field(default="custom", exclude=True)
    layers: int = Field(ge=1, le=1024)
    kv_heads: int = Field(ge=1, le=1024)
    head_dim: int = Field(ge=1, le=4096)
    params: float = Field(gt=0, description="total parameters (e.g. 70e9)")
    active_params: float | None = Field(
        default=None, gt=0, description="parameters active per token (MoE); defaults to params"
    )
    kv_elements_per_token: int | None = Field(
        default=None, ge=1, description="caches that are not one K and one V per kv head (MLA): "
        "elements cached per token, i.e. layers x kvHeads x headDim for one latent per layer",
    )

    CEL_RULES = (
        CelRule(
            "!has(self.activeParams) || self.activeParams <= self.params",
            "model.shape.activeParams cannot exceed model.shape.params",
            lambda s: s.active_params is None or s.active_params <= s.params,
        ),
        CelRule(
            "!has(self.kvElementsPerToken) || self.kvElementsPerToken == self.layers * self.kvHeads * self.headDim"
            " || self.kvElementsPerToken == 2 * self.layers * self.kvHeads * self.headDim",
            "model.shape.kvElementsPerToken must be layers x kvHeads x headDim (one latent per layer, MLA) "
            "or twice that (K and V)",
            lambda s: s.kv_elements_per_token is None
            or kv_elements_fit(s.layers, s.kv_heads, s.head_dim, s.kv_elements_per_token),
        ),
    )

    @property
    def recompute_params(self) -> float:
        return self.active_params if self.active_params is not None else self.params

    def kv_elements(self) -> int:
        return kv_elements_per_token(self.layers, self.kv_heads, self.head_dim, self.kv_elements_per_token)

    def kv_bytes_per_token(self, dtype: KvDtype | str) -> int:
        """KV bytes one token takes in `dtype` (every layer, K and V or a latent)."""
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, KvDtype(dtype).itemsize,
                                  self.kv_elements_per_token)


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
        ModelShape(name="llama-3-8b", layers=32, kv_heads=8, head_dim=128, params=8e9),
        ModelShape(name="llama-3-70b", layers=80, kv_heads=8, head_dim=128, params=70e9),
        ModelShape(name="llama-3-405b", layers=126, kv_heads=8, head_dim=128, params=405e9),
        ModelShape(name="mistral-7b", layers=32, kv_heads=8, head_dim=128, params=7.24e9),
        # No GQA: every one of the 64 query heads has its own K and V.
        ModelShape(name="llama-2-70b", layers=80, kv_heads=64, head_dim=128, params=70e9),
        # MoE: 671B total, ~37B active per token; MLA cache (see above).
        ModelShape(
            name="deepseek-v3", layers=61, kv_heads=1, head_dim=576, params=671e9,
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

# docs/ARCHITECTURE.md "The numbers": the media a KV block can be fetched from.
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
