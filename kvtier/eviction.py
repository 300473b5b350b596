"""Eviction policy: W-TinyLFU over the prefix tree's leaves (pure bookkeeping).

Caffeine's W-TinyLFU, adapted to a tree whose leaves alone may be evicted:

* Every stored block enters the WINDOW, a region in LRU order. Free space is never
  refused: while slots are free nothing is evicted and nothing is compared.
* The rest is the MAIN region, also in LRU order.
* When the cache is full and the window is over its share, the window's least
  recent leaf is the CANDIDATE and main's least recent leaf the VICTIM. The
  candidate moves into main only if the frequency sketch has seen it at least
  `min_sightings` times (`admits`); otherwise the candidate is evicted. So a stream
  of one-shot prompts churns through the window and never displaces what is reused,
  and a block that came back once (a document asked about again, a conversation's
  next turn) is kept like LRU would keep it.
* The window's share is chosen by a `WindowTuner`, one per cache, picked once by the
  policy's `adapt` (`make_tuner`). The shipped one (`MiniatureTuner`) runs MINIATURE
  SIMULATIONS: the same structure at a few window shares (1%, a quarter, a half,
  three quarters and the whole cache, which is plain LRU), each on a spatial sample
  of the blocks (a block is in the sample by its hash, so every sighting of a
  sampled block is seen: SHARDS, Waldspurger et al., FAST'15 and ATC'17) in a cache
  scaled down by the same factor. Every sample the cache takes the share whose
  miniature has hit the most lately; ties go to the larger window (toward LRU). The
  cache starts as LRU: before the miniatures fill, they tie. All the shares are
  compared on the same requests, so the choice does not drift with the traffic's own
  swings. `adapt="off"` holds the window where it starts. The simulator's ablation
  tuners live in `kvtier.sim.tuners` and register themselves here.

Main's order is recency. A block's decayed hit count

    f(now) = f(t) * 2 ** (-(now - t) / half_life_s)

(a touch adds one) decides placement (the pinned tier) and which prefixes warm a
new replica, not main's order (why: docs/TRACE_REPLAY.md). Hot (pinned-tier) nodes
sort after every ordinary node.

Leaf-first eviction (SGLang/vLLM's radix caches): only unpinned leaves are taken,
tails before heads, so a block is never kept while its parent is evicted.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable

WINDOW, MAIN = 0, 1
"""The two regions a cached node can be in."""

DEFAULT_HALF_LIFE_S = 300.0
"""A prefix's frequency halves every five minutes unseen: long enough to keep a system
prompt across a quiet spell, short enough that a finished conversation ages out."""

WINDOW_INITIAL_FRACTION = 1.0
"""The shipped policy starts as plain LRU (a whole-cache window); the tuner moves it."""

SAMPLE_FACTOR = 1.0
"""One sample = lookups covering this many times the capacity in blocks: enough
traffic to have cycled the cache once, so a window change has shown its effect."""

MINI_WINDOWS = (0.01, 0.25, 0.5, 0.75, 1.0)
"""Window shares the miniature simulations compare: Caffeine's 1%, the quarters, and
the whole cache (plain LRU, so the cache can always fall back to what engines ship)."""

MINI_SAMPLE_BITS = 2
"""A block is in the miniatures' sample when the low 2 bits of its hash's first byte
are zero: one block in four, and each miniature has a quarter of the slots (one in
eight chose worse windows: docs/TRACE_REPLAY.md)."""

MINI_SMOOTHING = 0.1
"""Weight of the latest sample's hits in a miniature's score (an exponential moving
average over about ten samples): one sample's few sampled hits are too noisy to
switch on."""

MINI_TIE_MARGIN = 0.25
"""A smaller window is taken only when its miniature leads the LRU one (the whole-cache
window) by more than this many standard errors of the LRU one's score (its sampled
hits as a Poisson count, through the moving average): a lead within the sampling
noise is a tie, and ties go to LRU (the margin's measurements: docs/TRACE_REPLAY.md)."""

MINI_PENDING_BLOCKS = 4096
"""Prompt blocks lookups may leave for later (`catch_up`, off the lookup path) before
a lookup replays them itself: bounds the backlog if nobody releases."""

MINI_MIN_SLOTS = 8
"""Smallest miniature cache: below it a 1% window would hold no block at all."""

MINI_RESET_FACTOR = 10
"""The miniatures' sighting counts halve every this many times their capacity in
sightings (TinyLFU's reset), so old popularity fades."""

SHADOW_SAMPLED_SLOTS = 4096
"""From this many slots on, the thrash gauge's shadow LRU runs on the miniatures'
sample (one block in four, a quarter of the slots: at least 1,024) and the gauge
compares sampled blocks on both sides: the same spatial sampling, at a quarter of
the cost of a full shadow. Smaller caches keep an exact shadow, where a sample would
hold few blocks."""


@dataclass(frozen=True, slots=True)
class EvictionConfig:
    """The W-TinyLFU knobs. Defaults are the shipped policy; the others exist to
    measure what each part buys (ablation), not for tuning per deployment. `adapt`
    names a registered `WindowTuner` (`register_tuner`)."""

    window_fraction: float = WINDOW_INITIAL_FRACTION
    adapt: str = "mini"
    doorkeeper: bool = True
    duel: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.window_fraction <= 1.0:
            raise ValueError(f"window_fraction must be in [0, 1], got {self.window_fraction}")
        if self.adapt not in _TUNERS:
            raise ValueError(f"adapt must be one of {', '.join(_TUNERS)}, got {self.adapt!r} (the simulator's "
                             f"ablations are registered by importing kvtier.sim)")


def admits(candidate_sightings: int, min_sightings: int) -> bool:
    """The duel: does the window's candidate move into main (and main's least recent
    leaf pay)? Only a block the sketch has seen `min_sightings` times. Unlike
    Caffeine, the candidate need not be seen as often as the victim: with main in
    LRU order that test keeps old, once-popular prefixes over blocks coming back now
    (docs/TRACE_REPLAY.md)."""
    return candidate_sightings >= min_sightings


@dataclass(slots=True)
class FrequencyState:
    """Decayed hit count of one node, as of time `t_s`."""

    freq: float = 0.0
    t_s: float = 0.0


class DecayedFrequencyPolicy:
    """Each node's decayed hit count: `touch` on access, `frequency` to read it."""

    __slots__ = ("half_life_s",)

    def __init__(self, half_life_s: float = DEFAULT_HALF_LIFE_S) -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self.half_life_s = float(half_life_s)

    def touch(self, state: FrequencyState, now_s: float, weight: float = 1.0) -> None:
        """Record one access at `now_s` (decaying what was there first)."""
        state.freq = self.frequency(state, now_s) + weight
        state.t_s = now_s

    def frequency(self, state: FrequencyState, now_s: float) -> float:
        """The decayed count at `now_s`."""
        if state.freq == 0.0:
            return 0.0
        return state.freq * math.exp2(-(now_s - state.t_s) / self.half_life_s)


class WindowTuner:
    """Chooses the window's share of the cache: the one interface `LocalCache` drives.

    A cache holds exactly one, made once by `make_tuner` from its policy's `adapt`.
    The cache calls `on_lookup` on every lookup (under its lock), `on_evict` for every
    block eviction takes, `catch_up` off the lookup path (on release and drain) and
    `behind_lru` for the thrash gauge; it applies `window_target` whenever
    `on_lookup` says it moved. This base holds the window where it starts
    (`adapt="off"`); `adjustments` counts the samples a tuner has judged.
    """

    __slots__ = ("capacity", "window_target", "adjustments")

    def __init__(self, capacity_blocks: int, window_fraction: float = WINDOW_INITIAL_FRACTION) -> None:
        self.capacity = capacity_blocks
        self.window_target = capacity_blocks * window_fraction
        self.adjustments = 0

    def on_lookup(self, hashes: list, limit: int, matched: int, cached: int) -> bool:
        """One lookup: all its full blocks' hashes, of which the first `cached` are
        cached and `matched` were handed out (at most `limit`, the last-token rule).
        Returns True when `window_target` moved."""
        return False

    def on_evict(self, region: int, hashes: list) -> None:
        """Eviction took these blocks (tails last) from `region` (WINDOW or MAIN)."""

    def catch_up(self) -> None:
        """Do the bookkeeping `on_lookup` left for later (the caller holds the cache's lock)."""

    def behind_lru(self, ratio: float) -> bool:
        """Over the last whole sample, did the cache match fewer blocks than `ratio` x
        what a same-size LRU would have? (The thrash gauge; never, for a tuner that
        keeps no LRU to compare with.)"""
        return False


class ShadowLru:
    """A ghost LRU: block hashes only, no KV.

    It answers one question per lookup: how many blocks would plain LRU (what every
    engine ships) have matched here? The thrash gauge compares the cache with it (a
    same-size one, or a quarter-size one on a 1-in-4 sample of the blocks: see
    `MiniatureTuner`); the simulator's LRU-steering ablation steers the window by a
    same-size one. Costs one dict operation per block it is given and ~100 bytes per
    slot.
    """

    __slots__ = ("capacity", "_blocks", "evictions")

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[Hashable, None] = OrderedDict()
        self.evictions = 0

    def access(self, hashes: list, limit: int) -> int:
        """Serve one prompt's full blocks (in order); returns the blocks LRU would have
        matched (at most `limit`, the last-token rule), then stores them all, the
        head most recent so a prefix loses its tail first."""
        blocks = self._blocks
        hit = 0
        for h in hashes:
            if h not in blocks:
                break
            hit += 1
        # A block is always more recent than its descendants (each prompt touches its
        # blocks tail first), so it outlives them: the blocks held on a prompt's path
        # are a prefix of it, and everything past the first miss is missing too.
        for h in reversed(hashes[hit:]):  # tail first (list slices: no per-index work)
            blocks[h] = None
        to_end = blocks.move_to_end  # bound once, outside the loop
        for h in reversed(hashes[:hit]):
            to_end(h)
        over = len(blocks) - self.capacity
        if over > 0:
            self.evictions += over
            pop = blocks.popitem
            for _ in range(over):
                pop(False)  # the oldest
        return min(hit, limit)


class MiniatureCache:
    """The cache's structure at one window share, on sampled blocks only: a window and
    a main region, both LRU, and the duel between them (block hashes only, no tree:
    a prompt's sampled blocks count as hits only up to its first sampled miss, which
    is what the prefix rule leaves of them)."""

    __slots__ = ("capacity", "window_cap", "main_cap", "window", "main", "hits")

    def __init__(self, capacity_blocks: int, window_fraction: float) -> None:
        self.capacity = capacity_blocks
        self.window_cap = max(1, round(capacity_blocks * window_fraction))
        self.main_cap = capacity_blocks - self.window_cap
        self.window: OrderedDict[Hashable, None] = OrderedDict()
        self.main: OrderedDict[Hashable, None] = OrderedDict()
        self.hits = 0

    def serve(self, blocks: list, counts: dict, min_sightings: int) -> None:
        """One prompt's sampled blocks, in prompt order. The window never holds more
        than its share and main never more than the rest, so a store needs no other
        eviction than the window candidate's."""
        window, main = self.window, self.main
        window_cap, main_cap = self.window_cap, self.main_cap
        window_to_end, main_to_end = window.move_to_end, main.move_to_end  # bound once per prompt
        chained, hits = True, 0
        for h in blocks:
            if h in window:
                window_to_end(h)
            elif h in main:
                main_to_end(h)
            else:
                chained = False
                window[h] = None
                if len(window) > window_cap:
                    candidate = window.popitem(False)[0]  # the window's oldest
                    if len(main) < main_cap:
                        main[candidate] = None  # free space in main: never refused
                    elif main:
                        # TinyLFU's duel on exact sampled counts: measured, this stricter
                        # form predicts the cache's own (seen-twice) duel better than it.
                        seen = counts.get(candidate, 0)
                        if seen >= min_sightings and seen >= counts.get(next(iter(main)), 0):
                            main.popitem(False)
                            main[candidate] = None
                continue
            if chained:
                hits += 1
        self.hits += hits


class MiniatureTuner(WindowTuner):
    """Chooses the window's share by miniature simulations (see the module docstring).

    Every sample (lookups covering `capacity` blocks) each miniature's hits feed an
    exponential moving average, and the window takes the share of the best one (ties
    to the larger window). A `ShadowLru` runs alongside for the thrash detector
    (`last_ours` vs `last_lru`, the last whole sample's matched blocks); it does not
    steer. From `SHADOW_SAMPLED_SLOTS` slots on it sees only the miniatures' sample,
    in a quarter of the slots, and both sides of the gauge count sampled blocks
    only; below that it sees every block. Costs a dict operation per sampled block
    per miniature, and ~100 bytes per shadow slot.

    A lookup only queues its blocks; the miniatures and the shadow sample and replay
    them in order in `catch_up` (the cache calls it when a hit is released and when
    stores drain, off the engine's critical path: Caffeine's read buffer), and at the
    end of a sample before choosing. The order is the lookups' order, so the choices
    are what replaying at each lookup would give.
    """

    __slots__ = ("windows", "minis", "min_sightings", "scores", "counts", "shadow", "last_ours", "last_lru",
                 "_mask", "_shadow_sampled", "_sightings", "_reset_at", "_pending", "_pending_blocks", "_looked",
                 "_ours", "_lru")

    def __init__(self, capacity_blocks: int, min_sightings: int, windows: tuple[float, ...] = MINI_WINDOWS,
                 window_fraction: float = WINDOW_INITIAL_FRACTION) -> None:
        WindowTuner.__init__(self, capacity_blocks, window_fraction)
        mini_slots = max(MINI_MIN_SLOTS, capacity_blocks >> MINI_SAMPLE_BITS)
        self.windows = sorted(windows)  # ascending: a tie goes to the later, larger window
        if self.windows[-1] != 1.0:
            raise ValueError(f"the miniatures must include the whole-cache window (LRU), got {windows}")
        self.minis = [MiniatureCache(mini_slots, w) for w in self.windows]
        self._mask = (1 << MINI_SAMPLE_BITS) - 1
        self.min_sightings = min_sightings
        self.scores = [0.0] * len(windows)
        self.counts: dict = {}
        self._shadow_sampled = capacity_blocks >= SHADOW_SAMPLED_SLOTS
        self.shadow = ShadowLru(capacity_blocks >> MINI_SAMPLE_BITS if self._shadow_sampled else capacity_blocks)
        self.last_ours = self.last_lru = 0
        self._sightings = 0
        self._reset_at = MINI_RESET_FACTOR * mini_slots
        self._pending: list[tuple[list, int, int]] = []
        self._pending_blocks = 0
        self._looked = self._ours = self._lru = 0

    def on_lookup(self, hashes: list, limit: int, matched: int, cached: int) -> bool:
        self._pending.append((hashes, limit, matched))  # sampled later, in `catch_up`
        self._pending_blocks += len(hashes)
        self._looked += len(hashes)
        if self._looked < self.capacity * SAMPLE_FACTOR:
            if self._pending_blocks > MINI_PENDING_BLOCKS:
                self.catch_up()
            return False
        self.catch_up()
        self.last_ours, self.last_lru = self._ours, self._lru
        self._looked = self._ours = self._lru = 0
        scores = self.scores
        for i, mini in enumerate(self.minis):
            scores[i] = MINI_SMOOTHING * mini.hits + (1.0 - MINI_SMOOTHING) * scores[i]
            mini.hits = 0
        lru = len(scores) - 1  # the whole-cache window, last in ascending order
        margin = MINI_TIE_MARGIN * math.sqrt(MINI_SMOOTHING / (2.0 - MINI_SMOOTHING) * scores[lru])
        best = max(range(len(scores)), key=lambda i: (scores[i] - (0.0 if i == lru else margin), i))
        before = self.window_target
        self.window_target = self.capacity * self.windows[best]
        self.adjustments += 1
        return self.window_target != before

    def behind_lru(self, ratio: float) -> bool:
        return self.last_ours < ratio * self.last_lru

    def catch_up(self) -> None:
        """Replay the queued lookups' sampled blocks through the miniatures (and the
        shadow), in order."""
        if not self._pending:
            return
        counts, minis, min_sightings, mask = self.counts, self.minis, self.min_sightings, self._mask
        shadow, shadow_sampled = self.shadow, self._shadow_sampled
        for hashes, limit, matched in self._pending:
            if shadow_sampled:  # both sides count the sampled blocks within their matches
                picked = [i for i, h in enumerate(hashes) if not h[0] & mask]
                sampled = [hashes[i] for i in picked]
                self._lru += shadow.access(sampled, bisect_left(picked, limit))
                self._ours += bisect_left(picked, matched)
            else:  # the positions are not needed: one pass
                sampled = [h for h in hashes if not h[0] & mask]
                self._lru += shadow.access(hashes, limit)
                self._ours += matched
            if not sampled:
                continue
            for h in sampled:
                counts[h] = counts.get(h, 0) + 1
            for mini in minis:
                mini.serve(sampled, counts, min_sightings)
            self._sightings += len(sampled)
            if self._sightings >= self._reset_at:
                self._halve()
                counts = self.counts
        self._pending = []
        self._pending_blocks = 0

    def _halve(self) -> None:
        self._sightings = 0
        self.counts = {h: c >> 1 for h, c in self.counts.items() if c > 1}


TunerFactory = Callable[[int, float, int], WindowTuner]
"""(capacity in blocks, starting window fraction, min_sightings) -> a fresh tuner."""

_TUNERS: dict[str, TunerFactory] = {}


def register_tuner(adapt: str, factory: TunerFactory) -> None:
    """Make `EvictionConfig(adapt=adapt)` build its caches' tuners with `factory` (the
    core registers what it ships; the simulator its ablations)."""
    _TUNERS[adapt] = factory


def adaptations() -> tuple[str, ...]:
    """The `adapt` values registered so far."""
    return tuple(_TUNERS)


def make_tuner(policy: EvictionConfig, capacity_blocks: int, min_sightings: int) -> WindowTuner:
    """The window tuner `policy` names, for a cache of `capacity_blocks` blocks."""
    return _TUNERS[policy.adapt](capacity_blocks, policy.window_fraction, min_sightings)


register_tuner("mini", lambda capacity, window, min_sightings: MiniatureTuner(capacity, min_sightings,
                                                                              window_fraction=window))
register_tuner("off", lambda capacity, window, min_sightings: WindowTuner(capacity, window))
