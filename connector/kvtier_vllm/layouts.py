"""vLLM's paged KV tensors <-> kvtier's canonical blocks, as views and run copies.

kvtier stores every block as (layers, K|V, kv_heads, block_tokens, head_dim)
(`kvtier.layout`); a TP rank owns the heads h % tp == rank (`shard_for_rank`). vLLM
keeps one tensor per attention layer, in pages of `page_tokens` tokens, laid out by
the attention backend:

  CPU_VEC      vLLM's CPU backend (CPU_ATTN) with its "vec" kernels (AVX2/AVX-512, fp32,
               fp16 or bf16 without AMX): a page is allocated as [kv_heads, page_tokens,
               2*head_dim], but each (page, head) holds K TRANSPOSED, [head_dim,
               page_tokens], followed by V as rows, [page_tokens, head_dim] (what
               cpu_attn_reshape_and_cache writes; tests/vllm pins it against the kernel).
               The other CPU kernels (amx, vec16, neon, ...) pack K differently and are
               refused.
  SPLIT_LAST   vLLM >= 0.32 GPU backends (FLASH_ATTN, TRITON_ATTN, FLASHINFER): a
               logical [pages, kv_heads, page_tokens, K|V] view (K in the first
               head_dim channels of each token, V in the rest), whatever the strides.
  KV_FIRST     vLLM < 0.32 GPU backends: [2, pages, page_tokens, kv_heads, head_dim].

`kv_views` turns a layer tensor into two (pages, kv_heads, page_tokens, head_dim)
views, K and V, whatever the layout, so one copy routine serves them all. Copies go
by runs: consecutive kvtier blocks that sit in consecutive arena slots and
consecutive pages (or consecutive sub-blocks of one page) move with one strided copy
per layer and plane, never token by token.

Works on numpy arrays and torch tensors alike (CPU or device), so the mapping is
tested without torch and run on vLLM's tensors unchanged.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

Array = Any
"""A numpy array or a torch tensor (this module never imports torch)."""


class PagedLayout(enum.Enum):
    CPU_VEC = "cpu_vec"
    SPLIT_LAST = "split_last"
    KV_FIRST = "kv_first"


BACKEND_LAYOUTS = {
    "CPU_ATTN": PagedLayout.CPU_VEC,
    "FLASH_ATTN": PagedLayout.SPLIT_LAST,
    "TRITON_ATTN": PagedLayout.SPLIT_LAST,
    "FLASHINFER": PagedLayout.SPLIT_LAST,
}
"""vLLM attention backends (get_name()) whose 0.32 paged layout is known here."""


class LayoutError(ValueError):
    """A KV tensor this connector does not know how to read: refused at start-up."""


CPU_KERNELS = ("vec",)
"""vLLM CPU attention kernels (its "isa") whose block interior CPU_VEC describes."""


def layout_for(backend: str, shape: Sequence[int], kv_heads: int, head_dim: int,
               cpu_kernel: str | None = None) -> PagedLayout:
    """The layout of a layer tensor of `shape` from attention backend `backend` (and,
    on CPU, kernel `cpu_kernel`); LayoutError naming what was seen when it is not one
    this module knows."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 5 and shape[0] == 2 and shape[3] == kv_heads and shape[4] == head_dim:
        return PagedLayout.KV_FIRST
    layout = BACKEND_LAYOUTS.get(backend)
    if layout is None:
        raise LayoutError(
            f"attention backend {backend!r} has a KV layout kvtier does not know "
            f"(known: {sorted(BACKEND_LAYOUTS)}); serve with one of those or without the connector")
    if layout is PagedLayout.CPU_VEC and cpu_kernel is not None and cpu_kernel not in CPU_KERNELS:
        raise LayoutError(f"vLLM's CPU attention kernel {cpu_kernel!r} packs KV in a way kvtier does not know "
                          f"(known: {list(CPU_KERNELS)}); serve fp32/fp16 with head_dim a multiple of 32")
    if len(shape) != 4 or shape[1] != kv_heads or shape[3] != 2 * head_dim:
        raise LayoutError(
            f"attention backend {backend!r} gave a KV tensor of shape {shape}; expected "
            f"[pages, {kv_heads} kv heads, page_tokens, {2 * head_dim}] (K|V of head_dim {head_dim})")
    return layout


def _permute(a: Array, axes: tuple[int, ...]) -> Array:
    return a.permute(*axes) if hasattr(a, "permute") else a.transpose(axes)


def _split_rows(a: Array, shape: tuple[int, ...]) -> Array:
    """`a` reshaped as a view, never a copy (a copy would make writes vanish)."""
    if hasattr(a, "permute"):
        return a.view(*shape)
    out = a.view()
    try:
        out.shape = shape  # raises instead of copying when no view exists
    except AttributeError as exc:
        raise LayoutError(f"a KV tensor of shape {a.shape} cannot be viewed as {shape}: {exc}") from None
    return out


def kv_views(layer: Array, layout: PagedLayout, head_dim: int) -> tuple[Array, Array]:
    """K and V of one layer tensor as (pages, kv_heads, page_tokens, head_dim) views."""
    if layout is PagedLayout.CPU_VEC:
        pages, heads, tokens, _ = layer.shape
        halves = _split_rows(layer, (pages, heads, 2, tokens * head_dim))
        k_t = _split_rows(halves[:, :, 0], (pages, heads, head_dim, tokens))
        return _permute(k_t, (0, 1, 3, 2)), _split_rows(halves[:, :, 1], (pages, heads, tokens, head_dim))
    if layout is PagedLayout.SPLIT_LAST:
        return layer[..., :head_dim], layer[..., head_dim:]
    if layout is PagedLayout.KV_FIRST:
        return _permute(layer[0], (0, 2, 1, 3)), _permute(layer[1], (0, 2, 1, 3))
    raise LayoutError(f"unknown layout {layout!r}")


def sub_block_view(plane: Array, block_tokens: int) -> Array:
    """(pages, heads, page_tokens, D) -> (pages, page_tokens // block_tokens, heads,
    block_tokens, D): a page's kvtier blocks side by side, still a view."""
    pages, heads, tokens, dim = plane.shape
    if tokens % block_tokens:
        raise LayoutError(f"kvtier block size {block_tokens} does not divide vLLM's page of {tokens} tokens")
    per_page = tokens // block_tokens
    if hasattr(plane, "permute"):
        split = plane.unflatten(2, (per_page, block_tokens))
    else:
        split = plane.reshape(pages, heads, per_page, block_tokens, dim)
        if not np.shares_memory(split, plane):
            raise LayoutError("page tokens cannot be split into kvtier blocks without a copy")
    return _permute(split, (0, 2, 1, 3, 4))


@dataclass(frozen=True, slots=True)
class Run:
    """`count` kvtier blocks: canonical index `first` on, arena slots `slot` on, in
    vLLM page `page` from sub-block `sub` (one page per block when a block fills a page,
    else `count` sub-blocks of one page)."""

    first: int
    slot: int
    page: int
    sub: int
    count: int


def block_places(block_ids: Sequence[int], first_block: int, n_blocks: int, block_tokens: int,
                 manager_tokens: int, page_tokens: int) -> list[tuple[int, int]]:
    """(page, sub-block) of kvtier blocks first_block .. first_block + n_blocks - 1.

    `block_ids` are the request's vLLM blocks (of `manager_tokens` tokens); a manager
    block b holds kernel pages b * (manager_tokens // page_tokens) + j."""
    pages_per_block = manager_tokens // page_tokens
    per_page = page_tokens // block_tokens
    places = []
    for i in range(first_block, first_block + n_blocks):
        token = i * block_tokens
        block = block_ids[token // manager_tokens]
        page = block * pages_per_block + (token % manager_tokens) // page_tokens
        places.append((page, (token % page_tokens) // block_tokens if per_page > 1 else 0))
    return places


def plan_runs(slots: Sequence[int], places: Sequence[tuple[int, int]], per_page: int) -> list[Run]:
    """Group blocks into runs contiguous on both sides (see Run)."""
    if len(slots) != len(places):
        raise ValueError(f"{len(slots)} slots for {len(places)} blocks")
    runs: list[Run] = []
    for i, (slot, (page, sub)) in enumerate(zip(slots, places)):
        if runs:
            r = runs[-1]
            next_place = (r.page + r.count, 0) if per_page == 1 else (r.page, r.sub + r.count)
            if slot == r.slot + r.count and (page, sub) == next_place:
                runs[-1] = Run(r.first, r.slot, r.page, r.sub, r.count + 1)
                continue
        runs.append(Run(i, int(slot), int(page), int(sub), 1))
    return runs


def _page_part(sub_view: Array, run: Run, per_page: int) -> Array:
    if per_page == 1:
        return sub_view[run.page : run.page + run.count, 0]
    return sub_view[run.page, run.sub : run.sub + run.count]


def block_views(layer: Array, layout: PagedLayout, head_dim: int, block_tokens: int) -> tuple[Array, Array]:
    """K and V of one layer as (pages, blocks per page, heads, block_tokens, D) views."""
    k, v = kv_views(layer, layout, head_dim)
    return sub_block_view(k, block_tokens), sub_block_view(v, block_tokens)


def copy_run(layers: Sequence[tuple[Array, Array]], canon: Array, run: Run, to_paged: bool) -> None:
    """Copy one run between canonical blocks `canon` ((count, L, 2, H, B, D): the
    run's slots, this rank's heads) and every layer's (K, V) from `block_views`."""
    for layer_index, planes in enumerate(layers):
        for plane_index, view in enumerate(planes):
            paged = _page_part(view, run, view.shape[1])
            flat = canon[:, layer_index, plane_index]
            if to_paged:
                _copy(paged, flat)
            else:
                _copy(flat, paged)


def _copy(dst: Array, src: Array) -> None:
    if hasattr(dst, "copy_"):
        dst.copy_(src)
    else:
        np.copyto(dst, src)
