"""The DRAM tier: the core `LocalCache` indexing slots of the shared-memory arena.

A thin adapter: it owns the arena and the cache, and gives the rest of the sidecar
the handful of calls it needs (engine lookups, reservations a peer fetch or an engine
fills, peer-side pinning, warm-up listing) in the sidecar's terms. The cache itself is
thread-safe; peer-server threads and the event loop share it.
"""
from __future__ import annotations

from dataclasses import dataclass

import os

import numpy as np
import xxhash

from kvtier.admission import THRASH_RATIO
from kvtier.blockpool import slot_runs
from kvtier.cache import Hit, LocalCache, Reservation
from kvtier.keys import KeyRoot

from .arena import Arena

__all__ = ["DramTier", "TierHit", "Reservation"]

# Bytes of the unwritten-slot stamp at each stamped place (or the whole token row, when
# a row is shorter).
STAMP_BYTES = 8


@dataclass(slots=True)
class TierHit:
    """The DRAM tier's answer to a lookup, inside the sidecar: `slots` of the arena,
    pinned by the core cache's `handle` until `DramTier.release(handle)` (the engine
    gets an `EngineHit` over the socket)."""

    matched_tokens: int
    slots: list[int]
    handle: Hit

    def __bool__(self) -> bool:
        return self.matched_tokens > 0


class DramTier:
    """Implements `peer_tcp.PeerSource` too: peers are served from the same slots.

    Each slot carries the xxh3-64 digest of its block, computed once after the block
    is committed (off the request path) and sent with every peer fetch, so serving a
    peer costs a send, not a hash. A slot's digest is valid only for the generation of
    the slot it was computed for: every reservation bumps the generation, so a digest
    of old contents is never attached to new ones (at worst a receiver sees a
    mismatch and treats it as a miss).

    Slots an engine is to write are stamped first (`stamp`): a random 8-byte value,
    one per sidecar process, over the first and the last token of each (layer, K|V)
    row of the first kv head of every TP rank, in the canonical block. A commit
    publishes only the leading blocks whose every stamp was overwritten
    (`written_blocks`), so a store committed without being written — a stale ticket,
    a copy into the wrong slots or the wrong arena, a rank, a layer or K or V that
    never wrote — publishes nothing it did not write, never the slot's previous
    contents. Real KV matching the stamp at a place costs a miss, never wrong KV
    (2**-64 a place). One head a rank, not every head: each stamped place is a cache
    line and often a page of its own, and the proof must stay small beside the copy.
    """

    def __init__(self, arena: Arena, block_size: int, min_sightings: int, kv_heads: int,
                 thrash_ratio: float = THRASH_RATIO, token_row_bytes: int | None = None) -> None:
        self.arena = arena
        self.block_bytes = arena.block_bytes
        self.block_size = block_size
        self.kv_heads = kv_heads
        # One token's bytes of one (layer, plane, head) row: head_dim x dtype bytes.
        row = token_row_bytes or self.block_bytes // (block_size * kv_heads)
        if self.block_bytes % (row * block_size):
            raise ValueError(f"block of {self.block_bytes} bytes is not rows of {block_size} tokens x {row} bytes")
        if (self.block_bytes // (row * block_size)) % kv_heads:
            raise ValueError(f"block of {self.block_bytes} bytes is not (layer, plane) groups of {kv_heads} heads")
        self._row_bytes = row
        unit = np.uint64 if row % STAMP_BYTES == 0 else np.uint8
        self._stamp_unit = unit
        self._stamp_width = 1 if unit is np.uint64 else min(row, STAMP_BYTES)
        self._stamp = np.frombuffer(os.urandom(STAMP_BYTES), dtype=unit)[: self._stamp_width].copy()
        self.cache = LocalCache(arena.slots * arena.block_bytes, arena.block_bytes, block_size,
                                min_sightings=min_sightings, arena=arena.array, thrash_ratio=thrash_ratio)
        self._digest = np.zeros(arena.slots, dtype=np.uint64)
        self._generation = np.zeros(arena.slots, dtype=np.int64)
        self._digest_gen = np.full(arena.slots, -1, dtype=np.int64)

    # -- engine side --------------------------------------------------------------------

    def lookup(self, root: KeyRoot, tokens: np.ndarray) -> TierHit | None:
        """Pinned longest prefix (never the whole prompt). The core counts every call
        in its own stats, re-lookups after a peer fetch included; the sidecar's
        per-tenant hit rates (`metrics`) count each engine request once."""
        hit = self.cache.lookup(root, tokens)
        if not hit:
            return None
        return TierHit(hit.matched_tokens, list(hit.blocks), hit)

    def release(self, handle: Hit) -> None:
        self.cache.release(handle)

    def reserve(self, root: KeyRoot, tokens: np.ndarray, first_block: int | None, n_blocks: int | None,
                admit: bool) -> Reservation | None:
        """Slots for the uncached blocks of `tokens` (up to first_block + n_blocks when
        given). With `first_block` set, a reservation that does not start exactly
        there (the index changed meanwhile) is given back: the caller's blocks would
        land in the wrong places."""
        if first_block is not None and n_blocks is not None:
            tokens = tokens[: (first_block + n_blocks) * self.block_size]
        res = self.cache.reserve(root, tokens, force=not admit)
        if res is None:
            return None
        self._generation[res.slots] += 1  # these slots are about to hold new bytes
        if first_block is not None and res.first_block != first_block:
            self.cache.abort(res)
            return None
        return res

    def holds_all(self, root: KeyRoot, tokens: np.ndarray) -> bool:
        """Every full block of `tokens` is cached (a store of them has nothing to write)."""
        n_full = len(tokens) // self.block_size
        return self.cache.peek(root, tokens, allow_full=True) >= n_full * self.block_size

    def _stamp_places(self, first: int, count: int, tp: int) -> list[np.ndarray]:
        """Strided views of the stamped places of slots first..first+count-1: one view
        per stamped (head, token), each with one stamp per (slot, layer, plane) along
        its leading axis. The heads are 0..tp-1, the first head of each TP rank (a
        rank owns the heads h with h % tp == rank); the tokens are each row's first and
        last."""
        units = self.arena.slot_array(first, count).view(self._stamp_unit)
        per_token = self._row_bytes // self._stamp_unit().itemsize
        heads, tokens = range(min(tp, self.kv_heads)), sorted({0, self.block_size - 1})
        if self._stamp_width == 1:  # 8-byte units: 1-D strided views (numpy's fast path)
            per_group = self.kv_heads * self.block_size * per_token  # one (layer, plane)
            return [units[(h * self.block_size + t) * per_token :: per_group] for h in heads for t in tokens]
        groups = units.reshape(-1, self.kv_heads, self.block_size, per_token)
        return [groups[:, h, t, : self._stamp_width] for h in heads for t in tokens]

    def stamp(self, slots: list[int], tp: int = 1) -> None:
        """Mark `slots` unwritten (see the class docstring) before an engine writes them."""
        value = self._stamp[0] if self._stamp_width == 1 else self._stamp
        for _, slot, count in slot_runs(slots):
            for places in self._stamp_places(slot, count, tp):
                places[...] = value

    def written_blocks(self, slots: list[int], tp: int = 1) -> int:
        """How many leading `slots` have every stamp overwritten."""
        for first, slot, count in slot_runs(slots):
            unwritten = np.zeros(count, dtype=bool)
            for places in self._stamp_places(slot, count, tp):
                same = places == self._stamp[0] if self._stamp_width == 1 else (places == self._stamp).all(axis=-1)
                unwritten |= same.reshape(count, -1).any(axis=1)
            if unwritten.any():
                return first + int(np.argmax(unwritten))
        return len(slots)

    def commit(self, res: Reservation, verified_blocks: int, digests: list[int] | None = None) -> int:
        """Publish the first `verified_blocks` blocks of the reservation; never more.

        The core commits whole reservations, so a partial one is re-reserved at the
        verified length and its bytes copied over (the fault path only)."""
        if verified_blocks >= len(res.slots):
            if digests is not None:
                self._set_digests(res.slots, digests)
            return self.cache.commit(res)
        if verified_blocks <= 0:
            self.cache.abort(res)
            return 0
        saved = [self.slot_array(s).copy() for s in res.slots[:verified_blocks]]
        root, tokens, first = res.root, res.token_ids, res.first_block
        self.cache.abort(res)
        again = self.reserve(root, tokens, first, verified_blocks, admit=False)
        if again is None:
            return 0
        for block, slot in zip(saved, again.slots):
            self.slot_array(slot)[:] = block
        if len(again.slots) < verified_blocks:
            self.cache.abort(again)
            return 0
        if digests is not None:
            self._set_digests(again.slots, digests[:verified_blocks])
        return self.cache.commit(again)

    def _set_digests(self, slots: list[int], digests: list[int]) -> None:
        idx = np.asarray(slots[: len(digests)], dtype=np.int64)
        self._digest[idx] = np.asarray(digests[: len(idx)], dtype=np.uint64)
        self._digest_gen[idx] = self._generation[idx]

    def compute_digests(self, slots: list[int]) -> None:
        """Hash blocks whose digest is missing (after an engine store; background)."""
        for s in slots:
            gen = int(self._generation[s])
            if self._digest_gen[s] != gen:
                value = xxhash.xxh3_64_intdigest(self.arena.slot_view(s, 1))
                if self._generation[s] == gen:  # not reused while we hashed
                    self._digest[s] = value
                    self._digest_gen[s] = gen

    def block_digests(self, slots: list[int]) -> np.ndarray:
        """Digests of pinned slots, hashing any not computed yet."""
        idx = np.asarray(slots, dtype=np.int64)
        stale = idx[self._digest_gen[idx] != self._generation[idx]]
        if stale.size:
            self.compute_digests(stale.tolist())
        return self._digest[idx].copy()

    def abort(self, res: Reservation) -> None:
        if not res.done:
            self.cache.abort(res)

    # -- peer side ----------------------------------------------------------------------

    def pin_for_peer(self, root: KeyRoot, token_ids: np.ndarray, max_blocks: int) -> tuple[int, list[int], object] | None:
        tokens = token_ids[: max_blocks * self.block_size]
        if len(tokens) < self.block_size:
            return None
        hit = self.cache.lookup(root, tokens, allow_full=True)
        if not hit:
            return None
        return hit.matched_tokens, list(hit.blocks), hit

    def unpin(self, handle: object) -> None:
        self.cache.release(handle)  # type: ignore[arg-type]

    def slot_view(self, slot: int, count: int = 1) -> memoryview:
        return self.arena.slot_view(slot, count)

    def slot_array(self, slot: int, count: int = 1) -> np.ndarray:
        return self.arena.slot_array(slot, count)

    def hot_prefixes(self, tenant: str, max_bytes: int) -> list[tuple[KeyRoot, np.ndarray]]:
        return self.cache.hottest_prefixes(tenant, max_bytes)

    def hot_prompts(self, tenant: str, max_tokens: int) -> list[tuple[KeyRoot, np.ndarray, float]]:
        return self.cache.hot_prompts(tenant, max_tokens)

    # -- control ------------------------------------------------------------------------

    def invalidate(self, predicate) -> int:
        return self.cache.invalidate(predicate)

    def stats(self, tenant: str | None) -> dict:
        return self.cache.stats(tenant).as_dict()

    def occupancy(self) -> dict[str, float]:
        s = self.cache.stats(None)
        return {"bytes_used": s.bytes_used, "capacity_bytes": s.capacity_bytes, "evictions": s.evictions,
                "reserved_blocks": s.reserved_blocks, "admission_bar": s.admission_bar,
                "thrashing": float(s.thrashing), "window_blocks": s.window_blocks}
