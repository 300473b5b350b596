"""The pool of fixed-size block slots behind a `LocalCache`.

A slot is a `block_bytes` region of the arena at `slot * block_bytes`. The pool only
tracks which slots are free; it never decides what to evict. Cached blocks stay in
the index (hittable) after their last reader releases them: a slot leaves the index
only when the cache takes it back for new data (`LocalCache` evicts on allocation),
so "freed" KV stays hittable until its memory is actually reused (rule:
pinned-never-evicted).
"""
from __future__ import annotations

import heapq
from typing import NewType

SlotId = NewType("SlotId", int)


class BlockPool:
    """Fixed number of slots; hands out the lowest free ids first.

    Lowest-first keeps a fresh allocation's slots contiguous wherever the free space
    allows, which is what lets `materialize` copy a run of blocks in one copy.
    Invariant: every slot id in [0, num_slots) is either free (exactly once) or owned
    by exactly one holder (the index, a reservation, or an invalidated-but-pinned
    node); freeing a slot that is already free is a caller bug (RuntimeError).
    """

    __slots__ = ("num_slots", "_free", "_is_free")

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a block pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots))  # a heap; sorted is a valid heap
        self._is_free = bytearray(b"\x01") * num_slots

    @property
    def free_count(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[SlotId]:
        """Take up to `n` free slots (fewer if fewer are free), sorted ascending."""
        n = min(n, len(self._free))
        out = [heapq.heappop(self._free) for _ in range(n)]
        for s in out:
            self._is_free[s] = 0
        return out  # type: ignore[return-value]

    def give_back(self, slots: list[SlotId] | list[int]) -> None:
        """Return slots to the free set. Double frees are caller bugs."""
        if not slots:
            return
        for s in slots:
            if self._is_free[s]:
                raise RuntimeError(f"slot {s} freed twice")
            self._is_free[s] = 1
            heapq.heappush(self._free, s)

    def is_free(self, slot: int) -> bool:
        return bool(self._is_free[slot])


def slot_runs(slots: list[SlotId] | list[int]) -> list[tuple[int, int, int]]:
    """Split a block list into contiguous slot runs.

    Returns (first_block_index, first_slot, length) per run, so a copy of the blocks
    in order is one copy per run rather than one per block (one memcpy, one send).
    """
    runs: list[tuple[int, int, int]] = []
    if not slots:
        return runs
    start_i, start_s, prev = 0, slots[0], slots[0]
    for i in range(1, len(slots)):
        s = slots[i]
        if s != prev + 1:
            runs.append((start_i, start_s, i - start_i))
            start_i, start_s = i, s
        prev = s
    runs.append((start_i, start_s, len(slots) - start_i))
    return runs
