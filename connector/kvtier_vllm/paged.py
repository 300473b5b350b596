"""The worker's paged KV: vLLM's layer tensors seen as kvtier blocks, and the copies
between them and arena slots (torch; no vLLM import, so benchmarks can drive it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .layouts import PagedLayout, block_places, block_views, copy_run, plan_runs

BIT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Copies move bits: KV is viewed as integers of its width (no float conversion paths)."""


@dataclass
class PagedKV:
    """`layers[l]` = (K, V) block views of layer l (`layouts.block_views`)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    dtype: torch.dtype    # an integer dtype of the KV's width (BIT_DTYPES)
    total_kv_heads: int
    head_dim: int
    block_size: int       # kvtier's
    manager_block: int    # vLLM's --block-size (the scheduler's block ids)
    page_tokens: int      # the attention kernel's page (manager_block or a divisor)
    tp: int = 1
    rank: int = 0

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor], layout: PagedLayout, total_kv_heads: int, head_dim: int,
                     block_size: int, manager_block: int, tp: int = 1, rank: int = 0) -> "PagedKV":
        bits = BIT_DTYPES[tensors[0].element_size()]
        layers = [block_views(t.view(bits), layout, head_dim, block_size) for t in tensors]
        page_tokens = layers[0][0].shape[1] * block_size
        return cls(layers, bits, total_kv_heads, head_dim, block_size, manager_block, page_tokens, tp, rank)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """One canonical block: (layers, K|V, all kv heads, block tokens, head_dim)."""
        return (len(self.layers), 2, self.total_kv_heads, self.block_size, self.head_dim)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def copy(self, arena, slots: list[int], block_ids: list[int], first_block: int, to_paged: bool) -> None:
        """Blocks first_block.. of a request (vLLM blocks `block_ids`) <-> arena `slots`."""
        if not slots:
            return
        places = block_places(block_ids, first_block, len(slots), self.block_size, self.manager_block,
                              self.page_tokens)
        for run in plan_runs(slots, places, self.page_tokens // self.block_size):
            raw = torch.from_numpy(arena.slot_array(run.slot, run.count))
            canon = raw.view(self.dtype).view(run.count, *self.block_shape)
            if self.tp > 1:
                canon = canon[:, :, :, self.rank :: self.tp]
            copy_run(self.layers, canon, run, to_paged)
