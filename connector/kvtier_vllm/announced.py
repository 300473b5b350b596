"""The blocks a worker announced on vLLM's KV event stream (`events`), kept so that
what the sidecar removes is withdrawn: pure bookkeeping, no vLLM.

Keyed by the key chain's block hash (what the sidecar's removal log names), each with
the removal-log position at its store and the vLLM block hash it was announced under.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

ANNOUNCED_LIMIT = 1 << 18
"""Announced blocks a worker keeps track of (about 40 MB of bookkeeping at most)."""


class Announced:
    """The blocks this worker announced, by their key-chain hash (what the sidecar's
    removal log names): each with the removal-log position at its store (a removal
    before it was of an older copy) and the vLLM block hash it was announced under."""

    def __init__(self, limit: int = ANNOUNCED_LIMIT) -> None:
        self.limit = limit
        self.instance: str | None = None  # the sidecar process the blocks are in
        self.cursor: int | None = None  # the next removal-log position to read
        self._blocks: OrderedDict[bytes, tuple[int, Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def add(self, instance: str, position: int, kv_hashes: list[bytes], vllm_hashes: list[Any],
            per_vllm_block: int) -> list[Any]:
        """Announce a store's blocks (kvtier block j lies in vLLM block j // per_vllm_block);
        returns the vLLM hashes to withdraw: every earlier one when the sidecar is
        another process now, the oldest past the limit."""
        withdrawn = self.clear() if instance != self.instance else []
        self.instance = instance
        if self.cursor is None:
            self.cursor = position
        for j, h in enumerate(kv_hashes):
            v = j // per_vllm_block
            if v >= len(vllm_hashes):
                break
            self._blocks[h] = (position, vllm_hashes[v])
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.limit:
            withdrawn.append(self._blocks.popitem(last=False)[1][1])
        return withdrawn

    def removed(self, first_position: int, kv_hashes: list[bytes]) -> list[Any]:
        """The removal log from `first_position` on names `kv_hashes`: the vLLM hashes
        of the announced blocks among them (a removal logged before a block's store is
        of an older copy and withdraws nothing)."""
        out = []
        for i, h in enumerate(kv_hashes):
            entry = self._blocks.get(h)
            if entry is not None and entry[0] <= first_position + i:
                del self._blocks[h]
                out.append(entry[1])
        return out

    def clear(self) -> list[Any]:
        """Forget every announced block; returns their vLLM hashes."""
        out = [v for _, v in self._blocks.values()]
        self._blocks.clear()
        self.cursor = None
        return out
