"""Eviction policy: W-TinyLFU over the prefix tree's leaves (pure bookkeeping).

Caffeine's W-TinyLFU, adapted to a tree whose leaves alone may be evicted:

* Every stored block enters the WINDOW, a region in LRU order. Free space is never
  refused: while slots are free nothing is evicted and nothing is compared.
* The rest is the MAIN region, ordered by decayed hit frequency (below).
* When the cache is full and the window is over its share, the window's least
  recent leaf is the CANDIDATE and main's lowest-scored leaf the VICTIM. The
  candidate moves into main only if the frequency sketch has seen it at least
  `min_sightings` times and at least as often as the victim is still being hit
  (`admits`); otherwise the candidate is evicted. So a stream of one-shot prompts
  churns through the window and never displaces what is reused.
* The window's share is tuned online against a shadow LRU of the same size
  (`LruReferenceTuner`). The cache starts as plain LRU (a whole-cache window: what
  the engine already has) and takes frequency admission only as far as it keeps up
  with that shadow: each sample ahead of LRU shrinks the window one step, and so
  does the first level one, to start exploring (stricter admission: hot prompts
  under a scan, shared prefixes in a small cache); each sample behind grows it two
  steps (recency-heavy traffic: conversations, whose blocks' first reuse is the
  next turn). Caffeine's hill
  climbing on the hit rate (`HillClimber`) and ARC's ghost lists (`GhostTuner`) are
  kept as ablations: measured on the shipped conversation trace, per-sample hit
  rates were too noisy to climb by (docs/TRACE_REPLAY.md).

Main's order is not Caffeine's segmented LRU: each node keeps a decayed hit count

    f(now) = f(t) * 2 ** (-(now - t) / half_life_s)

(a touch adds one), so a prefix hit once long ago scores below one hit often and
recently, and a finished conversation ages out by decay without anyone declaring it
dead. Measured on conversation traffic, a segmented LRU keeps finished conversations
(hit several times, so protected) over live ones and loses to plain LRU; decay does
not. Two nodes compare the same way at every instant, because log2 f(now) =
log2 f(t) + t / half_life_s - now / half_life_s and the last term is common to both,
so the sortable key `score = log2 f(t) + t / half_life_s` never changes between
touches, which lets the index keep main's evictable leaves in a heap. Hot
(pinned-tier) nodes sort after every ordinary node.

Leaf-first eviction (SGLang/vLLM's radix caches): only unpinned leaves are taken,
tails before heads, so a block is never kept while its parent is evicted.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable

WINDOW, MAIN = 0, 1
"""The two regions a cached node can be in."""

DEFAULT_HALF_LIFE_S = 300.0
"""A prefix's frequency halves every five minutes unseen: long enough to keep a system
prompt across a quiet spell, short enough that a finished conversation ages out."""

WINDOW_INITIAL_FRACTION = 1.0
"""The shipped policy starts as plain LRU (a whole-cache window); the tuner moves it."""

CAFFEINE_WINDOW_FRACTION = 0.01
"""Caffeine's starting window, 1% of the capacity: where the hill-climbing ablation
starts, and the fixed window of the fixed-window ablation."""

WINDOW_MAX_FRACTION = 1.0
"""The tuner may grow the window to the whole cache (plain LRU)."""

CLIMB_STEP_FRACTION = 0.0625
"""First hill-climbing step: 6.25% of the capacity (Caffeine's)."""

REFERENCE_STEP_FRACTION = 0.125
"""Each sample ahead of the shadow LRU shrinks the window by 12.5% of the capacity:
eight samples span the whole range."""

REFERENCE_RETREAT_STEPS = 2
"""Each sample behind the shadow LRU grows the window by two steps: a sample behind
LRU costs the user hit rate, a sample level gains nothing, so the tuner retreats
toward LRU faster than it advances away from it (measured in docs/TRACE_REPLAY.md:
with equal steps it oscillated across the point where it equals LRU and lost to
LRU at mid-size caches)."""

CLIMB_STEP_DECAY = 0.98
"""Each step is 2% smaller than the last, so the window settles."""

CLIMB_RESTART_THRESHOLD = 0.05
"""A hit-rate change this large (absolute) means the workload changed: restart the
climb with a full step."""

CLIMB_SAMPLE_FACTOR = 1.0
"""One sample = lookups covering this many times the capacity in blocks: enough
traffic to have cycled the cache once, so a window change has shown its effect."""


ADAPTATIONS = ("shadow", "symmetric", "climb", "off", "ghost")
"""How the window's share moves: against a shadow LRU (the default; "symmetric" is
its earlier form, one step either way and holding when level), by Caffeine's hill
climbing on the hit rate, not at all, or by ARC's ghost lists."""


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """The W-TinyLFU knobs. Defaults are the shipped policy; the others exist to
    measure what each part buys (ablation), not for tuning per deployment."""

    window_fraction: float = WINDOW_INITIAL_FRACTION
    adapt: str = "shadow"
    doorkeeper: bool = True
    duel: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.window_fraction <= 1.0:
            raise ValueError(f"window_fraction must be in [0, 1], got {self.window_fraction}")
        if self.adapt not in ADAPTATIONS:
            raise ValueError(f"adapt must be one of {', '.join(ADAPTATIONS)}, got {self.adapt!r}")


def admits(candidate_sightings: int, victim_frequency: float, min_sightings: int) -> bool:
    """TinyLFU's duel: does the window's candidate displace main's victim?"""
    return candidate_sightings >= min_sightings and candidate_sightings >= victim_frequency


@dataclass(slots=True)
class FrequencyState:
    """Decayed hit count of one node, as of time `t_s`."""

    freq: float = 0.0
    t_s: float = 0.0


class DecayedFrequencyPolicy:
    """Main's order: `touch` on access, `score` to order victims (low first)."""

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

    def score(self, state: FrequencyState) -> float:
        """Time-invariant sortable key: lower is evicted first."""
        if state.freq <= 0.0:
            return -math.inf
        return math.log2(state.freq) + state.t_s / self.half_life_s


class HillClimber:
    """Tunes the window's share of the capacity from the observed hit rate.

    Each sample (lookups covering `sample_blocks` blocks) yields a hit rate; if it
    improved on the previous sample the window keeps moving the same way, otherwise
    it turns around. Steps decay geometrically and restart on a large change.
    """

    __slots__ = ("capacity", "sample_blocks", "step", "_looked", "_hit", "_previous", "_direction",
                 "window_target", "adjustments")

    def __init__(self, capacity_blocks: int, window_fraction: float = WINDOW_INITIAL_FRACTION,
                 sample_factor: float | None = None) -> None:
        self.capacity = capacity_blocks
        factor = CLIMB_SAMPLE_FACTOR if sample_factor is None else sample_factor
        self.sample_blocks = max(1, int(capacity_blocks * factor))
        self.step = capacity_blocks * CLIMB_STEP_FRACTION
        self.window_target = capacity_blocks * window_fraction
        self._looked = 0
        self._hit = 0
        self._previous: float | None = None
        self._direction = 1.0
        self.adjustments = 0

    def record(self, looked_blocks: int, hit_blocks: int) -> bool:
        """Account one lookup; returns True when the window target just moved."""
        self._looked += looked_blocks
        self._hit += hit_blocks
        if self._looked < self.sample_blocks:
            return False
        rate = self._hit / self._looked
        self._looked = self._hit = 0
        previous, self._previous = self._previous, rate
        if previous is None:
            return self._move()
        if rate < previous:
            self._direction = -self._direction
        if abs(rate - previous) >= CLIMB_RESTART_THRESHOLD:
            self.step = self.capacity * CLIMB_STEP_FRACTION
        else:
            self.step *= CLIMB_STEP_DECAY
        return self._move()

    def _move(self) -> bool:
        before = self.window_target
        target = before + self._direction * self.step
        self.window_target = min(self.capacity * WINDOW_MAX_FRACTION, max(0.0, target))
        self.adjustments += 1
        return self.window_target != before


class ShadowLru:
    """A ghost LRU of the same capacity: block hashes only, no KV.

    It answers one question per lookup: how many blocks would plain LRU (what every
    engine ships) have matched here? `LruReferenceTuner` moves the window with it.
    Costs one dict operation per prompt block and ~100 bytes per slot.
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
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        over = len(blocks) - self.capacity
        if over > 0:
            self.evictions += over
            for _ in range(over):
                blocks.popitem(last=False)
        return min(hit, limit)


class LruReferenceTuner:
    """Moves the window's share so the cache never does worse than LRU would.

    Every sample (lookups covering `capacity` blocks) compares the blocks this cache
    matched with what a same-size `ShadowLru` matched. Behind LRU: the window grows
    by `REFERENCE_RETREAT_STEPS` steps (toward LRU, which a full-size window is).
    Ahead of LRU: it shrinks by a step (toward stricter frequency admission, which is
    where the cache gains over LRU). Level: it holds (a tie says nothing), except at
    a whole-cache window, where the cache is LRU and can only ever be level, so a
    step down is the only way to start exploring. A sample in which the shadow LRU
    evicted nothing holds the window: while the cache has room, the window's share
    decides nothing, and exploring then only costs hit rate later. The sign of a
    whole sample's difference is a steadier signal than the change of the hit rate
    between two samples (Caffeine's climb), because LRU's hit rate over the same
    lookups cancels the workload's own swings.
    """

    __slots__ = ("capacity", "window_target", "step", "shadow", "_looked", "_ours", "_lru", "adjustments",
                 "last_ours", "last_lru", "symmetric", "_evictions")

    def __init__(self, capacity_blocks: int, window_fraction: float = WINDOW_INITIAL_FRACTION,
                 symmetric: bool = False) -> None:
        self.symmetric = symmetric  # the ablation: one step either way, holding when level
        self.capacity = capacity_blocks
        self.window_target = capacity_blocks * window_fraction
        self.step = capacity_blocks * REFERENCE_STEP_FRACTION
        self.shadow = ShadowLru(capacity_blocks)
        self._looked = self._ours = self._lru = 0
        self._evictions = 0  # the shadow's, when the sample began
        self.adjustments = 0
        self.last_ours = self.last_lru = 0  # blocks matched over the last whole sample

    def record(self, hashes: list, limit: int, matched: int) -> bool:
        """Account one lookup (all its full blocks' hashes, the last-token limit and
        the blocks this cache matched). Returns True when the window target moved."""
        self._lru += self.shadow.access(hashes, limit)
        self._ours += matched
        self._looked += len(hashes)
        if self._looked < self.capacity * CLIMB_SAMPLE_FACTOR:
            return False
        behind, level = self._ours < self._lru, self._ours == self._lru
        full = self.shadow.evictions > self._evictions
        self.last_ours, self.last_lru = self._ours, self._lru
        self._looked = self._ours = self._lru = 0
        self._evictions = self.shadow.evictions
        before = self.window_target
        if not full:
            target = before  # not even LRU evicted: no sample says anything about the window
        elif self.symmetric:
            target = before + (self.step if behind else 0.0 if level else -self.step)
        else:
            target = before + (REFERENCE_RETREAT_STEPS * self.step if behind
                               else 0.0 if level and before < self.capacity else -self.step)
        self.window_target = min(float(self.capacity), max(0.0, target))
        self.adjustments += 1
        return self.window_target != before


class GhostTuner:
    """ARC's adaptation (Megiddo & Modha, FAST'03), applied to the window's share.

    Two ghost lists hold the hashes of blocks recently evicted from the window and
    from main (hashes only, no KV). A ghost block counts only if its region could
    have grown enough to keep it: the window's ghost holds at most what the window
    could gain (capacity - window), main's at most what main could gain (the
    window's share). A prompt whose uncached blocks are found in a ghost list would
    have hit had that region been larger: each block found in the window's ghost
    grows the window by max(1, |main ghost| / |window ghost|) blocks, each found in
    main's ghost shrinks it by max(1, |window ghost| / |main ghost|). Every such
    event moves the share, so there is no sample to be noisy over. An ablation
    (`adapt="ghost"`), measured against the shipped shadow-LRU steering in
    docs/TRACE_REPLAY.md.
    """

    __slots__ = ("capacity", "window_target", "ghosts", "adjustments")

    def __init__(self, capacity_blocks: int, window_fraction: float = WINDOW_INITIAL_FRACTION) -> None:
        self.capacity = capacity_blocks
        self.window_target = capacity_blocks * window_fraction
        self.ghosts: tuple[OrderedDict, OrderedDict] = (OrderedDict(), OrderedDict())  # [WINDOW], [MAIN]
        self.adjustments = 0

    def evicted(self, region: int, hashes: list) -> None:
        """Eviction took these blocks from `region` (the index's `on_evict` hook)."""
        ghost = self.ghosts[region]
        for h in hashes:
            ghost[h] = None
        self._trim()

    def missed(self, hashes: list) -> bool:
        """A lookup missed these blocks (the prompt's blocks after its cached prefix,
        in order). Returns True when the window's share moved."""
        gw, gm = self.ghosts
        grow = shrink = 0
        for h in hashes:
            if h in gw:
                del gw[h]
                grow += 1
            elif h in gm:
                del gm[h]
                shrink += 1
            else:
                break
        if not grow and not shrink:
            return False
        delta = grow * max(1.0, len(gm) / max(1, len(gw))) - shrink * max(1.0, len(gw) / max(1, len(gm)))
        before = self.window_target
        self.window_target = min(float(self.capacity), max(0.0, before + delta))
        self.adjustments += 1
        self._trim()
        return self.window_target != before

    def _trim(self) -> None:
        gw, gm = self.ghosts
        for _ in range(len(gw) - int(self.capacity - self.window_target)):
            gw.popitem(last=False)
        for _ in range(len(gm) - int(self.window_target)):
            gm.popitem(last=False)
