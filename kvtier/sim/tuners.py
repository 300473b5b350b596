"""The window tuners only the simulator selects: ablations of the shipped one.

Each is a `kvtier.eviction.WindowTuner` and registers its `adapt` name with the core
when this module is imported (`kvtier.sim` imports it), so `EvictionConfig(adapt=...)`
and `LocalCache` take them like the core's own ("mini", the shipped miniature
simulations, and "off", a fixed window). What each measured against the shipped
tuner: docs/TRACE_REPLAY.md.

- "shadow": steering against a same-size shadow LRU (`LruReferenceTuner`);
  "symmetric": the same steering, one step either way and holding when level.
- "climb": Caffeine's hill climbing on the hit rate (`HillClimber`).
- "ghost": ARC's ghost lists (`GhostTuner`).
"""
from __future__ import annotations

from collections import OrderedDict

from kvtier.eviction import (
    SAMPLE_FACTOR,
    WINDOW_INITIAL_FRACTION,
    ShadowLru,
    WindowTuner,
    register_tuner,
)

CAFFEINE_WINDOW_FRACTION = 0.01
"""Caffeine's starting window, 1% of the capacity: where the hill-climbing ablation
starts, and the fixed window of the fixed-window ablation."""

CLIMB_STEP_FRACTION = 0.0625
"""First hill-climbing step: 6.25% of the capacity (Caffeine's)."""

CLIMB_STEP_DECAY = 0.98
"""Each step is 2% smaller than the last, so the window settles."""

CLIMB_RESTART_THRESHOLD = 0.05
"""A hit-rate change this large (absolute) means the workload changed: restart the
climb with a full step."""

REFERENCE_STEP_FRACTION = 0.125
"""Each sample ahead of the shadow LRU shrinks the window by 12.5% of the capacity:
eight samples span the whole range."""

REFERENCE_RETREAT_STEPS = 2
"""Each sample behind the shadow LRU grows the window by two steps: a sample behind
LRU costs the user hit rate, a sample level gains nothing, so the tuner retreats
toward LRU faster than it advances away from it (equal steps oscillated about the
point where it equals LRU)."""

ADAPTATIONS = ("mini", "shadow", "symmetric", "climb", "off", "ghost")
"""Every `adapt` value a cache takes once this module is imported: the core's and
these ablations."""


class HillClimber(WindowTuner):
    """Caffeine's hill climbing on the hit rate (`adapt="climb"`).

    Each sample (lookups covering `sample_blocks` blocks) yields a hit rate; if it
    improved on the previous sample the window keeps moving the same way, otherwise
    it turns around. Steps decay geometrically and restart on a large change.
    """

    __slots__ = ("sample_blocks", "step", "_looked", "_hit", "_previous", "_direction")

    def __init__(self, capacity_blocks: int, window_fraction: float = WINDOW_INITIAL_FRACTION,
                 sample_factor: float | None = None) -> None:
        WindowTuner.__init__(self, capacity_blocks, window_fraction)
        factor = SAMPLE_FACTOR if sample_factor is None else sample_factor
        self.sample_blocks = max(1, int(capacity_blocks * factor))
        self.step = capacity_blocks * CLIMB_STEP_FRACTION
        self._looked = 0
        self._hit = 0
        self._previous: float | None = None
        self._direction = 1.0

    def on_lookup(self, hashes: list, limit: int, matched: int, cached: int) -> bool:
        return self.record(len(hashes), matched)

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
        self.window_target = min(float(self.capacity), max(0.0, target))
        self.adjustments += 1
        return self.window_target != before


class LruReferenceTuner(WindowTuner):
    """Moves the window's share so the cache never does worse than LRU would
    (`adapt="shadow"`, and `"symmetric"`: one step either way, holding when level).

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

    __slots__ = ("shadow", "step", "symmetric", "last_ours", "last_lru", "_evictions", "_looked", "_ours", "_lru")

    def __init__(self, capacity_blocks: int, window_fraction: float = WINDOW_INITIAL_FRACTION,
                 symmetric: bool = False) -> None:
        WindowTuner.__init__(self, capacity_blocks, window_fraction)
        self.shadow = ShadowLru(capacity_blocks)
        self._looked = self._ours = self._lru = 0
        self.last_ours = self.last_lru = 0  # the last whole sample's matched blocks (the thrash gauge's)
        self.symmetric = symmetric
        self.step = capacity_blocks * REFERENCE_STEP_FRACTION
        self._evictions = 0  # the shadow's, when the sample began

    def behind_lru(self, ratio: float) -> bool:
        return self.last_ours < ratio * self.last_lru

    def on_lookup(self, hashes: list, limit: int, matched: int, cached: int) -> bool:
        if not self._sample_ended(hashes, limit, matched):
            return False
        behind, level = self.last_ours < self.last_lru, self.last_ours == self.last_lru
        full = self.shadow.evictions > self._evictions
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

    def _sample_ended(self, hashes: list, limit: int, matched: int) -> bool:
        """Account one lookup; True when it ended a sample (then `last_*` are its)."""
        self._lru += self.shadow.access(hashes, limit)
        self._ours += matched
        self._looked += len(hashes)
        if self._looked < self.capacity * SAMPLE_FACTOR:
            return False
        self.last_ours, self.last_lru = self._ours, self._lru
        self._looked = self._ours = self._lru = 0
        return True


class GhostTuner(WindowTuner):
    """ARC's adaptation (Megiddo & Modha, FAST'03), applied to the window's share.

    Two ghost lists hold the hashes of blocks recently evicted from the window and
    from main (hashes only, no KV). A ghost block counts only if its region could
    have grown enough to keep it: the window's ghost holds at most what the window
    could gain (capacity - window), main's at most what main could gain (the
    window's share). A prompt whose uncached blocks are found in a ghost list would
    have hit had that region been larger: each block found in the window's ghost
    grows the window by max(1, |main ghost| / |window ghost|) blocks, each found in
    main's ghost shrinks it by max(1, |window ghost| / |main ghost|). Every such
    event moves the share, so there is no sample to be noisy over (`adapt="ghost"`).
    """

    __slots__ = ("ghosts",)

    def __init__(self, capacity_blocks: int, window_fraction: float = WINDOW_INITIAL_FRACTION) -> None:
        WindowTuner.__init__(self, capacity_blocks, window_fraction)
        self.ghosts: tuple[OrderedDict, OrderedDict] = (OrderedDict(), OrderedDict())  # [WINDOW], [MAIN]

    def on_lookup(self, hashes: list, limit: int, matched: int, cached: int) -> bool:
        return cached < len(hashes) and self.missed(hashes[cached:])

    def on_evict(self, region: int, hashes: list) -> None:
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


register_tuner("shadow", lambda capacity, window, min_sightings: LruReferenceTuner(capacity, window))
register_tuner("symmetric", lambda capacity, window, min_sightings: LruReferenceTuner(capacity, window,
                                                                                     symmetric=True))
register_tuner("climb", lambda capacity, window, min_sightings: HillClimber(capacity, window))
register_tuner("ghost", lambda capacity, window, min_sightings: GhostTuner(capacity, window))
