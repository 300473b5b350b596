"""Canonical TP-agnostic layout: the same stored blocks serve every TP degree."""
from __future__ import annotations

import numpy as np
import pytest

from kvtier.cache import LocalCache
from kvtier.keys import KeyRoot
from kvtier.layout import (
    KVShape,
    blocks_view,
    from_canonical_blocks,
    shard_for_rank,
    to_canonical_blocks,
    unshard,
)

SHAPE = KVShape(layers=3, kv_heads=8, head_dim=4, dtype="fp32", block_size=16)
ROOT = KeyRoot("t", "m", "w", "fp32", "r", "a")


def engine_kv(tokens: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (SHAPE.layers, SHAPE.kv_heads, tokens, SHAPE.head_dim)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


def test_block_bytes_follow_the_design_formula():
    assert KVShape(80, 8, 128, "fp16").kv_bytes_per_token == 327_680
    assert KVShape(80, 8, 128, "fp16").block_bytes == 327_680 * 16
    assert KVShape(80, 8, 128, "fp8").kv_bytes_per_token == 163_840
    assert SHAPE.block_bytes == 2 * 3 * 8 * 16 * 4 * 4


def test_canonical_round_trip_keeps_whole_blocks_only():
    k, v = engine_kv(40)
    blocks = to_canonical_blocks(k, v, SHAPE)
    assert blocks.shape == (2, 3, 2, 8, 16, 4) and blocks.flags.c_contiguous
    k2, v2 = from_canonical_blocks(blocks, SHAPE)
    assert np.array_equal(k2, k[:, :, :32]) and np.array_equal(v2, v[:, :, :32])


def test_canonical_block_order_is_layer_kv_head_token_dim():
    k, v = engine_kv(16)
    b = to_canonical_blocks(k, v, SHAPE)[0]
    assert np.array_equal(b[2, 0, 5, 7], k[2, 5, 7]) and np.array_equal(b[1, 1, 3], v[1, 3])


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_the_same_stored_blocks_serve_every_tp_degree(tp):
    cache = LocalCache(64 * SHAPE.block_bytes, SHAPE.block_bytes, block_size=16, drain_budget_s=0)
    tokens = np.arange(80, dtype=np.uint32)
    k, v = engine_kv(80)
    res = cache.reserve(ROOT, tokens, force=True)
    blocks = to_canonical_blocks(k, v, SHAPE)
    for i, off in enumerate(res.offsets):
        cache.arena[off:off + SHAPE.block_bytes] = blocks[res.first_block + i].reshape(-1).view(np.uint8)
    cache.commit(res)
    hit = cache.lookup(ROOT, np.append(tokens, 1))
    dst = np.empty(len(hit.blocks) * SHAPE.block_bytes, dtype=np.uint8)
    cache.materialize(hit, dst)
    stored = blocks_view(dst, SHAPE)
    per_rank = []
    for rank in range(tp):
        shard = shard_for_rank(stored, tp, rank)
        rk, rv = from_canonical_blocks(np.ascontiguousarray(shard), SHAPE)
        heads = [h for h in range(8) if h % tp == rank]
        assert np.array_equal(rk, k[:, heads, :80]) and np.array_equal(rv, v[:, heads, :80])
        per_rank.append(shard)
    assert np.array_equal(unshard(per_rank), stored)


def test_shard_is_a_writable_view_of_a_single_block():
    block = np.zeros(SHAPE.block_shape, dtype=np.float32)
    shard_for_rank(block, 4, 1)[...] = 1.0
    assert block[:, :, [1, 5]].all() and not block[:, :, [0, 2, 3, 4, 6, 7]].any()


@pytest.mark.parametrize("tp,rank", [(0, 0), (3, 0), (2, 2), (2, -1), (16, 0)])
def test_bad_tp_or_rank_raise_value_error(tp, rank):
    with pytest.raises(ValueError):
        shard_for_rank(np.zeros(SHAPE.block_shape), tp, rank)


def test_bad_shapes_raise_value_error():
    with pytest.raises(ValueError):
        KVShape(0, 8, 128)
    with pytest.raises(ValueError, match="dtype"):
        KVShape(2, 8, 128, "int4")
    k, v = engine_kv(16)
    with pytest.raises(ValueError):
        to_canonical_blocks(k[:, :4], v[:, :4], SHAPE)
    with pytest.raises(ValueError):
        blocks_view(bytes(SHAPE.block_bytes + 1), SHAPE)
