"""Admission and placement (rule: admission): who earns a place, in what order, on which tier.

* `CountMinSketch` counts sightings of block hashes in fixed memory, with TinyLFU's
  periodic halving as decay, so old popularity fades, and a doorkeeper: a block's
  first sighting only sets a bit, so the one-shot majority never occupies counters.
* `FrequencyFilter` is TinyLFU's frequency filter: every lookup sights every full block of
  the prompt, and when the cache is full a block leaving the window enters the main
  region only if the sketch has seen it at least as often as main's victim is
  still being hit (see `kvtier.eviction`). Stores themselves are never refused: free space is always
  used, and a new block always gets its turn in the window.
* Placement is inferred from reuse: small and hot -> pinned, otherwise DRAM.
  Callers never declare a policy.
* `StoreQueue` holds stores ordered by value (tokens x sightings); when full it
  drops its LEAST valuable entry, never simply the newest.

Thrash is only reported, never acted on: it is measured against a shadow LRU of the
same size (`THRASH_RATIO`). Evictions outpacing stores are not thrash (fresh
conversation turns that lose their duel are stored and evicted unused by design); under
a one-shot stream the window's candidates lose their duels, so the stream never
displaces the reused set, and the window's share is chosen by miniature simulations of
the cache (`kvtier.eviction`), never by eviction counts.

Everything here is pure bookkeeping over values.
"""
from __future__ import annotations

import bisect
import enum
import itertools
import struct
import sys
from typing import Callable, Generic, TypeVar

import numpy as np

from kvtier.eviction import admits
from kvtier.keys import BlockHash

DEFAULT_MIN_SIGHTINGS = 2
"""A block seen fewer times never displaces another in a full cache: one-shot
prefixes only ever use free space or the window (TinyLFU)."""

HOT_SIGHTINGS = 4
"""Sightings after which a small prefix is treated as hot (a system prompt or an agent
transcript re-sent every step earns it by its fourth use)."""

THRASH_RATIO = 0.9
"""Thrash: over the last sample the cache matched fewer than this fraction of the
blocks a shadow LRU of the same size would have. A cache that evicts a lot but matches
what LRU would is behaving. Reported only (a gauge and an alert), never acted on."""

SKETCH_WIDTH = 1 << 16
SKETCH_DEPTH = 4
"""64Ki counters x 4 rows x 4 bytes = 1 MiB: the width when nothing else is said."""

SKETCH_MIN_WIDTH = 1 << 10
SKETCH_MAX_WIDTH = 1 << 19
"""A cache's sketch has about one counter per sighting it counts between two
halvings, so a one-shot stream does not inflate estimates, within these bounds:
at most 8 MiB of counters (and 4 MiB of doorkeeper) however large the arena."""

SKETCH_SAMPLE_FACTOR = 10
"""TinyLFU reset for a sketch of fixed width: halve after width x 10 additions."""

SKETCH_SLOT_MEMORY = 100
"""A cache's sketch halves after 100 x (slots) additions: it must still remember a
block's first sighting when the block comes back, and in prompt traffic that is
often a conversation's next turn, many cache turnovers later (Caffeine's 10 x
entries assumes reuse within about one turnover: docs/ARCHITECTURE.md)."""

DOORKEEPER_BITS_PER_COUNTER = 8
"""Doorkeeper bits per sketch counter: one bit per block of the sample keeps its
false-positive rate low at two probes."""


class Placement(enum.Enum):
    """Where an admitted prefix lives, inferred from reuse."""

    SKIP = "skip"        # seen fewer than `bar` times: window only, never pinned
    DRAM = "dram"        # seen `bar` times: the host-DRAM tier
    PINNED = "pinned"    # small and hot: evicted only after every DRAM block


SKETCH_SHORT_INPUT = 5
"""At or below this many hashes, an estimate reads each hash's cells one by one
(`_estimate_cells`, ~1 us a hash) rather than paying numpy's ~6 us per call."""

_HALVES = struct.Struct("<QQ").unpack
"""A 16-byte hash as its two little-endian 64-bit halves, in one C call."""

_HALF = np.dtype("<u8")
_BOTH_PROBES_SET = 0x0101
"""A hash's two doorkeeper bytes read as one uint16: both set (each byte is 0 or 1)."""

_COMPILED = not __file__.endswith(".py") and sys.byteorder == "little"
"""Whether this module runs compiled (kvtier._compiled), where `_sight_hashes` and
`_estimate_cells` run as typed C loops (admission.pxd). A sketch
counts in one of two ways: compiled, with `_sight_hashes`, which beats numpy at any size; as plain
Python, with numpy (`_add_many`), since the loop uncompiled is the slowest way to
count. `_estimate_cells` serves both builds."""


def _sight_hashes(flat, door, stamp, hashes, n, width, depth, door_mask, epoch):
    """One sighting of each of the `n` 16-byte `hashes`, whose (lo, hi) halves are read
    from their bytes (little-endian): with a doorkeeper (`door`), a hash whose two
    probes were not both set before this call only sets them; every other hash adds
    one to each of its cells, once per distinct cell (`stamp[c] == epoch` marks a cell
    this call has counted). The same counts as `_add_many`."""
    m = width - 1
    for j in range(n):
        h = hashes[j]
        p = h
        lo = 0
        hi = 0
        for k in range(7, -1, -1):
            lo = (lo << 8) | p[k]
            hi = (hi << 8) | p[k + 8]
        if door is not None and not (door[lo & door_mask] and door[hi & door_mask]):
            continue
        for i in range(depth):
            c = i * width + ((lo + i * hi) & m)
            if stamp[c] != epoch:
                stamp[c] = epoch
                flat[c] += 1  # uint32: wraps as the other paths do
    if door is not None:  # set only now: every probe was read before any was set
        for j in range(n):
            h = hashes[j]
            p = h
            lo = 0
            hi = 0
            for k in range(7, -1, -1):
                lo = (lo << 8) | p[k]
                hi = (hi << 8) | p[k + 8]
            door[lo & door_mask] = 1
            door[hi & door_mask] = 1


def _u32_view(a):
    """`a` as the typed view the compiled loops take (compiled: made once and kept, so
    a call does not acquire the array's buffer again); `a` itself as plain Python."""
    return a


def _u8_view(a):
    """`_u32_view` for the doorkeeper's bytes (None stays None)."""
    return a


def _estimate_cells(flat, door, lo, hi, width, depth, door_mask):
    """The sketch's estimate for the hash with halves (lo, hi): its cells' minimum,
    plus one when the doorkeeper (`door`) has seen it."""
    m = width - 1
    est = flat[lo & m]
    for i in range(1, depth):
        v = flat[i * width + ((lo + i * hi) & m)]
        if v < est:
            est = v
    if door is not None and door[lo & door_mask] and door[hi & door_mask]:
        est += 1
    return est


class CountMinSketch:
    """Count-min sketch over 16-byte block hashes, with halving decay and an
    optional doorkeeper.

    Row i indexes with h1 + i*h2 (the two 64-bit halves of the hash), which is
    enough independence for xxh3 output. Counts are over-estimates, never under.
    With the doorkeeper, a hash's first sighting only sets its two doorkeeper
    probes (h1 and h2, one byte each); later ones count in the table, and an
    estimate is the table's minimum plus one when the doorkeeper knows the hash.
    Halving clears the doorkeeper. Estimates of a few hashes go through
    `_estimate_cells`, over flat views of the arrays. Compiled (kvtier._compiled),
    every addition runs the typed loop `_sight_hashes`; as plain Python, numpy.
    Both touch the same counters (pinned by a hypothesis test).
    """

    __slots__ = ("width", "depth", "table", "additions", "sample_size", "resets", "_mask", "_coef",
                 "_row_base", "_table_flat", "_flat", "door", "_door_flat", "_door_mask", "_door_mask_i64",
                 "_stamp", "_epoch", "_views")

    def __init__(self, width: int = SKETCH_WIDTH, depth: int = SKETCH_DEPTH,
                 sample_size: int | None = None, doorkeeper: bool = False) -> None:
        if width < 16 or width & (width - 1):
            raise ValueError(f"sketch width must be a power of two >= 16, got {width}")
        if depth < 1:
            raise ValueError(f"sketch depth must be >= 1, got {depth}")
        self.width, self.depth = width, depth
        self.table = np.zeros((depth, width), dtype=np.uint32)
        self.table.fill(0)  # touch every page now: first touches scattered over lookups cost page faults
        self.additions = 0
        self.sample_size = sample_size if sample_size is not None else width * SKETCH_SAMPLE_FACTOR
        self.resets = 0
        self._mask = np.uint64(width - 1)
        rows = np.arange(depth, dtype=np.uint64)
        self._coef = np.stack([np.ones(depth, dtype=np.uint64), rows])  # (h1, h2) @ coef = h1 + i*h2 per row i
        self._row_base = (rows * np.uint64(width)).astype(np.int64)[None, :]  # int64: flat positions are intp
        self._table_flat = self.table.reshape(-1)  # a view: halving is in place
        self._flat = memoryview(self.table).cast("B").cast("I")  # halving is in place: stays valid
        door_size = width * DOORKEEPER_BITS_PER_COUNTER if doorkeeper else 0
        self.door = np.zeros(door_size, dtype=np.uint8) if doorkeeper else None
        if self.door is not None:
            self.door.fill(0)
        self._door_flat = memoryview(self.door).cast("B") if doorkeeper else None
        self._door_mask = max(door_size - 1, 0)  # unsigned for the typed loops; unused without a doorkeeper
        self._door_mask_i64 = np.int64(self._door_mask)  # < 2**63: masking the int64 view is exact
        self._stamp: np.ndarray | None = None  # `_add_typed`'s, made on its first call
        self._epoch = 0
        self._views: tuple | None = None  # `_add_typed`'s typed views of (table, door, stamp)

    @classmethod
    def for_slots(cls, slots: int, doorkeeper: bool = True) -> CountMinSketch:
        """A sketch sized for a cache of `slots` blocks: halving after
        `SKETCH_SLOT_MEMORY` x slots additions, about one counter per addition in
        between (within the width bounds)."""
        sample = max(slots, 1) * SKETCH_SLOT_MEMORY
        width = SKETCH_MIN_WIDTH
        while width < sample and width < SKETCH_MAX_WIDTH:
            width *= 2
        return cls(width, SKETCH_DEPTH, sample, doorkeeper)

    def add(self, hashes: list[BlockHash]) -> None:
        """Count one sighting of each hash (duplicates in one call count once)."""
        if not hashes:
            return
        if _COMPILED:
            self._add_typed(hashes)
        else:
            self._add_many(hashes)
        self.additions += len(hashes)
        if self.additions >= self.sample_size:
            self.halve()

    def halve(self) -> None:
        """TinyLFU's reset: halve every counter and forget the doorkeeper."""
        self.table >>= 1
        self.additions //= 2
        self.resets += 1
        if self.door is not None:
            self.door[:] = 0

    def estimate(self, hashes: list[BlockHash]) -> np.ndarray:
        """Estimated sightings of each hash (int64 array, same order)."""
        if not hashes:
            return np.zeros(0, dtype=np.int64)
        if len(hashes) <= SKETCH_SHORT_INPUT:
            return self._estimate_few(hashes)
        return self._estimate_many(hashes)

    def estimate_one(self, h: BlockHash) -> int:
        """Estimated sightings of one hash (the eviction duel's hot path)."""
        lo, hi = _HALVES(h)
        return _estimate_cells(self._flat, self._door_flat, lo, hi, self.width, self.depth, self._door_mask)

    def _halves(self, hashes: list[BlockHash]) -> np.ndarray:
        return np.frombuffer(b"".join(hashes), dtype=_HALF).reshape(-1, 2)

    def _index(self, halves: np.ndarray) -> np.ndarray:
        """Flat positions (row * width + column) of every hash's counters: one row
        per hash, one column per sketch row (uint64 arithmetic wraps, as the
        pure-Python path's masking does; the masked columns fit int64, numpy's intp)."""
        return ((halves @ self._coef) & self._mask).view(np.int64) + self._row_base

    def _door_probes(self, halves: np.ndarray) -> np.ndarray:
        """Both doorkeeper probes of every hash: one row per hash (its two halves, masked)."""
        return halves.view(np.int64) & self._door_mask_i64

    def _door_known(self, probes: np.ndarray) -> np.ndarray:
        """Per hash, whether the doorkeeper has seen it (both probes set)."""
        return self.door[probes].view(np.uint16)[:, 0] == _BOTH_PROBES_SET  # type: ignore[index]

    def _add_many(self, hashes: list[BlockHash]) -> None:
        halves = self._halves(hashes)
        door = self.door
        if door is not None:
            probes = self._door_probes(halves)
            known = self._door_known(probes)  # read every probe before setting any
            door[probes] = 1
            halves = halves.compress(known, axis=0)
        self._table_flat[self._index(halves)] += 1  # one increment per distinct counter

    def _estimate_many(self, hashes: list[BlockHash]) -> np.ndarray:
        halves = self._halves(hashes)
        est = self._table_flat[self._index(halves)].min(axis=1).astype(np.int64)
        if self.door is not None:
            est += self._door_known(self._door_probes(halves))
        return est

    def _add_typed(self, hashes: list[BlockHash]) -> None:
        """`_sight_hashes` over the hashes (compiled only: see `_COMPILED`), on typed
        views of the table, doorkeeper and stamps made once (acquiring three buffers per
        call cost more than the counting)."""
        self._epoch += 1
        if self._stamp is None or self._epoch > 0xFFFFFFFF:  # first call, or the epoch wraps: start over
            self._stamp = np.zeros(self.width * self.depth, dtype=np.uint32)
            self._epoch = 1
            self._views = (_u32_view(self._table_flat), _u8_view(self.door), _u32_view(self._stamp))
        flat, door, stamp = self._views  # halving and clearing the doorkeeper are in place: still valid
        _sight_hashes(flat, door, stamp, hashes, len(hashes), self.width, self.depth, self._door_mask, self._epoch)

    def _estimate_few(self, hashes: list[BlockHash]) -> np.ndarray:
        return np.array([self.estimate_one(h) for h in hashes], dtype=np.int64)


def placement(sightings: int, prefix_bytes: int, bar: int, pin_max_bytes: int,
              hot_sightings: int = HOT_SIGHTINGS) -> Placement:
    """Infer the tier from observed reuse alone."""
    if sightings < bar:
        return Placement.SKIP
    if sightings >= max(hot_sightings, bar) and prefix_bytes <= pin_max_bytes:
        return Placement.PINNED
    return Placement.DRAM


class FrequencyFilter:
    """The frequency filter: the sketch, the least sightings a block needs to enter a
    full main region, and how the duels went."""

    __slots__ = ("sketch", "min_sightings", "rejects", "admits")

    def __init__(self, min_sightings: int = DEFAULT_MIN_SIGHTINGS, *,
                 sketch: CountMinSketch | None = None) -> None:
        if isinstance(min_sightings, bool) or not isinstance(min_sightings, int) or min_sightings < 1:
            raise ValueError(f"min_sightings must be an integer >= 1, got {min_sightings!r}")
        self.sketch = sketch or CountMinSketch(doorkeeper=True)
        self.min_sightings = min_sightings
        self.rejects = 0
        self.admits = 0

    @property
    def bar(self) -> int:
        """Sightings a window candidate needs before it may displace anything."""
        return self.min_sightings

    def sight(self, hashes: list[BlockHash]) -> None:
        self.sketch.add(hashes)

    def frequency(self, h: BlockHash) -> int:
        return self.sketch.estimate_one(h)

    def duel(self, candidate: BlockHash) -> bool:
        """Does the window's candidate (its tail block's sightings) move into main?"""
        return self.duel_sightings(self.sketch.estimate_one(candidate))

    def duel_sightings(self, sightings: int) -> bool:
        """The duel for a candidate whose sightings are already known."""
        won = admits(sightings, self.min_sightings)
        if won:
            self.admits += 1
        else:
            self.rejects += 1
        return won


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
