"""Admission and placement (rule: admission): who earns a slot, in what order, on which tier.

* `CountMinSketch` counts sightings of block hashes in fixed memory, with TinyLFU's
  periodic halving as decay, so old popularity fades.
* `Admission` turns sightings into a decision: a block is stored from its
  `bar`-th sighting (the bar starts at `min_sightings`, default 2 = "second sighting");
  placement is inferred from reuse: small and hot -> pinned, seen twice -> DRAM,
  once -> not stored. Callers never declare a policy.
* `StoreQueue` holds admitted stores ordered by value (matched tokens x sightings);
  when full it drops its LEAST valuable entry, never simply the newest.
* `ThrashDetector` watches evictions against stores; when evictions/s exceed
  0.9 x stores/s for a sustained stretch it raises the admission bar. Thrash only ever
  makes admission stricter, never looser. What counts as an eviction here is a block
  evicted before it served a single hit since it was stored: a full cache that evicts
  cold-but-once-useful blocks is working, one that evicts what it just stored is
  thrashing. Once thrash has been absent for a long calm (`RELAX_AFTER_CALM_WINDOWS`),
  the bar steps back down by one, never below `min_sightings`: the workload that
  forced it up has gone, and a bar stuck at its maximum would refuse a healthy cache
  for good.

Everything here is pure bookkeeping over values and an injected clock.
"""
from __future__ import annotations

import bisect
import enum
import itertools
from typing import Callable, Generic, TypeVar

import numpy as np

from kvtier.keys import BlockHash

DEFAULT_MIN_SIGHTINGS = 2
"""Store on the second sighting: one-shot prefixes never take a slot (TinyLFU)."""

HOT_SIGHTINGS = 4
"""Sightings after which a small prefix is treated as hot (a system prompt or an agent
transcript re-sent every step earns it by its fourth use)."""

THRASH_RATIO = 0.9
"""Evictions/s above this fraction of stores/s means the cache evicts about as fast as
it fills: entries die before their second use."""

THRASH_WINDOW_S = 1.0
"""Rates are compared per one-second window."""

THRASH_SUSTAIN_WINDOWS = 5
"""Thrash must persist this many consecutive windows before the bar moves, so one
burst of evictions (say, after an invalidation) does not tighten admission."""

MAX_ADMISSION_BAR = 8
"""The bar never rises past this: a prefix seen eight times is worth caching whatever
the churn."""

RELAX_AFTER_CALM_WINDOWS = 60
"""A minute of windows without thrash before the bar steps down one notch: far longer
than the five windows that raise it, so the bar cannot oscillate."""

SKETCH_WIDTH = 1 << 16
SKETCH_DEPTH = 4
"""64Ki counters x 4 rows x 4 bytes = 1 MiB: a few MB at most, per the design."""

SKETCH_SAMPLE_FACTOR = 10
"""TinyLFU reset: halve every counter after width x 10 additions."""


class Placement(enum.Enum):
    """Where an admitted prefix lives, inferred from reuse."""

    SKIP = "skip"        # seen once: not stored
    DRAM = "dram"        # seen `bar` times: the host-DRAM tier
    PINNED = "pinned"    # small and hot: evicted only after every DRAM block


SKETCH_SHORT_INPUT = 8
"""At or below this many hashes per call, plain Python beats numpy's ~15 us per-call
overhead (a lookup of a short prompt, the simulator's hot path)."""


class CountMinSketch:
    """Count-min sketch over 16-byte block hashes, with halving decay.

    Row i indexes with h1 + i*h2 (the two 64-bit halves of the hash), which is
    enough independence for xxh3 output. Counts are over-estimates, never under.
    Calls on a few hashes take a pure-Python path over a flat view of the same
    table; both paths touch the same counters (pinned by a hypothesis test).
    """

    __slots__ = ("width", "depth", "table", "additions", "sample_size", "resets", "_mask", "_rows",
                 "_flat")

    def __init__(self, width: int = SKETCH_WIDTH, depth: int = SKETCH_DEPTH,
                 sample_size: int | None = None) -> None:
        if width < 16 or width & (width - 1):
            raise ValueError(f"sketch width must be a power of two >= 16, got {width}")
        if depth < 1:
            raise ValueError(f"sketch depth must be >= 1, got {depth}")
        self.width, self.depth = width, depth
        self.table = np.zeros((depth, width), dtype=np.uint32)
        self.additions = 0
        self.sample_size = sample_size if sample_size is not None else width * SKETCH_SAMPLE_FACTOR
        self.resets = 0
        self._mask = np.uint64(width - 1)
        self._rows = np.arange(depth, dtype=np.uint64)[:, None]
        self._flat = memoryview(self.table).cast("B").cast("I")  # halving is in place: stays valid

    def add(self, hashes: list[BlockHash]) -> None:
        """Count one sighting of each hash (duplicates in one call count once)."""
        if not hashes:
            return
        if len(hashes) <= SKETCH_SHORT_INPUT:
            self._add_few(hashes)
        else:
            self._add_many(hashes)
        self.additions += len(hashes)
        if self.additions >= self.sample_size:
            self.table >>= 1
            self.additions //= 2
            self.resets += 1

    def estimate(self, hashes: list[BlockHash]) -> np.ndarray:
        """Estimated sightings of each hash (int64 array, same order)."""
        if not hashes:
            return np.zeros(0, dtype=np.int64)
        if len(hashes) <= SKETCH_SHORT_INPUT:
            return self._estimate_few(hashes)
        return self._estimate_many(hashes)

    def _index(self, hashes: list[BlockHash]) -> np.ndarray:
        halves = np.frombuffer(b"".join(hashes), dtype="<u8").reshape(-1, 2)
        with np.errstate(over="ignore"):
            return ((halves[:, 0][None, :] + self._rows * halves[:, 1][None, :]) & self._mask).astype(np.intp)

    def _add_many(self, hashes: list[BlockHash]) -> None:
        idx = self._index(hashes)
        rows = np.arange(self.depth)[:, None]
        self.table[rows, idx] += 1

    def _estimate_many(self, hashes: list[BlockHash]) -> np.ndarray:
        idx = self._index(hashes)
        rows = np.arange(self.depth)[:, None]
        return self.table[rows, idx].min(axis=0).astype(np.int64)

    def _cells(self, h: bytes) -> list[int]:
        """Flat positions (row * width + column) of the hash's counters, one per row."""
        lo = int.from_bytes(h[:8], "little")
        hi = int.from_bytes(h[8:16], "little")
        m, w = self.width - 1, self.width
        if self.depth == 4:  # the default depth, unrolled: the simulator's hot path
            return [lo & m, w + ((lo + hi) & m), 2 * w + ((lo + 2 * hi) & m), 3 * w + ((lo + 3 * hi) & m)]
        return [i * w + ((lo + i * hi) & m) for i in range(self.depth)]

    def _add_few(self, hashes: list[BlockHash]) -> None:
        flat = self._flat
        # One increment per distinct counter, as numpy's fancy-index += does.
        cells = self._cells(hashes[0]) if len(hashes) == 1 else {c for h in hashes for c in self._cells(h)}
        for c in cells:
            flat[c] = (flat[c] + 1) & 0xFFFFFFFF

    def _estimate_few(self, hashes: list[BlockHash]) -> np.ndarray:
        flat = self._flat
        return np.array([min(flat[c] for c in self._cells(h)) for h in hashes], dtype=np.int64)


class ThrashDetector:
    """Evictions vs stores per window; `check` says when to raise the admission bar."""

    __slots__ = ("ratio", "window_s", "sustain_windows", "_start", "_stores", "_evictions",
                 "consecutive", "events", "thrashing", "calm_windows")

    def __init__(self, ratio: float = THRASH_RATIO, window_s: float = THRASH_WINDOW_S,
                 sustain_windows: int = THRASH_SUSTAIN_WINDOWS) -> None:
        if window_s <= 0 or sustain_windows < 1 or not 0 < ratio:
            raise ValueError("thrash detector needs window_s > 0, sustain_windows >= 1, ratio > 0")
        self.ratio, self.window_s, self.sustain_windows = ratio, window_s, sustain_windows
        self._start: float | None = None
        self._stores = 0
        self._evictions = 0
        self.consecutive = 0
        self.events = 0
        self.thrashing = False
        self.calm_windows = 0  # whole windows since the last one that thrashed

    def record(self, now_s: float, stored_blocks: int = 0, evicted_blocks: int = 0) -> bool:
        """Account blocks stored/evicted at `now_s`. Returns True when a sustained
        stretch of thrash just completed (the caller raises the bar once per stretch)."""
        fired = self._roll(now_s)
        self._stores += stored_blocks
        self._evictions += evicted_blocks
        return fired

    def _roll(self, now_s: float) -> bool:
        if self._start is None:
            self._start = now_s
            return False
        elapsed = now_s - self._start
        if elapsed < self.window_s:
            return False
        thrashed = self._evictions > 0 and self._evictions > self.ratio * self._stores
        self.consecutive = self.consecutive + 1 if thrashed else 0
        # Whole idle windows after the one just closed were calm, whatever it was.
        windows = max(1, int(elapsed // self.window_s))
        self.calm_windows = windows - 1 if thrashed else self.calm_windows + windows
        if elapsed >= 2 * self.window_s:
            self.consecutive = 0  # an idle window in between breaks the stretch
        self.thrashing = self.consecutive > 0
        self._start = now_s
        self._stores = self._evictions = 0
        if self.consecutive >= self.sustain_windows:
            self.consecutive = 0
            self.events += 1
            return True
        return False


def placement(sightings: int, prefix_bytes: int, bar: int, pin_max_bytes: int,
              hot_sightings: int = HOT_SIGHTINGS) -> Placement:
    """Infer the tier from observed reuse alone."""
    if sightings < bar:
        return Placement.SKIP
    if sightings >= max(hot_sightings, bar) and prefix_bytes <= pin_max_bytes:
        return Placement.PINNED
    return Placement.DRAM


class Admission:
    """The sketch plus the admission bar that thrash can raise."""

    __slots__ = ("sketch", "min_sightings", "bar", "max_bar", "thrash", "rejects", "admits")

    def __init__(self, min_sightings: int = DEFAULT_MIN_SIGHTINGS, *,
                 sketch: CountMinSketch | None = None, thrash: ThrashDetector | None = None,
                 max_bar: int = MAX_ADMISSION_BAR) -> None:
        if isinstance(min_sightings, bool) or not isinstance(min_sightings, int) or min_sightings < 1:
            raise ValueError(f"min_sightings must be an integer >= 1, got {min_sightings!r}")
        self.sketch = sketch or CountMinSketch()
        self.min_sightings = min_sightings
        self.bar = min_sightings
        self.max_bar = max(max_bar, min_sightings)
        self.thrash = thrash or ThrashDetector()
        self.rejects = 0
        self.admits = 0

    def sight(self, hashes: list[BlockHash]) -> None:
        self.sketch.add(hashes)

    def admitted_blocks(self, hashes: list[BlockHash]) -> tuple[int, int]:
        """How many leading blocks of `hashes` meet the bar, and the sightings of the
        last of them (0, 0 when none does)."""
        if not hashes:
            return 0, 0
        counts = self.sketch.estimate(hashes)
        below = np.flatnonzero(counts < self.bar)
        n = int(below[0]) if below.size else len(hashes)
        if n == 0:
            self.rejects += 1
            return 0, 0
        self.admits += 1
        return n, int(counts[n - 1])

    def record(self, now_s: float, stored_blocks: int = 0, evicted_blocks: int = 0) -> None:
        """Feed the thrash detector; a completed thrash stretch raises the bar by one,
        a long calm lowers it by one (never below `min_sightings`)."""
        if self.thrash.record(now_s, stored_blocks, evicted_blocks) and self.bar < self.max_bar:
            self.bar += 1
        elif self.thrash.calm_windows >= RELAX_AFTER_CALM_WINDOWS and self.bar > self.min_sightings:
            self.bar -= 1
            self.thrash.calm_windows = 0


T = TypeVar("T")


class StoreQueue(Generic[T]):
    """Bounded queue ordered by value; full means the least valuable entry goes.

    `push` returns what was dropped (the new item itself if it is the least valuable),
    `pop` returns the most valuable item. Equal values keep arrival order.
    """

    __slots__ = ("capacity", "_entries", "_seq", "drops")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"store queue capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: list[tuple[float, int, T]] = []  # ascending (value, -seq)
        self._seq = itertools.count()
        self.drops = 0

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, value: float, item: T) -> T | None:
        entry = (value, -next(self._seq), item)
        if len(self._entries) >= self.capacity:
            self.drops += 1
            lowest = self._entries[0]
            if (entry[0], entry[1]) <= (lowest[0], lowest[1]):
                return item
            self._entries.pop(0)
            bisect.insort(self._entries, entry, key=lambda e: (e[0], e[1]))
            return lowest[2]
        bisect.insort(self._entries, entry, key=lambda e: (e[0], e[1]))
        return None

    def pop(self) -> T | None:
        """The most valuable entry (oldest among equals), or None when empty."""
        if not self._entries:
            return None
        # Ascending by (value, -seq): the last entry is the top value's oldest.
        return self._entries.pop()[2]

    def remove_if(self, predicate: Callable[[T], bool]) -> int:
        before = len(self._entries)
        self._entries = [e for e in self._entries if not predicate(e[2])]
        return before - len(self._entries)

    def items(self) -> list[T]:
        return [e[2] for e in self._entries]
