"""Admission pieces in isolation: the sketch and its doorkeeper, the duel, the value-ordered
queue, placement."""
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


def test_doorkeeper_keeps_first_sightings_out_of_the_counters():
    sk = CountMinSketch(width=1024, depth=4, doorkeeper=True)
    once, twice = hashes(0, 50), hashes(5_000, 5)
    sk.add(once)
    sk.add(twice)
    sk.add(twice)
    assert sk.table.sum() == 4 * 5          # only the second sightings reached the table
    assert sk.estimate(twice).tolist() == [2] * 5
    assert (sk.estimate(once) >= 1).all()   # a doorkeeper hit still counts as one sighting
    assert [sk.estimate_one(h) for h in twice] == [2] * 5


def test_halving_forgets_the_doorkeeper_too():
    sk = CountMinSketch(width=64, depth=2, sample_size=1_000, doorkeeper=True)
    h = hashes(0, 3)
    sk.add(h)
    sk.halve()
    assert sk.estimate(h).tolist() == [0, 0, 0]


def test_sketch_for_a_cache_grows_with_its_slots_within_bounds():
    small, large = CountMinSketch.for_slots(10), CountMinSketch.for_slots(10_000_000)
    assert small.width >= 1000 and large.width == 1 << 19
    assert small.sample_size < large.sample_size


def test_a_candidate_moves_into_main_only_once_seen_min_sightings_times():
    adm = Admission(min_sightings=2, sketch=CountMinSketch(width=4096, doorkeeper=True))
    seen_once, seen_twice, unseen = hashes(0, 1), hashes(900, 1), hashes(1800, 1)
    adm.sight(seen_once)
    for _ in range(2):
        adm.sight(seen_twice)
    assert not adm.duel(seen_once[0])   # one sighting is below the bar
    assert not adm.duel(unseen[0])
    assert adm.duel(seen_twice[0])
    assert (adm.admits, adm.rejects) == (1, 2)


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


@pytest.mark.parametrize("doorkeeper", [False, True])
@settings(max_examples=60, deadline=None)
@given(batches=st.lists(st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=12), min_size=1, max_size=40))
def test_short_input_and_typed_paths_count_exactly_like_the_vectorised_path(batches, doorkeeper):
    few = CountMinSketch(width=64, sample_size=50, doorkeeper=doorkeeper)
    many = CountMinSketch(width=64, sample_size=50, doorkeeper=doorkeeper)
    typed = CountMinSketch(width=64, sample_size=50, doorkeeper=doorkeeper)  # the compiled build's path
    for hashes in batches:
        few._add_few(hashes)
        many._add_many(hashes)
        typed._add_typed(hashes)
        assert np.array_equal(few._estimate_few(hashes), many._estimate_many(hashes))
        assert [typed.estimate_one(h) for h in hashes] == many._estimate_many(hashes).tolist()
        assert np.array_equal(few.table, many.table) and np.array_equal(typed.table, many.table)
        if doorkeeper:
            assert np.array_equal(few.door, many.door) and np.array_equal(typed.door, many.door)
    sketch = CountMinSketch(width=64, sample_size=50)  # the public API mixes both paths
    for hashes in batches:
        sketch.add(hashes)
    assert sketch.additions <= 50
