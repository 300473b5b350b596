"""Admission pieces in isolation: the sketch, the value-ordered queue, thrash, placement."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.admission import (
    Admission,
    CountMinSketch,
    Placement,
    StoreQueue,
    ThrashDetector,
    placement,
)
from kvtier.keys import KeyRoot, block_hashes

ROOT = KeyRoot("t", "m", "w", "fp16", "r", "a")


def hashes(start: int, n_blocks: int) -> list[bytes]:
    return block_hashes(ROOT, np.arange(start, start + 16 * n_blocks))


def test_sketch_counts_sightings_and_never_underestimates():
    sk = CountMinSketch(width=1024, depth=4)
    hot, cold = hashes(0, 10), hashes(10_000, 500)
    for _ in range(5):
        sk.add(hot)
    sk.add(cold)
    assert sk.estimate(hot).tolist() == [5] * 10
    est = sk.estimate(cold)
    assert (est >= 1).all() and np.median(est) == 1
    assert sk.estimate(hashes(50_000, 3)).max() <= 2


def test_sketch_halves_every_counter_after_its_sample_size():
    sk = CountMinSketch(width=64, depth=2, sample_size=40)
    h = hashes(0, 4)
    for _ in range(9):
        sk.add(h)        # 36 additions
    assert sk.estimate(h).tolist() == [9] * 4
    sk.add(h)            # 40: reset
    assert sk.resets == 1 and sk.estimate(h).tolist() == [5] * 4


@pytest.mark.parametrize("width,depth", [(0, 4), (100, 4), (64, 0)])
def test_sketch_rejects_bad_dimensions(width, depth):
    with pytest.raises(ValueError):
        CountMinSketch(width=width, depth=depth)


def test_admission_admits_the_leading_blocks_that_meet_the_bar():
    adm = Admission(min_sightings=2, sketch=CountMinSketch(width=4096))
    shared, tail = hashes(0, 3), hashes(900, 2)
    adm.sight(shared + tail)
    adm.sight(shared)
    assert adm.admitted_blocks(shared + tail) == (3, 2)
    assert adm.admitted_blocks(tail) == (0, 0)
    assert adm.rejects == 1 and adm.admits == 1


def test_queue_drops_the_least_valuable_entry_not_the_newest():
    q: StoreQueue[str] = StoreQueue(3)
    assert q.push(100.0, "a") is None
    assert q.push(5.0, "b") is None
    assert q.push(50.0, "c") is None
    assert q.push(70.0, "d") == "b"      # full: the least valuable goes
    assert q.push(1.0, "e") == "e"       # the newcomer is itself the least valuable
    assert q.drops == 2
    assert [q.pop(), q.pop(), q.pop(), q.pop()] == ["a", "d", "c", None]


def test_queue_pops_the_oldest_of_equal_values_first():
    q: StoreQueue[int] = StoreQueue(10)
    for i in range(4):
        q.push(7.0, i)
    assert [q.pop() for _ in range(4)] == [0, 1, 2, 3]


def test_thrash_needs_a_sustained_stretch():
    td = ThrashDetector(ratio=0.9, window_s=1.0, sustain_windows=3)
    fired = []
    t = 0.0
    for window in range(7):
        fired.append(td.record(t, stored_blocks=10, evicted_blocks=10))
        t += 1.0
    # Windows close on the next record: windows 0, 1, 2 complete at t=3.
    assert fired == [False, False, False, True, False, False, True]
    assert td.events == 2


def test_evictions_below_ninety_percent_of_stores_are_not_thrash():
    td = ThrashDetector(ratio=0.9, window_s=1.0, sustain_windows=2)
    for i in range(10):
        assert not td.record(float(i), stored_blocks=10, evicted_blocks=8)
    assert not td.thrashing and td.events == 0


def test_a_calm_window_breaks_the_stretch():
    td = ThrashDetector(ratio=0.9, window_s=1.0, sustain_windows=3)
    pattern = [10, 10, 0, 10, 10, 0, 10, 10]
    assert not any(td.record(float(i), stored_blocks=10, evicted_blocks=e) for i, e in enumerate(pattern))


def test_thrash_raises_the_bar_up_to_its_cap_and_never_lowers_it():
    adm = Admission(min_sightings=2, thrash=ThrashDetector(window_s=1.0, sustain_windows=1), max_bar=4)
    bars = []
    for i in range(10):
        adm.record(float(i), stored_blocks=5, evicted_blocks=5)
        bars.append(adm.bar)
    for i in range(10, 20):
        adm.record(float(i), stored_blocks=5, evicted_blocks=0)
        bars.append(adm.bar)
    assert bars[:4] == [2, 3, 4, 4] and bars[-1] == 4
    assert bars == sorted(bars)


def test_placement_is_inferred_from_reuse():
    assert placement(1, 100, bar=2, pin_max_bytes=1000) is Placement.SKIP
    assert placement(2, 100, bar=2, pin_max_bytes=1000) is Placement.DRAM
    assert placement(4, 100, bar=2, pin_max_bytes=1000) is Placement.PINNED
    assert placement(40, 5000, bar=2, pin_max_bytes=1000) is Placement.DRAM
    assert placement(3, 100, bar=5, pin_max_bytes=1000) is Placement.SKIP


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_min_sightings_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="min_sightings"):
        Admission(min_sightings=bad)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=12), min_size=1, max_size=40))
def test_short_input_path_counts_exactly_like_the_vectorised_path(batches):
    few, many = CountMinSketch(width=64, sample_size=50), CountMinSketch(width=64, sample_size=50)
    for hashes in batches:
        few._add_few(hashes)
        many._add_many(hashes)
        assert np.array_equal(few._estimate_few(hashes), many._estimate_many(hashes))
        assert np.array_equal(few.table, many.table)
    sketch = CountMinSketch(width=64, sample_size=50)  # the public API mixes both paths
    for hashes in batches:
        sketch.add(hashes)
    assert sketch.additions <= 50
