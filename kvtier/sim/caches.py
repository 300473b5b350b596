"""What a replica's prefix cache is in the simulation.

Three implementations behind one small interface (`ReplicaCache`):

- `KvtierCache`: the core library's real `LocalCache` in metadata-only mode (no
  arena: the index, admission, store queue and frequency-aware eviction all run,
  no KV bytes move). This is kvtier.
- `LruCache`: the baseline every engine ships: store every full block of every
  prompt, evict the least recently used block (tails before heads, as vLLM's
  free-queue order does). Hash-keyed, which is fine for a model of hit rate.
- `OracleCache`: infinite capacity and perfect routing, shared by the whole fleet:
  a prompt hits every block any earlier request of the same key root produced.
  The ceiling a routing policy is measured against.

Every cache applies the last-token rule: a hit covering the whole prompt gives back
its last block, so at least one token is computed.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from kvtier.admission import DEFAULT_MIN_SIGHTINGS
from kvtier.cache import LocalCache
from kvtier.eviction import EvictionConfig
from kvtier.keys import KeyRoot
from kvtier.sim.request import SimRequest


class ReplicaCache(Protocol):
    """One replica's cache as the event loop drives it. Lengths are in elements."""

    needs_hashes: bool

    def serve(self, req: SimRequest, root: KeyRoot, now_s: float) -> int:
        """Look the prompt up under `root`, account the request, store what it
        produced; returns the matched prefix in elements."""

    def peek(self, req: SimRequest, root: KeyRoot) -> int:
        """The prefix (elements) a lookup would match now, with no side effects."""

    def used_blocks(self) -> int:
        """Blocks currently held."""

    def drop_all(self) -> None:
        """Forget everything (a replica restarted onto new weights)."""


class SimClock:
    """The simulation's clock as a cache reads it (`LocalCache(clock=...)`): the event
    loop sets `now`, a call returns it (compiled with this module, a read runs no
    Python frame)."""

    __slots__ = ("now",)

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _hit_blocks(matched: int, n_elems: int, block_size: int) -> int:
    """Apply the last-token rule to a count of matched full blocks."""
    if matched * block_size >= n_elems:
        return max(0, matched - 1)
    return matched


class LruCache:
    """Plain LRU over chained block hashes; admits everything.

    Invariant: `_blocks` holds at most `capacity_blocks` hashes, least recently
    used first. A request touches and inserts its blocks tail-first, so within one
    prompt the head is the most recent and a prefix loses its tail before its head.
    """

    needs_hashes = True

    def __init__(self, capacity_blocks: int, block_size: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.evicted_blocks = 0

    def peek(self, req: SimRequest, root: KeyRoot) -> int:
        blocks = self._blocks
        m = 0
        for h in req.hashes(root):
            if h not in blocks:
                break
            m += 1
        return _hit_blocks(m, len(req.tokens), self.block_size) * self.block_size

    def serve(self, req: SimRequest, root: KeyRoot, now_s: float) -> int:
        matched = self.peek(req, root)
        blocks = self._blocks
        for h in reversed(req.hashes(root)):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        excess = len(blocks) - self.capacity_blocks
        for _ in range(max(0, excess)):
            blocks.popitem(last=False)
        self.evicted_blocks += max(0, excess)
        return matched

    def used_blocks(self) -> int:
        return len(self._blocks)

    def drop_all(self) -> None:
        self._blocks.clear()


class OracleCache:
    """Infinite capacity, perfect routing: every block ever produced is a hit."""

    needs_hashes = True

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._seen: set[bytes] = set()

    def peek(self, req: SimRequest, root: KeyRoot) -> int:
        seen = self._seen
        m = 0
        for h in req.hashes(root):
            if h not in seen:
                break
            m += 1
        return _hit_blocks(m, len(req.tokens), self.block_size) * self.block_size

    def serve(self, req: SimRequest, root: KeyRoot, now_s: float) -> int:
        matched = self.peek(req, root)
        self._seen.update(req.hashes(root))
        return matched

    def used_blocks(self) -> int:
        return len(self._seen)

    def drop_all(self) -> None:
        self._seen.clear()


class KvtierCache:
    """kvtier's real `LocalCache`, metadata-only, on the simulation's clock.

    Stores take the zero-copy path (`reserve` + `commit`) before the replica's next
    request, so the sim does not model store-queue overflow; the W-TinyLFU policy
    (window, frequency duel, window share chosen by miniature simulations), the pinned tier
    and leaf-first eviction run exactly as in the sidecar. `policy` replaces the default policy (ablations).
    """

    needs_hashes = False

    def __init__(self, capacity_bytes: int, block_bytes: int, block_size: int, clock,
                 min_sightings: int = DEFAULT_MIN_SIGHTINGS, policy: EvictionConfig | None = None) -> None:
        self.cache = LocalCache(capacity_bytes, block_bytes, block_size, min_sightings,
                                metadata_only=True, clock=clock, drain_budget_s=0.0, policy=policy)
        self.block_size = block_size

    def peek(self, req: SimRequest, root: KeyRoot) -> int:
        return self.cache.peek(root, req.tokens)

    def serve(self, req: SimRequest, root: KeyRoot, now_s: float) -> int:
        cache = self.cache
        hit = cache.lookup(root, req.tokens)
        matched = hit.matched_tokens
        cache.release(hit)
        res = cache.reserve(root, req.tokens)  # the zero-copy store path, applied at once
        if res is not None:
            cache.commit(res)
        return matched

    def used_blocks(self) -> int:
        return self.cache.stats().blocks_used

    def evictions(self) -> int:
        return self.cache.stats().evictions

    def drop_all(self) -> None:
        self.cache.invalidate(lambda root: True)

    def warm_from(self, other: KvtierCache, tenant: str, max_bytes: int) -> int:
        """Copy a tenant's hottest prefixes from `other` (the operator's warm-up on a
        membership change); returns blocks added."""
        added = 0
        for root, tokens in other.cache.hottest_prefixes(tenant, max_bytes):
            res = self.cache.reserve(root, tokens, force=True)
            if res is not None:
                added += self.cache.commit(res)
        return added
