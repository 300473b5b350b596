"""The worker's paged KV: vLLM's layer tensors seen as kvtier blocks, and the copies
between them and arena slots (no vLLM import, so benchmarks can drive it).

Copies move bits: KV is viewed as integers of its width, so no float conversion path
is ever taken. CPU tensors are copied as numpy views of the same memory by
`kvtier.memcopy`: one call per layer and run hands every piece (one block's layer,
~100 KiB for real models) to a compiled loop that writes with non-temporal stores, as
memcpy does only for copies of several MiB, so a load or save runs at the speed of one
big memcpy of the same bytes (single-threaded; torch's thread pool only adds hand-offs
to a memory-bound copy on a busy node). Device tensors are copied with torch, arena
bytes going through a CPU view.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from kvtier import memcopy

from .layouts import (
    LAYOUT_FORMATS, BlockFormat, PagedLayout, block_places, block_views, copy_run, format_shape, plan_runs,
    shard_blocks,
)

BIT_DTYPES = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32),
              8: (torch.int64, np.int64)}
"""KV element width -> the integer dtypes its bits are copied as (torch, numpy)."""


@dataclass
class PagedKV:
    """`layers[l]` = (K, V) block views of layer l (`layouts.block_views`), in the
    arena block format `fmt` the layout loads from and stores to."""

    layers: list[tuple[Any, Any]]
    itemsize: int
    on_cpu: bool
    total_kv_heads: int
    head_dim: int
    block_size: int       # kvtier's
    manager_block: int    # vLLM's --block-size (the scheduler's block ids)
    page_tokens: int      # the attention kernel's page (manager_block or a divisor)
    tp: int = 1
    rank: int = 0
    fmt: BlockFormat = BlockFormat.CANONICAL
    whole_pages: list[Any] | None = None
    """CPU_PAGES with one kvtier block per page: each layer as (pages, page elements),
    so a run moves as one copy per layer (K and V of every head together)."""

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor], layout: PagedLayout, total_kv_heads: int, head_dim: int,
                     block_size: int, manager_block: int, tp: int = 1, rank: int = 0) -> "PagedKV":
        itemsize = tensors[0].element_size()
        torch_bits, _ = BIT_DTYPES[itemsize]
        on_cpu = tensors[0].device.type == "cpu"
        arrays = [t.view(torch_bits).numpy() if on_cpu else t.view(torch_bits) for t in tensors]
        fmt = LAYOUT_FORMATS[layout]
        layers = [block_views(a, layout, head_dim, block_size, fmt) for a in arrays]
        page_tokens = layers[0][1].shape[1] * block_size
        whole = None
        if fmt is BlockFormat.CPU_PAGES and page_tokens == block_size and tp == 1:
            whole = [a.reshape(a.shape[0], -1) for a in arrays]
            if not all(np.shares_memory(w, a) for w, a in zip(whole, arrays)):
                whole = None  # a page that is not one contiguous run of memory: plane by plane
        return cls(layers, itemsize, on_cpu, total_kv_heads, head_dim, block_size, manager_block, page_tokens,
                   tp, rank, fmt, whole)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """One block's dimensions as the sidecar names them (its size is what must
        agree): (layers, K|V, all kv heads, block tokens, head_dim)."""
        return (len(self.layers), 2, self.total_kv_heads, self.block_size, self.head_dim)

    @property
    def format_shape(self) -> tuple[int, ...]:
        """One block's array shape in the arena, in this engine's block format."""
        return format_shape(self.fmt, len(self.layers), self.total_kv_heads, self.block_size, self.head_dim)

    def copy(self, arena, slots: list[int], block_ids: list[int], first_block: int, to_paged: bool,
             layer_ids: Sequence[int] | None = None) -> None:
        """Blocks first_block.. of a request (vLLM blocks `block_ids`) <-> arena `slots`,
        for the layers `layer_ids` (default: all)."""
        if not slots:
            return
        torch_bits, np_bits = BIT_DTYPES[self.itemsize]
        places = block_places(block_ids, first_block, len(slots), self.block_size, self.manager_block,
                              self.page_tokens)
        if self.whole_pages is not None and memcopy.native():
            self._stream_whole_pages(arena, slots, [page for page, _ in places], to_paged, layer_ids)
            return
        for run in plan_runs(slots, places, self.page_tokens // self.block_size):
            raw = arena.slot_array(run.slot, run.count).view(np_bits).reshape(run.count, *self.format_shape)
            if self.whole_pages is not None:
                self._copy_whole_pages(raw, run.page, to_paged, layer_ids)
                continue
            blocks = raw if self.on_cpu else torch.from_numpy(raw)
            copy_run(self.layers, shard_blocks(blocks, self.fmt, self.tp, self.rank), run, to_paged, self.fmt,
                     layer_ids)

    def copy_blocks(self, src, dst, src_slots: Sequence[int], dst_slots: Sequence[int]) -> None:
        """This rank's heads of blocks `src_slots` of `src` into `dst_slots` of `dst`
        (arena-like both, in this engine's block format): a staged store into the arena."""
        _, np_bits = BIT_DTYPES[self.itemsize]
        for s, d in zip(src_slots, dst_slots):
            a = src.slot_array(s, 1).view(np_bits).reshape(1, *self.format_shape)
            b = dst.slot_array(d, 1).view(np_bits).reshape(1, *self.format_shape)
            np.copyto(shard_blocks(b, self.fmt, self.tp, self.rank), shard_blocks(a, self.fmt, self.tp, self.rank))

    def _stream_whole_pages(self, arena, slots: list[int], pages: list[int], to_paged: bool,
                            layer_ids: Sequence[int] | None) -> None:
        """CPU_PAGES blocks, one page each: every (block, layer) piece of the request
        in one streaming call, however the slots and pages are scattered. Addresses
        come from the arena's and the layers' own arrays, so every piece lies inside
        them (`block_places` and the arena bound pages and slots)."""
        layers = np.arange(len(self.whole_pages)) if layer_ids is None else np.asarray(layer_ids, dtype=np.int64)
        block_bytes = arena.block_bytes
        piece = block_bytes // len(self.whole_pages)
        page_bytes = self.whole_pages[0].strides[0]
        if piece != self.whole_pages[0].shape[1] * self.itemsize or max(slots) >= arena.slots or \
                max(pages) >= self.whole_pages[0].shape[0] or min(slots) < 0 or min(pages) < 0:
            raise ValueError(f"slots {min(slots)}..{max(slots)} / pages {min(pages)}..{max(pages)} outside the "
                             f"arena ({arena.slots}) or the KV tensors ({self.whole_pages[0].shape[0]} pages)")
        bases = np.array([memcopy.address(self.whole_pages[int(layer)]) for layer in layers], dtype=np.int64)
        paged = bases[None, :] + np.asarray(pages, dtype=np.int64)[:, None] * page_bytes
        stored = (memcopy.address(arena.array) + np.asarray(slots, dtype=np.int64)[:, None] * block_bytes
                  + layers[None, :] * piece)
        stream = memcopy.stream_for(len(slots) * block_bytes)  # the request's, whatever layers this call moves
        if to_paged:
            memcopy.copy_pieces(paged.ravel(), stored.ravel(), piece, stream)
        else:
            memcopy.copy_pieces(stored.ravel(), paged.ravel(), piece, stream)

    def _copy_whole_pages(self, raw: np.ndarray, page: int, to_paged: bool,
                          layer_ids: Sequence[int] | None) -> None:
        """A run of CPU_PAGES blocks, one page each: per layer, `count` page-sized copies."""
        count = raw.shape[0]
        for layer in range(len(self.whole_pages)) if layer_ids is None else layer_ids:
            stored = raw[:, layer].reshape(count, -1)
            paged = self.whole_pages[layer][page : page + count]
            memcopy.copy(paged, stored) if to_paged else memcopy.copy(stored, paged)
