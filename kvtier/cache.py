"""`LocalCache`: the prefix index plus a fixed-capacity block store, in one process.

The engine-facing API (names fixed by the design):

    hit = cache.lookup(root, token_ids)      # Hit(matched_tokens, blocks, tier) | Miss()
    cache.materialize(hit, dst)              # one copy per contiguous slot run
    cache.store(root, token_ids, kv_blocks)  # queued, best effort, admission applies
    cache.release(hit)                       # unpin when the request finishes

and what the sidecar and the simulator build on:

* `arena=`: any writable buffer (a shared-memory mmap, say) holding the slots; block
  `slot` lives at `block_offset(slot)`. Default: a private numpy array.
  `metadata_only=True`: no arena at all; `store(..., kv_blocks=None)` is accepted and
  the real index/admission/eviction code runs at simulator speed.
* Zero-copy writers: `reserve(root, token_ids)` admits and allocates slots for the
  not-yet-cached blocks -> write each block at `reservation.offsets[i]` ->
  `commit(reservation)` (or `abort`).
* `drain(budget_s)` / `flush()` apply queued stores; `stats(tenant)`;
  `invalidate(predicate_on_root)`; `hottest_prefixes(tenant, max_bytes)` for warm-up.

The policy is W-TinyLFU over the prefix tree (`kvtier.eviction`): every store lands
in a small LRU window (free space is never refused); when the cache is full, a block
leaving the window enters the main region (also LRU) only if the frequency sketch
(every lookup sights every block of its prompt) has seen it `min_sightings` times;
the window's share is set by one `WindowTuner` (shipped: miniature simulations of
the cache at a few shares), picked once from the policy's `adapt`; eviction takes
unpinned leaves, tails first, so no block outlives its parent.

Queued stores are applied in small time-bounded slices by whoever calls `store` or
`drain` (never by a background thread that would hold the GIL against lookups);
`lookup` never applies stores. The cache is thread-safe (one lock); block copies in
`materialize` and in applying a store run outside the lock, on pinned or reserved slots.
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from kvtier.admission import (
    DEFAULT_MIN_SIGHTINGS,
    THRASH_RATIO,
    HOT_SIGHTINGS,
    FrequencyFilter,
    CountMinSketch,
    Placement,
    StoreQueue,
    placement,
)
from kvtier.blockpool import BlockPool, slot_runs
from kvtier.eviction import (
    DEFAULT_HALF_LIFE_S,
    MAIN,
    WINDOW,
    DecayedFrequencyPolicy,
    EvictionConfig,
    WindowTuner,
    make_tuner,
)
from kvtier.keys import (
    DEFAULT_BLOCK_SIZE,
    TOKEN_DTYPE,
    BlockHash,
    KeyRoot,
    as_token_array,
    chain_hashes,
    check_block_size,
)
from kvtier.radix import Match, Node, PrefixIndex

TIER_DRAM = "dram"
TIER_PINNED = "pinned"
TIERS = (TIER_PINNED, TIER_DRAM)

MAX_TENANT_COUNTERS = 10_000
"""Per-tenant lookup counters are kept for this many most recently active tenants;
the others count only in the whole-cache totals, so a million one-off tenants cost
no memory here (the sidecar's own top-N table is what reports tenants)."""

DEFAULT_QUEUE_CAPACITY = 256
"""Pending stores; each holds a reference to its KV until applied, so keep it modest."""

DEFAULT_DRAIN_BUDGET_S = 0.0005
"""Each `store` call applies queued stores for at most ~0.5 ms (at least one)."""

PINNED_FRACTION = 0.10
"""At most a tenth of the main region may be hot (pinned tier): hot prefixes must not
starve the DRAM tier that absorbs everything else, and as the window grows toward
plain LRU the pinned tier shrinks with main (a prefix hot once must not hold slots
against recency when the traffic asks for LRU)."""

PIN_MAX_FRACTION = 0.02
"""One prefix may be pinned only if it is small: at most 2% of the capacity."""

REMOVAL_LOG_BLOCKS = 1 << 16
"""The newest block removals the cache can name (`removed_since`); a reader further
behind is told the log cannot say."""


@dataclass(slots=True, eq=False, init=False)
class Hit:
    """A pinned prefix match. `blocks[i]` is the slot of prompt block i.

    `matched_tokens` is a multiple of the block size and, unless the lookup was made
    with `allow_full=True`, strictly less than the prompt length. Release it exactly
    once with `LocalCache.release`.
    """

    matched_tokens: int
    blocks: list[int]
    tier: str
    root: KeyRoot
    _node: Node = field(repr=False)
    _owner: Any = field(repr=False)
    released: bool = False

    def __init__(self, matched_tokens: int, blocks: list[int], tier: str, root: KeyRoot, _node: Node,
                 _owner: Any, released: bool = False) -> None:
        # Written out (not the dataclass's): compiled with the module, no interpreted
        # frame per lookup.
        self.matched_tokens = matched_tokens
        self.blocks = blocks
        self.tier = tier
        self.root = root
        self._node = _node
        self._owner = _owner
        self.released = released

    def __bool__(self) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class Miss:
    """Nothing usable is cached: prefill everything."""

    matched_tokens: int = 0
    blocks: tuple = ()
    tier: str = "none"

    def __bool__(self) -> bool:
        return False


_MISS = Miss()
"""Every miss is the same immutable answer: one instance, not one a lookup."""


@dataclass(slots=True, eq=False, init=False)
class Reservation:
    """Slots allocated for prompt blocks [first_block, first_block + len(slots)).

    Write block `first_block + i` (canonical layout, `block_bytes` long) at byte offset
    `offsets[i]` of the arena, then `commit`; or `abort`. Until then nothing can hit
    these blocks and nothing can evict the cached prefix they extend.
    """

    root: KeyRoot
    token_ids: np.ndarray
    first_block: int
    slots: list[int]
    offsets: list[int]
    tier: str
    _hashes: list[BlockHash] = field(repr=False)
    _parent: Node | None = field(repr=False)
    _owner: Any = field(repr=False)
    done: bool = False
    cancelled: bool = False
    _token_bytes: bytes = field(default=b"", repr=False)

    def __init__(self, root: KeyRoot, token_ids: np.ndarray, first_block: int, slots: list[int],
                 offsets: list[int], tier: str, _hashes: list[BlockHash], _parent: Node | None, _owner: Any,
                 done: bool = False, cancelled: bool = False, _token_bytes: bytes = b"") -> None:
        # Written out, as Hit's.
        self.root = root
        self.token_ids = token_ids
        self.first_block = first_block
        self.slots = slots
        self.offsets = offsets
        self.tier = tier
        self._hashes = _hashes
        self._parent = _parent
        self._owner = _owner
        self.done = done
        self.cancelled = cancelled
        self._token_bytes = _token_bytes

    @property
    def num_blocks(self) -> int:
        return len(self.slots)


@dataclass(slots=True)
class _PendingStore:
    root: KeyRoot
    token_ids: np.ndarray
    end_block: int
    kv: np.ndarray | None
    sightings: int


@dataclass(slots=True)
class _TenantCounters:
    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    matched_tokens: int = 0
    stored_blocks: int = 0
    tier_hits: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIERS})


@dataclass(slots=True)
class CacheStats:
    """A snapshot of the cache; per-tenant when asked for a tenant.

    Lookup, hit, token, stored and byte figures are the tenant's own when `tenant` is
    set; admission, thrash and queue state are cache-wide either way. A tenant's own
    lookup figures are kept while it is among the `MAX_TENANT_COUNTERS` most recently
    active, its evictions while it holds blocks; the whole-cache figures count
    everything.
    """

    tenant: str | None
    lookups: int
    hits: int
    misses: int
    hit_rate: float
    prompt_tokens: int
    matched_tokens: int
    token_hit_rate: float
    stored_blocks: int
    blocks_used: int
    bytes_used: int
    capacity_bytes: int
    evictions: int
    tier_hits: dict[str, int]
    pinned_bytes: int
    admission_bar: int
    min_sightings: int
    admission_admits: int
    admission_rejects: int
    window_blocks: int
    window_target_blocks: int
    main_blocks: int
    thrashing: bool
    thrash_events: int
    queue_depth: int
    queue_capacity: int
    queue_drops: int
    stores_enqueued: int
    stores_applied: int
    invalidated_blocks: int
    reserved_blocks: int

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]


class LocalCache:
    """Prefix index + fixed-capacity block store (see the module docstring)."""

    def __init__(self, capacity_bytes: int, block_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 min_sightings: int = DEFAULT_MIN_SIGHTINGS, arena: Any = None, *,
                 metadata_only: bool = False, clock: Callable[[], float] | None = None,
                 queue_capacity: int = DEFAULT_QUEUE_CAPACITY,
                 drain_budget_s: float = DEFAULT_DRAIN_BUDGET_S,
                 half_life_s: float = DEFAULT_HALF_LIFE_S, hot_sightings: int = HOT_SIGHTINGS,
                 pinned_fraction: float = PINNED_FRACTION, pin_max_bytes: int | None = None,
                 sketch: CountMinSketch | None = None, policy: EvictionConfig | None = None,
                 thrash_ratio: float = THRASH_RATIO) -> None:
        for name, v in (("capacity_bytes", capacity_bytes), ("block_bytes", block_bytes)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if capacity_bytes < block_bytes:
            raise ValueError(f"capacity_bytes ({capacity_bytes}) must hold at least one block of {block_bytes} bytes")
        if drain_budget_s < 0 or not 0 <= pinned_fraction <= 1 or not 0 < thrash_ratio <= 1:
            raise ValueError("drain_budget_s must be >= 0, pinned_fraction in [0, 1] and thrash_ratio in (0, 1]")
        self.thrash_ratio = thrash_ratio
        self._thrash_events = 0
        self.block_size = check_block_size(block_size)
        self.block_bytes = int(block_bytes)
        self.num_slots = int(capacity_bytes) // self.block_bytes
        self.capacity_bytes = self.num_slots * self.block_bytes
        self.metadata_only = metadata_only
        self.clock = clock or time.monotonic
        self.drain_budget_s = drain_budget_s
        self.hot_sightings = hot_sightings
        self.pinned_fraction = pinned_fraction
        self.pin_max_bytes = (int(self.capacity_bytes * PIN_MAX_FRACTION)
                              if pin_max_bytes is None else int(pin_max_bytes))
        self._arena = self._make_arena(arena)
        self._pool = BlockPool(self.num_slots)
        self._index = PrefixIndex(self.block_size, DecayedFrequencyPolicy(half_life_s), self.clock)
        self.policy = policy or EvictionConfig()
        self._admission = FrequencyFilter(min_sightings, sketch=sketch or CountMinSketch.for_slots(
            self.num_slots, doorkeeper=self.policy.doorkeeper))
        self._tuner: WindowTuner = make_tuner(self.policy, self.num_slots, min_sightings)
        # Every block eviction takes from the tree, named in a bounded log for readers
        # that announced the blocks elsewhere (the connector's KV events).
        self._removed: deque[BlockHash] = deque(maxlen=REMOVAL_LOG_BLOCKS)
        self._removed_seq = 0  # removals ever logged (an invalidation counts one)
        self._removal_reset = 0  # the seq of the last removal the log cannot name
        self._index.on_evict = self._evicted
        self._duel = self._duel_tails if self.policy.duel else None
        self._set_targets(self._tuner.window_target)
        self._queue: StoreQueue[_PendingStore] = StoreQueue(queue_capacity)
        self._lock = threading.RLock()
        self._reservations: dict[int, Reservation] = {}
        self._tenants: OrderedDict[str, _TenantCounters] = OrderedDict()  # least recently active first
        self._total = _TenantCounters()  # every tenant's, including those no longer in `_tenants`
        self._evictions = 0
        self._stores_enqueued = 0
        self._stores_applied = 0
        self._invalidated_blocks = 0
        self._reserved_blocks = 0
        self._chain_memo: tuple[KeyRoot, bytes, int, list[BlockHash]] | None = None
        self._match_memo: tuple[KeyRoot, bytes, Node] | None = None

    # ------------------------------------------------------------------ engine API

    def lookup(self, root: KeyRoot, token_ids: Any, *, allow_full: bool = False) -> Hit | Miss:
        """Longest cached block-aligned prefix of the prompt, pinned until `release`.

        At least one token is always left to compute: a hit covering the whole prompt
        gives back its last block. `allow_full=True` lifts that cap for callers that
        are not engines (peer serving, warm-up). Every lookup counts one sighting of
        the prompt's uncached blocks for admission.
        """
        tokens = as_token_array(token_ids)
        tb = tokens.tobytes()
        n_full = len(tokens) // self.block_size
        limit = n_full if allow_full else (len(tokens) - 1) // self.block_size
        with self._lock:
            m = self._index.match(root, tb, n_full)
            hashes = self._sight(root, tb, m, n_full)
            counters, total = self._tenant(root.tenant), self._total
            counters.lookups += 1
            counters.prompt_tokens += len(tokens)
            total.lookups += 1
            total.prompt_tokens += len(tokens)
            matched = min(m.cached_blocks, limit)
            self._adapt(hashes, limit, matched, m.cached_blocks)
            if matched == 0:
                return _MISS
            node = self._index.pin(self._index.truncate(m, matched))  # truncate gives m back when nothing is cut
            self._match_memo = (root, tb, node)
            if not node.hot:
                self._maybe_promote(node, matched)
            tier = TIER_PINNED if node.hot else TIER_DRAM
            counters.hits += 1
            counters.matched_tokens += matched * self.block_size
            counters.tier_hits[tier] += 1
            total.hits += 1
            total.matched_tokens += matched * self.block_size
            total.tier_hits[tier] += 1
            return Hit(matched * self.block_size, self._index.slots_to(node), tier, root, node, self)

    def peek(self, root: KeyRoot, token_ids: Any, *, allow_full: bool = False) -> int:
        """Tokens a `lookup` would match right now, without pinning, counting a
        sighting or touching frequencies (routers ask this of many replicas)."""
        tokens = as_token_array(token_ids)
        n_full = len(tokens) // self.block_size
        limit = n_full if allow_full else (len(tokens) - 1) // self.block_size
        with self._lock:
            m = self._index.match(root, tokens.tobytes(), n_full)
            return min(m.cached_blocks, limit) * self.block_size

    def materialize(self, hit: Hit, dst: Any) -> int:
        """Copy the hit's blocks, in prompt order, into the start of `dst`.

        `dst` is any writable buffer (bytearray, mmap, C-contiguous ndarray) of at
        least `len(hit.blocks) * block_bytes` bytes. Each contiguous slot run is one
        copy. Returns the bytes written.
        """
        self._check_hit(hit)
        if self._arena is None:
            raise RuntimeError("materialize needs a payload arena; this cache is metadata_only")
        out = _writable_bytes(dst, "dst")
        bb = self.block_bytes
        need = len(hit.blocks) * bb
        if out.nbytes < need:
            raise ValueError(f"dst holds {out.nbytes} bytes; the hit needs {need}")
        arena = self._arena
        for i, s, k in slot_runs(hit.blocks):
            out[i * bb:(i + k) * bb] = arena[s * bb:(s + k) * bb]
        return need

    def store(self, root: KeyRoot, token_ids: Any, kv_blocks: Any = None) -> bool:
        """Offer the KV of every full block of the prompt to the cache.

        `kv_blocks` holds those blocks back to back in the canonical layout
        (`(len(token_ids) // block_size) * block_bytes` bytes; None only when
        metadata_only). It is referenced, not copied, until the store is applied: do
        not overwrite it afterwards. Every not-yet-cached block is stored, into the
        window; the store is queued by value and applied later (here, in a slice of
        at most `drain_budget_s`, or by `drain`/`flush`). Returns whether it was queued.
        """
        tokens = as_token_array(token_ids)
        n_full = len(tokens) // self.block_size
        kv = self._check_payload(kv_blocks, n_full)
        if n_full == 0:
            return False
        tb = tokens.tobytes()
        with self._lock:
            m = self._match(root, tb, n_full)
            first = m.cached_blocks
            if first == n_full:
                return False
            sightings = max(1, self._admission.frequency(self._chain_from(m, root, tb)[0]))
            pending = _PendingStore(root, tokens, n_full, kv, sightings)
            dropped = self._queue.push(n_full * self.block_size * sightings, pending)
            self._stores_enqueued += 1
        if self.drain_budget_s > 0:
            self.drain(self.drain_budget_s)
        return dropped is not pending

    def release(self, hit: Hit | Miss) -> None:
        """Unpin a hit when its request finishes. Releasing a Miss unpins nothing;
        releasing a hit twice is a ValueError. Either lets the window tuner catch up
        on the lookups queued so far, off the lookup path."""
        self._catch_up_tuner()
        if isinstance(hit, Miss):
            return
        with self._lock:
            self._check_hit(hit)
            hit.released = True
            freed = self._index.unpin(hit._node)
            if freed:  # blocks of an invalidated prefix whose last reader this was
                self._pool.give_back(freed)

    # ------------------------------------------------------------------ zero-copy path

    def reserve(self, root: KeyRoot, token_ids: Any, *, force: bool = False) -> Reservation | None:
        """Allocate slots for the prompt's not-yet-cached full blocks.

        Returns None when everything is already cached or no slot can be freed.
        The blocks go to the window as its most recent, like every stored block (so
        a whole-cache window stays exactly LRU); `force=True` (warm-up of prefixes hot
        elsewhere, a peer's copy) only lets them take slots whatever their sightings.
        The caller writes the blocks into the arena and then `commit`s.
        """
        tokens = as_token_array(token_ids)
        n_full = len(tokens) // self.block_size
        tb = tokens.tobytes()
        with self._lock:
            m = self._match(root, tb, n_full)
            first = m.cached_blocks
            if first == n_full:
                return None
            sightings = self._admission.bar if force else None
            return self._reserve_from(m, root, tokens, tb, n_full, sightings, forced=force)

    def commit(self, res: Reservation, num_blocks: int | None = None) -> int:
        """Publish a reservation's blocks to the index. Returns blocks added (blocks
        someone else cached meanwhile keep their copy; ours are freed).

        `num_blocks` publishes only the first that many blocks (say, the ones a peer
        transfer verified) and frees the rest; None publishes all of them.
        """
        with self._lock:
            self._check_reservation(res)
            size = len(res.slots)
            n = size if num_blocks is None else num_blocks
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= size:
                raise ValueError(f"num_blocks must be in [0, {size}], got {num_blocks!r}")
            self._end_reservation(res)
            if res.cancelled or n == 0:
                self._pool.give_back(res.slots)
                return 0
            if n < size:
                self._pool.give_back(res.slots[n:])
            unused, _ = self._index.insert(res.root, res._token_bytes, res.first_block,
                                           res.slots[:n], res._hashes[:n], hot=res.tier == TIER_PINNED,
                                           main=False, after=res._parent)
            if unused:
                self._pool.give_back(unused)
            added = n - len(unused)
            self._tenant(res.root.tenant).stored_blocks += added
            self._total.stored_blocks += added
            return added

    def abort(self, res: Reservation) -> None:
        """Give a reservation's slots back without publishing anything."""
        with self._lock:
            self._check_reservation(res)
            self._end_reservation(res)
            self._pool.give_back(res.slots)

    def block_offset(self, slot: int) -> int:
        """Byte offset of `slot` in the arena."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} outside [0, {self.num_slots})")
        return slot * self.block_bytes

    @property
    def arena(self) -> np.ndarray | None:
        """The slots as a flat uint8 array (None when metadata_only)."""
        return self._arena

    # ------------------------------------------------------------------ queue

    def drain(self, budget_s: float | None = None) -> int:
        """Apply queued stores, most valuable first, for about `budget_s` seconds
        (at least one; None = until empty). Returns how many were applied."""
        deadline = None if budget_s is None else time.perf_counter() + budget_s
        applied = 0
        self._catch_up_tuner()
        while True:
            with self._lock:
                pending = self._queue.pop()
                res = self._prepare(pending) if pending is not None else None
            if pending is None:
                return applied
            if res is not None:
                if pending.kv is not None:
                    self._write(res, pending.kv)
                self.commit(res)
            applied += 1
            with self._lock:
                self._stores_applied += 1
            if deadline is not None and time.perf_counter() >= deadline:
                return applied

    def flush(self) -> int:
        """Apply every queued store now (tests, shutdown)."""
        return self.drain(None)

    # ------------------------------------------------------------------ control

    def _evicted(self, region: int, hashes: list[BlockHash]) -> None:
        self._removed.extend(hashes)
        self._removed_seq += len(hashes)
        self._tuner.on_evict(region, hashes)

    @property
    def removal_seq(self) -> int:
        """The removal log's position now: a block stored after it is removed at a later one."""
        return self._removed_seq

    def removed_since(self, seq: int, limit: int = 4096) -> tuple[int, list[BlockHash] | None]:
        """(the next position to ask from, up to `limit` blocks removed since position
        `seq`, oldest first), or (the position now, None) when the log cannot name them
        all (it wrapped, an invalidation dropped whole trees since, or `seq` is from
        another cache): then a reader must treat every block it knew of as removed."""
        with self._lock:
            now, log = self._removed_seq, self._removed
            if not self._removal_reset <= seq <= now or now - seq > len(log):
                return now, None
            # From the newest end: a reader that keeps up costs what it missed, not the log's length.
            newer = list(itertools.islice(reversed(log), now - seq))
            newer.reverse()
            out = newer[:limit]
            return seq + len(out), out

    def invalidate(self, predicate: Callable[[KeyRoot], bool]) -> int:
        """Drop every tree whose key root satisfies `predicate`; returns blocks dropped.

        Queued stores and open reservations for those roots are cancelled. Blocks a
        reader still holds stay intact until released, but nothing can hit them.
        """
        with self._lock:
            dropped, freed = self._index.drop_roots(predicate)
            if dropped:
                self._removed_seq += 1
                self._removal_reset = self._removed_seq
            self._pool.give_back(freed)
            self._queue.remove_if(lambda p: predicate(p.root))
            for res in self._reservations.values():
                if predicate(res.root):
                    res.cancelled = True
            self._invalidated_blocks += dropped
            return dropped

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` unpinned blocks now (memory pressure from outside,
        tests). Returns how many were freed; they are no longer hittable."""
        with self._lock:
            freed = self._index.evict(num_blocks)
            self._evictions += len(freed)
            self._pool.give_back(freed)
            return len(freed)

    def hottest_prefixes(self, tenant: str, max_bytes: int) -> list[tuple[KeyRoot, np.ndarray]]:
        """The tenant's most valuable cached prefixes, hottest first, within max_bytes.

        Each entry is (key root, token ids of a whole-block prefix). Blocks shared by
        several prefixes are counted once; a prefix covered by a longer chosen one is
        not listed. Feed them to a peer's `reserve(..., force=True)` to warm it.
        """
        with self._lock:
            now = self.clock()
            freq = self._index.policy.frequency
            chosen = self._choose_prefixes(tenant, lambda n: freq(n.freq, now), max_bytes // self.block_bytes)
            return [(n.root, self._prefix_token_ids(n)) for _, n in chosen]

    def hot_prompts(self, tenant: str, max_tokens: int) -> list[tuple[KeyRoot, np.ndarray, float]]:
        """The tenant's cached prefixes worth replaying to warm a new engine, best
        first: (key root, token ids of a whole-block prefix, its frequency), within
        `max_tokens` tokens newly covered (blocks shared with a chosen prefix count once:
        the engine finds them warm). A prefix inside a longer chosen one is not listed.

        Chosen greedily by expected saving per token of what each prefix adds: each
        block's decayed hit frequency, averaged over the blocks not yet covered by a
        chosen prefix (so a template is worth its hits, and a request's own question
        under a template already chosen only the few hits of that question). Ranking
        whole prefixes by their saving instead would spend the budget on one hot
        template's many leaves, one question each, and leave the tenant's other
        templates out. Listed by saving (frequency x tokens, summed along the prefix),
        best first; the frequency given is that saving over the prefix's length."""
        with self._lock:
            now = self.clock()
            freq = self._index.policy.frequency
            scored = []
            for n, saving in self._choose_by_density(tenant, lambda p: freq(p.freq, now),
                                                     max_tokens // self.block_size):
                scored.append((saving * self.block_size, n.root, self._prefix_token_ids(n)))
            # Listed by saving, best first (ties: the longer).
            scored.sort(key=lambda s: (-s[0], -len(s[2])))
            return [(root, tokens, value / len(tokens) if len(tokens) else 0.0) for value, root, tokens in scored]

    def _choose_by_density(self, tenant: str, block_value, budget_blocks: int) -> list[tuple[Node, float]]:
        """(node, its path's value: each block's value summed along it) of the tenant's
        prefixes chosen greedily by the value per block of the blocks each would newly
        cover (`block_value(node)` is each of a node's blocks' value, asked once per
        node), best first (ties: the longer), while those new blocks fit
        `budget_blocks`; a chosen prefix inside a longer chosen one is left out. Lazy
        greedy: a candidate's density is recomputed when it reaches the top, and it is
        taken only if it still beats the next one. Caller holds the lock."""
        covered: set[int] = set()
        value_of: dict[int, float] = {}

        def density(path: list[Node]) -> tuple[float, int]:
            blocks, value = 0, 0.0
            for p in path:
                if id(p) not in covered:
                    blocks += len(p.slots)
                    value += value_of[id(p)] * len(p.slots)
            return (value / blocks if blocks else 0.0), blocks

        nodes = list(self._index.iter_nodes(lambda r: r.tenant == tenant))
        value_of.update((id(n), block_value(n)) for n in nodes)
        heap: list[tuple[float, int, int, Node, list[Node]]] = []
        for i, n in enumerate(nodes):
            path = self._index.path(n)
            heap.append((-density(path)[0], -n.end_block, i, n, path))
        heapq.heapify(heap)
        chosen: list[tuple[Node, list[Node]]] = []
        while heap and budget_blocks > 0:
            _, end, i, n, path = heapq.heappop(heap)
            d, new = density(path)
            if new == 0 or new > budget_blocks:
                continue
            if heap and (-d, end, i) > heap[0][:3]:
                heapq.heappush(heap, (-d, end, i, n, path))  # no longer the best: back in line
                continue
            budget_blocks -= new
            covered.update(id(p) for p in path)
            chosen.append((n, path))
        inner = {id(p) for _, path in chosen for p in path[:-1]}
        return [(n, sum(value_of[id(p)] * len(p.slots) for p in path)) for n, path in chosen if id(n) not in inner]

    def _choose_prefixes(self, tenant: str, score, budget_blocks: int) -> list[tuple[float, Node]]:
        """(score, node) of the tenant's prefixes chosen greedily, best score first (ties:
        the longer), while the blocks not yet covered by a chosen one fit `budget_blocks`;
        a chosen prefix inside a longer chosen one is left out. Caller holds the lock."""
        scored = sorted(((score(n), n) for n in self._index.iter_nodes(lambda r: r.tenant == tenant)),
                        key=lambda s: (-s[0], -s[1].end_block))
        covered: set[int] = set()
        chosen: list[tuple[float, Node, list[Node]]] = []
        for value, n in scored:
            path = self._index.path(n)
            new = sum(len(p.slots) for p in path if id(p) not in covered)
            if new == 0 or new > budget_blocks:
                continue
            budget_blocks -= new
            covered.update(id(p) for p in path)
            chosen.append((value, n, path))
        inner = {id(p) for _, _, path in chosen for p in path[:-1]}
        return [(value, n) for value, n, _ in chosen if id(n) not in inner]

    def _prefix_token_ids(self, n: Node) -> np.ndarray:
        return np.frombuffer(self._index.prefix_tokens(n), dtype=TOKEN_DTYPE).copy()

    def stats(self, tenant: str | None = None) -> CacheStats:
        with self._lock:
            if tenant is None:  # kept as running totals: no walk over the tenants
                c = self._total
                blocks, evictions = self._index.num_blocks, self._evictions
            else:
                c = self._tenants.get(tenant, _TenantCounters())
                blocks = self._index.tenant_blocks.get(tenant, 0)
                evictions = self._index.tenant_evictions.get(tenant, 0)
            a = self._admission
            regions = self._index.region_blocks
            return CacheStats(
                tenant=tenant, lookups=c.lookups, hits=c.hits, misses=c.lookups - c.hits,
                hit_rate=c.hits / c.lookups if c.lookups else 0.0,
                prompt_tokens=c.prompt_tokens, matched_tokens=c.matched_tokens,
                token_hit_rate=c.matched_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
                stored_blocks=c.stored_blocks, blocks_used=blocks, bytes_used=blocks * self.block_bytes,
                capacity_bytes=self.capacity_bytes, evictions=evictions, tier_hits=dict(c.tier_hits),
                pinned_bytes=self._index.hot_blocks * self.block_bytes,
                admission_bar=a.bar, min_sightings=a.min_sightings, admission_admits=a.admits,
                admission_rejects=a.rejects, window_blocks=regions[WINDOW],
                window_target_blocks=int(min(self._index.window_target, self.num_slots)),
                main_blocks=regions[MAIN], thrashing=self._thrashing(), thrash_events=self._thrash_events,
                queue_depth=len(self._queue), queue_capacity=self._queue.capacity,
                queue_drops=self._queue.drops, stores_enqueued=self._stores_enqueued,
                stores_applied=self._stores_applied, invalidated_blocks=self._invalidated_blocks,
                reserved_blocks=self._reserved_blocks)

    # ------------------------------------------------------------------ internals

    def _make_arena(self, arena: Any) -> np.ndarray | None:
        size = self.num_slots * self.block_bytes
        if self.metadata_only:
            if arena is not None:
                raise ValueError("metadata_only caches take no arena")
            return None
        if arena is None:
            return np.zeros(size, dtype=np.uint8)
        view = _writable_bytes(arena, "arena")
        if view.nbytes < size:
            raise ValueError(f"arena holds {view.nbytes} bytes; {self.num_slots} slots need {size}")
        return view[:size]

    def _tenant(self, tenant: str) -> _TenantCounters:
        tenants = self._tenants
        c = tenants.get(tenant)
        if c is None:
            c = tenants[tenant] = _TenantCounters()
            if len(tenants) > MAX_TENANT_COUNTERS:
                tenants.popitem(last=False)  # its counts live on in the totals
        else:
            tenants.move_to_end(tenant)
        return c

    def _sight(self, root: KeyRoot, tb: bytes, m: Match, n_full: int) -> list[BlockHash]:
        """Count one sighting of every full block of the prompt (the cached ones'
        hashes are in the index, the rest are chained on from the match); returns
        all of them."""
        hashes = self._index.hashes_to(m)
        if m.cached_blocks < n_full:
            hashes += self._chain_from(m, root, tb)
        self._admission.sight(hashes)
        return hashes

    def _adapt(self, hashes: list[BlockHash], limit: int, matched: int, cached: int) -> None:
        """Tell the window tuner about this lookup (`WindowTuner.on_lookup`) and take
        the share it sets; a sample it ends behind LRU counts a thrash event."""
        tuner = self._tuner
        sampled = tuner.adjustments
        if tuner.on_lookup(hashes, limit, matched, cached):
            self._set_targets(tuner.window_target)
        if tuner.adjustments != sampled and tuner.behind_lru(self.thrash_ratio):
            self._thrash_events += 1

    def _match(self, root: KeyRoot, tb: bytes, n_full: int) -> Match:
        """`match` of the prompt, resumed where the last lookup's pin left it when
        this is the same prompt (a lookup, then its store or reservation)."""
        memo = self._match_memo
        if memo is not None and memo[1] == tb and (memo[0] is root or memo[0] == root):
            m = self._index.match_after(memo[2], tb, n_full)
            if m is not None:
                return m
        return self._index.match(root, tb, n_full)

    def _chain_from(self, m: Match, root: KeyRoot, tb: bytes) -> list[BlockHash]:
        """Hashes of the prompt's full blocks after the match. The last prompt's are
        kept: a lookup, its store and the store's reservation chain the same blocks."""
        first = m.cached_blocks
        memo = self._chain_memo
        if memo is not None and memo[2] <= first and (memo[0] is root or memo[0] == root) and memo[1] == tb:
            return memo[3][first - memo[2]:]
        hashes = chain_hashes(m.last_hash() or root.digest(), tb, self.block_size, first)
        self._chain_memo = (root, tb, first, hashes)
        return hashes

    def _catch_up_tuner(self) -> None:
        """Let the window tuner do what lookups left for later, off the lookup path."""
        with self._lock:
            self._tuner.catch_up()

    def _duel_tails(self, candidate: Node, victim: Node) -> bool:
        return self._admission.duel(candidate.hashes[-1])

    def _thrashing(self) -> bool:
        """Over the last sample, fewer matches than `thrash_ratio` x a same-size LRU's."""
        return self._tuner.behind_lru(self.thrash_ratio)

    def _set_targets(self, window_blocks: float) -> None:
        """The window's share, and the pinned tier's: a part of the main region, so it
        shrinks as the window grows (a full-size window leaves no main region, and
        the cache is then exactly LRU)."""
        self._index.window_target = window_blocks
        main_share = max(0.0, self.num_slots - window_blocks)
        self._index.hot_budget = int(main_share * self.pinned_fraction)

    @property
    def pinned_budget_blocks(self) -> int:
        """Blocks the pinned tier may hold now: a share of the main region, so none
        while the window is the whole cache (the shipped policy starts there, as
        LRU, and opens the main region as it takes frequency admission)."""
        return self._index.hot_budget

    def _maybe_promote(self, node: Node, matched_blocks: int) -> None:
        """Small and hot -> pinned tier, inferred from the node's decayed hit count."""
        if self._index.hot_blocks + len(node.slots) > self.pinned_budget_blocks:
            return  # not even the node's own blocks (not hot yet) fit in the pinned tier
        sightings = int(self._index.policy.frequency(node.freq, self.clock()))
        prefix_bytes = matched_blocks * self.block_bytes
        if placement(sightings, prefix_bytes, self._admission.bar, self.pin_max_bytes,
                     self.hot_sightings) is not Placement.PINNED:
            return
        new_hot = sum(len(p.slots) for p in self._index.path(node) if not p.hot)
        if self._index.hot_blocks + new_hot <= self.pinned_budget_blocks:
            self._index.mark_hot(node)

    def _prepare(self, p: _PendingStore) -> Reservation | None:
        """Turn a queued store into a reservation against the index as it is now."""
        tb = p.token_ids.tobytes()
        m = self._match(p.root, tb, p.end_block)
        if m.cached_blocks >= p.end_block:
            return None
        return self._reserve_from(m, p.root, p.token_ids, tb, p.end_block, p.sightings)

    def _reserve_from(self, m: Match, root: KeyRoot, tokens: np.ndarray, tb: bytes, end: int,
                      sightings: int | None, forced: bool = False) -> Reservation | None:
        """Pin the cached prefix, take slots for blocks [cached, end). `sightings`
        (for placement) defaults to the sketch's count of the first new block."""
        first = m.cached_blocks
        hashes = self._chain_from(m, root, tb)[:end - first]
        if sightings is None:
            sightings = self._admission.frequency(hashes[0])
        parent = self._index.pin(m, touch=False) if first > 0 else None
        slots = self._allocate(end - first, None if forced else sightings)
        if not slots:
            if parent is not None:
                self._pool.give_back(self._index.unpin(parent))
            return None
        hashes = hashes[:len(slots)]
        where = placement(sightings, end * self.block_bytes, self._admission.bar,
                          self.pin_max_bytes, self.hot_sightings)
        fits_hot = self._index.hot_blocks + end <= self.pinned_budget_blocks
        tier = TIER_PINNED if where is Placement.PINNED and fits_hot else TIER_DRAM
        bb = self.block_bytes
        res = Reservation(root, tokens, first, slots, [s * bb for s in slots], tier,
                          hashes, parent, self, _token_bytes=tb)
        self._reservations[id(res)] = res
        self._reserved_blocks += len(slots)
        return res

    def _allocate(self, n: int, sightings: int | None = None) -> list[int]:
        """Up to n slots: free ones first (free space is never refused), then evicted
        ones, W-TinyLFU deciding which (evicting only now, so released blocks stay
        hittable until their memory is needed). `sightings` are the new blocks'
        for their own duel when they overflow the window; None (a forced warm-up)
        takes what the policy gives."""
        slots = self._pool.take(n) if self._pool.free_count else []
        if len(slots) < n:
            incoming = None
            if sightings is not None and self.policy.duel:
                incoming = lambda victim: self._admission.duel_sightings(sightings)  # noqa: E731
            need = n - len(slots)
            freed = self._index.evict(need, self._duel, incoming)
            if freed:
                self._evictions += len(freed)
                slots.extend(freed[:need])  # straight to the new blocks, not through the free pool
                self._pool.give_back(freed[need:])
        slots.sort()
        return slots

    def _write(self, res: Reservation, kv: np.ndarray) -> None:
        bb = self.block_bytes
        src = kv[res.first_block * bb:(res.first_block + len(res.slots)) * bb]
        assert self._arena is not None
        for i, s, k in slot_runs(res.slots):
            self._arena[s * bb:(s + k) * bb] = src[i * bb:(i + k) * bb]

    def _end_reservation(self, res: Reservation) -> None:
        res.done = True
        self._reservations.pop(id(res), None)
        self._reserved_blocks -= len(res.slots)
        if res._parent is not None:
            freed = self._index.unpin(res._parent)
            if freed:
                self._pool.give_back(freed)

    def _check_hit(self, hit: Any) -> None:
        if not isinstance(hit, Hit) or hit._owner is not self:
            raise ValueError("not a Hit from this cache")
        if hit.released:
            raise ValueError("hit already released: its blocks may have been reused")

    def _check_reservation(self, res: Any) -> None:
        if not isinstance(res, Reservation) or res._owner is not self:
            raise ValueError("not a Reservation from this cache")
        if res.done:
            raise ValueError("reservation already committed or aborted")

    def _check_payload(self, kv_blocks: Any, n_full: int) -> np.ndarray | None:
        if kv_blocks is None:
            if self.metadata_only:
                return None
            raise ValueError("kv_blocks is required unless the cache is metadata_only")
        if self.metadata_only:
            return None
        if isinstance(kv_blocks, np.ndarray):
            if not kv_blocks.flags.c_contiguous:
                raise ValueError("kv_blocks must be C-contiguous")
            flat = kv_blocks.reshape(-1).view(np.uint8)
        else:
            try:
                flat = np.frombuffer(kv_blocks, dtype=np.uint8)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"kv_blocks must be a bytes-like object or ndarray: {exc}") from None
        want = n_full * self.block_bytes
        if flat.nbytes != want:
            raise ValueError(f"kv_blocks has {flat.nbytes} bytes; {n_full} full blocks of "
                             f"{self.block_bytes} bytes need {want}")
        return flat


def _writable_bytes(buf: Any, name: str) -> np.ndarray:
    """A flat writable uint8 view of `buf`, or ValueError."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous or not buf.flags.writeable:
            raise ValueError(f"{name} must be a writable C-contiguous array")
        return buf.reshape(-1).view(np.uint8)
    try:
        view = np.frombuffer(buf, dtype=np.uint8)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a writable buffer: {exc}") from None
    if not view.flags.writeable:
        raise ValueError(f"{name} must be writable")
    return view
