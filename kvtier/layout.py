"""The canonical, TP-agnostic KV layout (rule: key-root).

Every cached block is stored as one C-contiguous array

    [layer][K|V][kv_head][token][head_dim]        shape (L, 2, H, B, D)

whatever tensor-parallel degree produced it. A rank of a TP-t engine owns the kv
heads h with h % t == rank; `shard_for_rank` is a strided VIEW of those heads, so the
same stored blocks serve TP 1, 2, 4 and 8 and tp_degree stays out of the cache key.
Engine-side K and V arrays are [layer][kv_head][token][head_dim].
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.dtypes import DEFAULT_KV_DTYPE, KvDtype
from kvtier.keys import DEFAULT_BLOCK_SIZE, check_block_size
from kvtier.presets import KV_PLANES, kv_bytes_per_token

KV_DTYPES = {d.value: d.storage.type for d in KvDtype}
"""kv_dtype names to storage dtypes (`kvtier.dtypes.KvDtype`)."""

HEAD_AXIS = -3
"""The kv_head axis counted from the end, for one block or a stack of blocks."""


@dataclass(frozen=True, slots=True)
class KVShape:
    """The model shape that fixes a block's canonical size."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = DEFAULT_KV_DTYPE.value
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(KV_DTYPES)}, got {self.dtype!r}")
        check_block_size(self.block_size)

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(KV_DTYPES[self.dtype])

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, KV_PLANES, self.kv_heads, self.block_size, self.head_dim)

    @property
    def kv_bytes_per_token(self) -> int:
        """2 x layers x kv_heads x head_dim x dtype bytes (70B GQA-8 fp16: 327,680): this
        layout always holds K and V."""
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, self.np_dtype.itemsize)

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size


def to_canonical_blocks(k: np.ndarray, v: np.ndarray, shape: KVShape) -> np.ndarray:
    """Engine K, V ([layer][kv_head][token][head_dim]) -> canonical blocks.

    Only whole blocks are kept. Returns a C-contiguous array of shape
    (n_blocks, L, 2, H, B, D) in the shape's dtype.
    """
    L, H, B, D = shape.layers, shape.kv_heads, shape.block_size, shape.head_dim
    for name, a in (("k", k), ("v", v)):
        if a.ndim != 4 or a.shape[0] != L or a.shape[1] != H or a.shape[3] != D:
            raise ValueError(f"{name} must have shape ({L}, {H}, tokens, {D}), got {a.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
    n = k.shape[2] // B
    kv = np.stack([k[:, :, :n * B], v[:, :, :n * B]], axis=1)  # (L, 2, H, nB, D)
    kv = kv.reshape(L, KV_PLANES, H, n, B, D).transpose(3, 0, 1, 2, 4, 5)
    return np.ascontiguousarray(kv, dtype=shape.np_dtype)


def from_canonical_blocks(blocks: np.ndarray, shape: KVShape) -> tuple[np.ndarray, np.ndarray]:
    """Canonical blocks (n, L, 2, H', B, D) -> engine K, V ([layer][H'][n*B][head_dim]).

    H' may be a rank's share of the heads (a `shard_for_rank` result).
    """
    if blocks.ndim != 6 or blocks.shape[1:2] != (shape.layers,) or blocks.shape[2] != KV_PLANES \
            or blocks.shape[4:] != (shape.block_size, shape.head_dim):
        raise ValueError(f"blocks must have shape (n, {shape.layers}, 2, heads, {shape.block_size}, "
                         f"{shape.head_dim}), got {blocks.shape}")
    n, L, _, H, B, D = blocks.shape
    kv = blocks.transpose(1, 2, 3, 0, 4, 5).reshape(L, KV_PLANES, H, n * B, D)
    return np.ascontiguousarray(kv[:, 0]), np.ascontiguousarray(kv[:, 1])


def blocks_view(buf: np.ndarray | bytes | bytearray | memoryview, shape: KVShape) -> np.ndarray:
    """View raw canonical bytes (a materialized hit, say) as (n, L, 2, H, B, D)."""
    raw = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
    if raw.nbytes % shape.block_bytes:
        raise ValueError(f"{raw.nbytes} bytes is not a whole number of {shape.block_bytes}-byte blocks")
    return raw.view(shape.np_dtype).reshape(-1, *shape.block_shape)


def _check_tp(num_heads: int, tp: int, rank: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, {tp}), got {rank!r}")
    if num_heads % tp:
        raise ValueError(f"{num_heads} kv heads do not split evenly over tp={tp}")


def shard_for_rank(kv: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """The kv heads h with h % tp == rank, as a view (writable if `kv` is).

    `kv` is one canonical block (L, 2, H, B, D) or a stack (n, L, 2, H, B, D); the
    head axis is third from the end in both.
    """
    if kv.ndim < 3:
        raise ValueError(f"kv must have at least 3 dimensions, got shape {kv.shape}")
    _check_tp(kv.shape[HEAD_AXIS], tp, rank)
    index = [slice(None)] * kv.ndim
    index[kv.ndim + HEAD_AXIS] = slice(rank, None, tp)
    return kv[tuple(index)]


def unshard(shards: list[np.ndarray]) -> np.ndarray:
    """Inverse of `shard_for_rank` over all ranks: rank r's j-th head is head j*tp + r."""
    tp = len(shards)
    if tp < 1:
        raise ValueError("unshard needs at least one shard")
    first = shards[0]
    if any(s.shape != first.shape for s in shards):
        raise ValueError("shards must all have the same shape")
    axis = first.ndim + HEAD_AXIS
    out_shape = list(first.shape)
    out_shape[axis] *= tp
    out = np.empty(out_shape, dtype=first.dtype)
    for r, s in enumerate(shards):
        shard_for_rank(out, tp, r)[...] = s
    return out
