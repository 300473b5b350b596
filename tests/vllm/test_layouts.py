"""The paged-layout mapping on numpy arrays: every layout reads and writes the same
canonical blocks, by runs, for any TP rank and for kvtier blocks smaller than a page."""
from __future__ import annotations

import numpy as np
import pytest

from kvtier.layout import shard_for_rank
from kvtier_vllm.layouts import (
    LAYOUT_FORMATS,
    BlockFormat,
    LayoutError,
    PagedLayout,
    Run,
    block_places,
    block_planes,
    block_views,
    copy_run,
    format_for_device,
    format_shape,
    format_tag,
    kv_views,
    layout_for,
    plan_runs,
    shard_blocks,
)

L, H, D, PAGES = 3, 4, 8, 10


def _paged_from_kv(k: np.ndarray, v: np.ndarray, layout: PagedLayout) -> np.ndarray:
    """Build a layer tensor in `layout` from K, V of shape (pages, H, N, D), by the
    layout's own definition (not through kv_views)."""
    pages, heads, n, d = k.shape
    if layout is PagedLayout.CPU_VEC:
        k_t = k.transpose(0, 1, 3, 2).reshape(pages, heads, n * d)   # K as [D, N]
        both = np.concatenate([k_t, v.reshape(pages, heads, n * d)], axis=2)
        return both.reshape(pages, heads, n, 2 * d)                    # as vLLM allocates it
    if layout is PagedLayout.SPLIT_LAST:
        # physically [pages, N, H, 2D] (vLLM's LBNHC), viewed as logical [pages, H, N, 2D]
        physical = np.ascontiguousarray(np.concatenate([k, v], axis=3).transpose(0, 2, 1, 3))
        return physical.transpose(0, 2, 1, 3)
    return np.stack([k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)])  # [2, pages, N, H, D]


@pytest.mark.parametrize("layout", list(PagedLayout))
def test_kv_views_find_k_and_v_where_each_layout_keeps_them(layout):
    rng = np.random.default_rng(0)
    k = rng.standard_normal((PAGES, H, 32, D)).astype(np.float32)
    v = rng.standard_normal((PAGES, H, 32, D)).astype(np.float32)
    tensor = _paged_from_kv(k, v, layout)
    kk, vv = kv_views(tensor, layout, D)
    assert np.array_equal(kk, k) and np.array_equal(vv, v)
    assert np.shares_memory(kk, tensor) and np.shares_memory(vv, tensor)


def _arena(fmt: BlockFormat, slots: int, heads: int, block_tokens: int) -> np.ndarray:
    return np.zeros((slots, *format_shape(fmt, L, heads, block_tokens, D)), np.float32)


@pytest.mark.parametrize("layout", list(PagedLayout))
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("block_tokens", [32, 16])
def test_blocks_round_trip_between_arena_and_pages(layout, tp, block_tokens):
    """Store: pages -> arena slots; load: slots -> other pages of another engine;
    the loaded pages hold exactly the stored K and V, rank by rank."""
    rng = np.random.default_rng(1)
    fmt = LAYOUT_FORMATS[layout]
    page_tokens, total_heads = 32, H
    local = total_heads // tp
    n_blocks = 5
    prompt_pages = [7, 2, 3, 9, 0]  # the request's vLLM blocks (page size == manager size)
    arena = _arena(fmt, 16, total_heads, block_tokens)
    slots = [4, 5, 6, 11, 12]
    src_k = rng.standard_normal((tp, L, PAGES, local, page_tokens, D)).astype(np.float32)
    src_v = rng.standard_normal((tp, L, PAGES, local, page_tokens, D)).astype(np.float32)
    places = block_places(prompt_pages, 0, n_blocks, block_tokens, page_tokens, page_tokens)
    runs = plan_runs(slots, places, page_tokens // block_tokens)
    for rank in range(tp):
        layers = [block_views(_paged_from_kv(src_k[rank, l], src_v[rank, l], layout), layout, D, block_tokens, fmt)
                  for l in range(L)]
        for run in runs:
            blocks = shard_blocks(arena[run.slot : run.slot + run.count], fmt, tp, rank)
            copy_run(layers, blocks, run, to_paged=False, fmt=fmt)
    # another engine (another rank order, other pages) loads the same blocks
    dst_pages = [1, 8, 4, 5, 6]
    places = block_places(dst_pages, 0, n_blocks, block_tokens, page_tokens, page_tokens)
    runs = plan_runs(slots, places, page_tokens // block_tokens)
    for rank in reversed(range(tp)):
        tensors = [_paged_from_kv(np.zeros_like(src_k[rank, l]), np.zeros_like(src_v[rank, l]), layout)
                   for l in range(L)]
        layers = [block_views(t, layout, D, block_tokens, fmt) for t in tensors]
        for run in runs:
            copy_run(layers, shard_blocks(arena[run.slot : run.slot + run.count], fmt, tp, rank), run,
                     to_paged=True, fmt=fmt)
        for l, t in enumerate(tensors):
            k, v = kv_views(t, layout, D)
            for i in range(n_blocks):
                tok = i * block_tokens
                sp, dp, off = prompt_pages[tok // page_tokens], dst_pages[tok // page_tokens], tok % page_tokens
                assert np.array_equal(k[dp, :, off : off + block_tokens], src_k[rank, l, sp, :, off : off + block_tokens])
                assert np.array_equal(v[dp, :, off : off + block_tokens], src_v[rank, l, sp, :, off : off + block_tokens])


@pytest.mark.parametrize("block_tokens", [32, 16])
def test_cpu_pages_blocks_hold_the_page_bytes_so_a_load_is_plain_copies(block_tokens):
    """A CPU_PAGES block is, per layer and head, the bytes the CPU_VEC page keeps for its
    tokens (K transposed, then V): a whole-page block equals the page byte for byte."""
    rng = np.random.default_rng(3)
    k = rng.standard_normal((2, H, 32, D)).astype(np.float32)
    v = rng.standard_normal((2, H, 32, D)).astype(np.float32)
    page = _paged_from_kv(k, v, PagedLayout.CPU_VEC)
    fmt = BlockFormat.CPU_PAGES
    arena = _arena(fmt, 32 // block_tokens, H, block_tokens)
    per_page = 32 // block_tokens
    run = Run(first=0, slot=0, page=1, sub=0, count=per_page)
    copy_run([block_views(page, PagedLayout.CPU_VEC, D, block_tokens, fmt)] * L, arena, run, to_paged=False, fmt=fmt)
    if per_page == 1:
        assert np.array_equal(arena[0, 0].reshape(-1), page[1].reshape(-1))
    for b in range(per_page):
        kb, vb = block_planes(arena[b : b + 1], fmt, 0, D)
        span = slice(b * block_tokens, (b + 1) * block_tokens)
        assert np.array_equal(kb[0].transpose(0, 2, 1), k[1, :, span]) and np.array_equal(vb[0], v[1, :, span])


def test_the_block_format_is_named_in_the_key_root_and_matches_the_layout():
    assert format_for_device("cpu") is BlockFormat.CPU_PAGES is LAYOUT_FORMATS[PagedLayout.CPU_VEC]
    assert format_for_device("cuda") is BlockFormat.CANONICAL is LAYOUT_FORMATS[PagedLayout.SPLIT_LAST]
    assert format_tag("x", BlockFormat.CPU_PAGES) != format_tag("x", BlockFormat.CANONICAL)
    with pytest.raises(LayoutError, match="CPU_VEC page"):
        block_views(np.zeros((2, H, 32, 2 * D), np.float32), PagedLayout.SPLIT_LAST, D, 32, BlockFormat.CPU_PAGES)


def test_canonical_blocks_hold_all_heads_in_canonical_order():
    """Ranks 0 and 1 of TP 2 write heads 0,2 and 1,3: the slot reads like a TP-1 store."""
    rng = np.random.default_rng(2)
    k = rng.standard_normal((1, H, 32, D)).astype(np.float32)
    v = rng.standard_normal((1, H, 32, D)).astype(np.float32)
    arena = np.zeros((1, 1, 2, H, 32, D), np.float32)
    run = Run(first=0, slot=0, page=0, sub=0, count=1)
    for rank in range(2):
        mine = _paged_from_kv(k[:, rank::2], v[:, rank::2], PagedLayout.SPLIT_LAST)
        copy_run([block_views(mine, PagedLayout.SPLIT_LAST, D, 32)], shard_for_rank(arena, 2, rank), run,
                 to_paged=False)
    assert np.array_equal(arena[0, 0, 0], k[0]) and np.array_equal(arena[0, 0, 1], v[0])
    # the same blocks in CPU_PAGES keep the heads whole and in order too
    pages = np.zeros((1, 1, H, 2, 32 * D), np.float32)
    for rank in range(2):
        mine = _paged_from_kv(k[:, rank::2], v[:, rank::2], PagedLayout.CPU_VEC)
        copy_run([block_views(mine, PagedLayout.CPU_VEC, D, 32, BlockFormat.CPU_PAGES)],
                 shard_blocks(pages, BlockFormat.CPU_PAGES, 2, rank), run, to_paged=False, fmt=BlockFormat.CPU_PAGES)
    kb, vb = block_planes(pages, BlockFormat.CPU_PAGES, 0, D)
    assert np.array_equal(kb[0].transpose(0, 2, 1), k[0]) and np.array_equal(vb[0], v[0])


def test_runs_merge_only_blocks_contiguous_on_both_sides():
    places = [(3, 0), (4, 0), (5, 0), (9, 0), (10, 0)]
    assert plan_runs([7, 8, 20, 21, 22], places, 1) == [
        Run(0, 7, 3, 0, 2), Run(2, 20, 5, 0, 1), Run(3, 21, 9, 0, 2)]
    sub = [(3, 0), (3, 1), (4, 0), (4, 1)]
    assert plan_runs([1, 2, 3, 4], sub, 2) == [Run(0, 1, 3, 0, 2), Run(2, 3, 4, 0, 2)]


def test_block_places_split_manager_blocks_into_kernel_pages():
    # manager blocks of 64 tokens, kernel pages of 32, kvtier blocks of 16
    places = block_places([5, 2], 0, 8, 16, 64, 32)
    assert places == [(10, 0), (10, 1), (11, 0), (11, 1), (4, 0), (4, 1), (5, 0), (5, 1)]
    assert block_places([5, 2], 3, 2, 16, 64, 32) == [(11, 1), (4, 0)]


def test_known_backends_get_their_layout():
    assert layout_for("CPU_ATTN", (100, 2, 32, 128), 2, 64) is PagedLayout.CPU_VEC
    assert layout_for("FLASH_ATTN", (100, 2, 16, 128), 2, 64) is PagedLayout.SPLIT_LAST
    assert layout_for("FLASH_ATTN", (2, 100, 16, 2, 64), 2, 64) is PagedLayout.KV_FIRST


def test_other_cpu_kernels_are_refused_by_name():
    with pytest.raises(LayoutError, match="'amx'"):
        layout_for("CPU_ATTN", (100, 2, 32, 128), 2, 64, cpu_kernel="amx")
    assert layout_for("CPU_ATTN", (100, 2, 32, 128), 2, 64, cpu_kernel="vec") is PagedLayout.CPU_VEC


def test_unknown_backend_is_refused_with_the_known_ones_named():
    with pytest.raises(LayoutError, match=r"'MYSTERY_ATTN'.*CPU_ATTN"):
        layout_for("MYSTERY_ATTN", (100, 2, 32, 128), 2, 64)


def test_a_tensor_of_another_shape_is_refused_with_the_expected_shape():
    with pytest.raises(LayoutError, match=r"\(100, 2, 32, 64\).*2 kv heads.*128"):
        layout_for("CPU_ATTN", (100, 2, 32, 64), 2, 64)


def test_kvtier_blocks_must_divide_the_page():
    k = np.zeros((2, H, 32, D), np.float32)
    with pytest.raises(LayoutError, match="block size 24 does not divide vLLM's page of 32"):
        block_views(_paged_from_kv(k, k, PagedLayout.CPU_VEC), PagedLayout.CPU_VEC, D, 24)
