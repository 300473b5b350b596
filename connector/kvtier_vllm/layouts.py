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
views, K and V, whatever the layout. Copies go by runs: consecutive kvtier blocks that
sit in consecutive arena slots and consecutive pages (or consecutive sub-blocks of one
page) move with one strided copy per layer and plane, never token by token.

A block's bytes in the arena follow a `BlockFormat`:

  CANONICAL    (layers, K|V, kv_heads, block_tokens, head_dim), `kvtier.layout`'s order;
               GPU backends (copies on the device reorder at memory speed).
  CPU_PAGES    (layers, kv_heads, K|V, block_tokens * head_dim) with K stored
               TRANSPOSED, [head_dim, block_tokens], V as rows: per layer and head, the
               bytes a CPU_VEC page holds for those tokens. Loading a hit is then one
               contiguous copy per (block, layer, head, plane) instead of a per-element
               transpose, which on a CPU runs at a third of memcpy speed or less.

Both keep kv heads as a whole axis, so a TP rank still takes heads h % tp == rank.
The format is named in the key root (`format_tag`), so blocks written in one format
are never read by an engine expecting the other.

Works on numpy arrays and torch tensors alike (CPU or device), so the mapping is
tested without torch and run on vLLM's tensors unchanged.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvtier import memcopy

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


class BlockFormat(enum.Enum):
    CANONICAL = "canonical"
    CPU_PAGES = "cpu-pages"


LAYOUT_FORMATS = {
    PagedLayout.CPU_VEC: BlockFormat.CPU_PAGES,
    PagedLayout.SPLIT_LAST: BlockFormat.CANONICAL,
    PagedLayout.KV_FIRST: BlockFormat.CANONICAL,
}
"""The arena format each paged layout loads from and stores to."""


def format_for_device(device_type: str) -> BlockFormat:
    """The block format an engine on `device_type` writes: the scheduler knows only the
    device when it builds the key root; the worker checks its layout agrees."""
    return BlockFormat.CPU_PAGES if device_type == "cpu" else BlockFormat.CANONICAL


def format_tag(attn_impl_id: str, fmt: BlockFormat) -> str:
    """The key root's attention id with the block format in it."""
    return f"{attn_impl_id}+{fmt.value}"


def format_shape(fmt: BlockFormat, layers: int, heads: int, block_tokens: int, head_dim: int) -> tuple[int, ...]:
    """One block's array shape in `fmt` (heads: this array's kv heads)."""
    if fmt is BlockFormat.CPU_PAGES:
        return (layers, heads, 2, block_tokens * head_dim)
    return (layers, 2, heads, block_tokens, head_dim)


def head_axis(fmt: BlockFormat) -> int:
    """The kv-head axis of an array of blocks (count, *format_shape)."""
    return 2 if fmt is BlockFormat.CPU_PAGES else 3


def shard_blocks(blocks: Array, fmt: BlockFormat, tp: int, rank: int) -> Array:
    """The heads TP rank `rank` owns (h % tp == rank) of blocks (count, *format_shape), a view."""
    if tp == 1:
        return blocks
    index = [slice(None)] * head_axis(fmt) + [slice(rank, None, tp)]
    return blocks[tuple(index)]


def block_planes(blocks: Array, fmt: BlockFormat, layer: int, head_dim: int) -> tuple[Array, Array]:
    """K and V of `layer` in blocks (count, *format_shape), oriented as `block_views`
    gives the pages for that format: CANONICAL (count, H, B, D) both; CPU_PAGES K
    transposed (count, H, D, B), V (count, H, B, D)."""
    if fmt is BlockFormat.CANONICAL:
        return blocks[:, layer, 0], blocks[:, layer, 1]
    count, _, heads, _, flat = blocks.shape
    tokens = flat // head_dim
    return (_split_rows(blocks[:, layer, :, 0], (count, heads, head_dim, tokens)),
            _split_rows(blocks[:, layer, :, 1], (count, heads, tokens, head_dim)))


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


def _kt_view(layer: Array, head_dim: int) -> Array:
    """A CPU_VEC layer's K as stored: (pages, kv_heads, head_dim, page_tokens)."""
    pages, heads, tokens, _ = layer.shape
    halves = _split_rows(layer, (pages, heads, 2, tokens * head_dim))
    return _split_rows(halves[:, :, 0], (pages, heads, head_dim, tokens))


def kv_views(layer: Array, layout: PagedLayout, head_dim: int) -> tuple[Array, Array]:
    """K and V of one layer tensor as (pages, kv_heads, page_tokens, head_dim) views."""
    if layout is PagedLayout.CPU_VEC:
        pages, heads, tokens, _ = layer.shape
        halves = _split_rows(layer, (pages, heads, 2, tokens * head_dim))
        return (_permute(_kt_view(layer, head_dim), (0, 1, 3, 2)),
                _split_rows(halves[:, :, 1], (pages, heads, tokens, head_dim)))
    if layout is PagedLayout.SPLIT_LAST:
        return layer[..., :head_dim], layer[..., head_dim:]
    if layout is PagedLayout.KV_FIRST:
        return _permute(layer[0], (0, 2, 1, 3)), _permute(layer[1], (0, 2, 1, 3))
    raise LayoutError(f"unknown layout {layout!r}")


def _split_tokens(a: Array, axis: int, block_tokens: int) -> Array:
    """Split token axis `axis` of `a` into (blocks per page, block_tokens) and bring the
    blocks-per-page axis to position 1; still a view."""
    tokens = a.shape[axis]
    if tokens % block_tokens:
        raise LayoutError(f"kvtier block size {block_tokens} does not divide vLLM's page of {tokens} tokens")
    per_page = tokens // block_tokens
    if hasattr(a, "permute"):
        split = a.unflatten(axis, (per_page, block_tokens))
    else:
        split = a.reshape(*a.shape[:axis], per_page, block_tokens, *a.shape[axis + 1 :])
        if not np.shares_memory(split, a):
            raise LayoutError("page tokens cannot be split into kvtier blocks without a copy")
    return _permute(split, (0, axis, *(i for i in range(1, split.ndim) if i != axis)))


def sub_block_view(plane: Array, block_tokens: int) -> Array:
    """(pages, heads, page_tokens, D) -> (pages, page_tokens // block_tokens, heads,
    block_tokens, D): a page's kvtier blocks side by side, still a view."""
    return _split_tokens(plane, 2, block_tokens)


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


def _kt_sub_block_view(k_t: Array, block_tokens: int) -> Array:
    """(pages, heads, D, page_tokens) -> (pages, page_tokens // block_tokens, heads, D,
    block_tokens): each kvtier block's transposed K, still a view."""
    return _split_tokens(k_t, 3, block_tokens)


def block_views(layer: Array, layout: PagedLayout, head_dim: int, block_tokens: int,
                fmt: BlockFormat = BlockFormat.CANONICAL) -> tuple[Array, Array]:
    """K and V of one layer as (pages, blocks per page, heads, block_tokens, D) views;
    for CPU_PAGES, K as stored, (pages, blocks per page, heads, D, block_tokens)."""
    k, v = kv_views(layer, layout, head_dim)
    if fmt is BlockFormat.CPU_PAGES:
        if layout is not PagedLayout.CPU_VEC:
            raise LayoutError(f"block format {fmt.value} is the CPU_VEC page's; layout {layout.value} has another")
        return _kt_sub_block_view(_kt_view(layer, head_dim), block_tokens), sub_block_view(v, block_tokens)
    return sub_block_view(k, block_tokens), sub_block_view(v, block_tokens)


def copy_run(layers: Sequence[tuple[Array, Array]], blocks: Array, run: Run, to_paged: bool,
             fmt: BlockFormat = BlockFormat.CANONICAL, layer_ids: Sequence[int] | None = None) -> None:
    """Copy one run between arena blocks `blocks` ((count, *format_shape): the run's
    slots, this rank's heads) and the (K, V) from `block_views` (same `fmt`) of the
    layers `layer_ids` (default: every layer)."""
    for layer_index in range(len(layers)) if layer_ids is None else layer_ids:
        planes = layers[layer_index]
        head_dim = planes[1].shape[-1]
        for view, flat in zip(planes, block_planes(blocks, fmt, layer_index, head_dim)):
            paged = _page_part(view, run, view.shape[1])
            if to_paged:
                _copy(paged, flat)
            else:
                _copy(flat, paged)


def _copy(dst: Array, src: Array) -> None:
    if hasattr(dst, "copy_"):
        dst.copy_(src)
    else:
        memcopy.copy(dst, src)
