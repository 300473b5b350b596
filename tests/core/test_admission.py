"""Admission pieces in isolation: the sketch and its doorkeeper, the duel, the value-ordered
queue, placement."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.admission import (
    THRASH_RATIO,
    FrequencyFilter,
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
    adm = FrequencyFilter(min_sightings=2, sketch=CountMinSketch(width=4096, doorkeeper=True))
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
        FrequencyFilter(min_sightings=bad)


@pytest.mark.parametrize("doorkeeper", [False, True])
@settings(max_examples=60, deadline=None)
@given(batches=st.lists(st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=12), min_size=1, max_size=40))
def test_the_typed_path_counts_and_the_short_input_path_estimates_like_the_vectorised_path(batches, doorkeeper):
    many = CountMinSketch(width=64, sample_size=50, doorkeeper=doorkeeper)
    typed = CountMinSketch(width=64, sample_size=50, doorkeeper=doorkeeper)  # the compiled build's path
    for hashes in batches:
        many._add_many(hashes)
        typed._add_typed(hashes)
        assert np.array_equal(many._estimate_few(hashes), many._estimate_many(hashes))
        assert [typed.estimate_one(h) for h in hashes] == many._estimate_many(hashes).tolist()
        assert np.array_equal(typed.table, many.table)
        if doorkeeper:
            assert np.array_equal(typed.door, many.door)
    sketch = CountMinSketch(width=64, sample_size=50)  # the public API mixes both paths
    for hashes in batches:
        sketch.add(hashes)
    assert sketch.additions <= 50


def _hash(lo: int, hi: int) -> bytes:
    """A block hash with the given little-endian 64-bit halves (the sketch's h1, h2)."""
    return struct.pack("<QQ", lo, hi)


def test_the_default_sketch_is_a_mebibyte_of_four_rows_halving_after_ten_times_its_width():
    sk = CountMinSketch()
    assert (sk.width, sk.depth, sk.table.nbytes, sk.door) == (1 << 16, 4, 1 << 20, None)
    small = CountMinSketch(width=16)
    h = hashes(0, 160)
    small.add(h[:100])
    small.add(h[100:159])
    assert (small.additions, small.resets) == (159, 0)
    small.add(h[159:])                  # the 160th addition: 10 x the width
    assert small.resets == 1 and small.additions == 80


def test_halving_halves_the_count_of_additions_so_the_next_comes_after_half_a_sample():
    sk = CountMinSketch(width=64, depth=2, sample_size=40)
    h = hashes(0, 4)
    for _ in range(10):
        sk.add(h)
    assert (sk.resets, sk.additions) == (1, 20)
    for _ in range(4):
        sk.add(h)
    assert sk.resets == 1
    sk.add(h)
    assert (sk.resets, sk.additions) == (2, 20)


def test_adding_nothing_counts_nothing_and_estimating_nothing_is_empty():
    sk = CountMinSketch(width=64)
    sk.add([])
    assert sk.additions == 0 and sk.table.sum() == 0
    assert sk.estimate([]).shape == (0,) and sk.estimate([]).dtype == np.int64


def test_a_cache_sketch_halves_after_a_hundred_times_its_slots_with_a_counter_a_sighting_within_bounds():
    one, none = CountMinSketch.for_slots(1), CountMinSketch.for_slots(0)
    assert (one.width, one.sample_size) == (1 << 10, 100) and none.sample_size == 100
    assert CountMinSketch.for_slots(50).width == 8192          # the first power of two >= 5,000
    large = CountMinSketch.for_slots(10_000_000)
    assert (large.width, large.sample_size) == (1 << 19, 1_000_000_000)
    assert large.table.nbytes == 8 << 20 and large.door is not None and large.door.nbytes == 4 << 20
    assert one.door is not None and one.door.size == 8 * one.width


def test_the_narrowest_and_shallowest_sketch_is_accepted_and_counts():
    sk = CountMinSketch(width=16, depth=1)
    h = hashes(0, 3)
    sk.add(h)
    sk.add(h)
    assert sk.estimate(h).tolist() == [2, 2, 2]
    with pytest.raises(ValueError, match="power of two"):
        CountMinSketch(width=8)
    with pytest.raises(ValueError, match="power of two"):
        CountMinSketch(width=48)


@pytest.mark.parametrize("depth", [1, 2, 3, 5])
@pytest.mark.parametrize("doorkeeper", [False, True])
def test_every_depth_counts_alike_on_short_long_and_typed_paths(depth, doorkeeper):
    rng = np.random.default_rng(depth)
    many, typed = (CountMinSketch(width=64, depth=depth, sample_size=10_000, doorkeeper=doorkeeper)
                   for _ in range(2))
    for n in (1, 3, 5, 2, 4):
        fresh = [bytes(b) for b in rng.integers(0, 256, size=(n, 16), dtype=np.uint8)]
        batch = fresh + fresh[:1]  # a duplicate in one call counts once
        for _ in range(2):  # with a doorkeeper, only the second sighting reaches the table
            many._add_many(batch)
            typed._add_typed(batch)
            assert np.array_equal(typed.table, many.table)
            assert typed._estimate_few(batch).tolist() == many._estimate_many(batch).tolist()
    assert many.table.sum() > 0


def test_the_doorkeeper_tells_apart_hashes_that_differ_only_in_the_lowest_bit():
    sk = CountMinSketch(width=64, doorkeeper=True)
    sk.add([_hash(2, 4)])
    assert sk.estimate_one(_hash(2, 4)) == 1 and sk.estimate_one(_hash(3, 5)) == 0
    assert sk.estimate([_hash(3, 5)] * 6).tolist() == [0] * 6


@pytest.mark.parametrize("path", ["_add_many", "_add_typed"])
def test_a_hash_sharing_one_doorkeeper_probe_with_a_known_one_is_not_known(path):
    sk = CountMinSketch(width=64, depth=2, doorkeeper=True)
    add = getattr(sk, path)
    add([_hash(2, 4)])
    assert sk.estimate_one(_hash(2, 6)) == 0 and sk.estimate([_hash(2, 6)] * 6).tolist() == [0] * 6
    add([_hash(2, 6)])                  # its first sighting: the doorkeeper only
    assert sk.table.sum() == 0
    add([_hash(2, 6)])                  # its second: counted
    assert sk.table.sum() == 2 and sk.estimate_one(_hash(2, 6)) == 2


def test_the_doorkeeper_mask_is_one_the_typed_loops_take_unsigned():
    assert CountMinSketch(width=64)._door_mask >= 0
    assert CountMinSketch(width=64, doorkeeper=True)._door_mask == 64 * 8 - 1


def test_the_typed_paths_epoch_wrapping_past_32_bits_starts_over_and_counts_each_sighting_once():
    sk = CountMinSketch(width=64)
    h = hashes(0, 3)
    sk._add_typed(h)
    sk._epoch = 0xFFFFFFFF  # the next call's epoch no longer fits the uint32 stamps
    sk._add_typed(h)
    assert sk._epoch == 1 and [sk.estimate_one(x) for x in h] == [2, 2, 2]
    sk._add_typed(h)
    assert [sk.estimate_one(x) for x in h] == [3, 3, 3]


def test_placement_edges_hot_at_the_fourth_sighting_and_at_exactly_the_pin_bound():
    assert placement(3, 100, bar=2, pin_max_bytes=1000) is Placement.DRAM
    assert placement(4, 1000, bar=2, pin_max_bytes=1000) is Placement.PINNED
    assert placement(4, 1001, bar=2, pin_max_bytes=1000) is Placement.DRAM
    assert placement(5, 100, bar=5, pin_max_bytes=1000) is Placement.PINNED   # hot only once past the bar


def test_the_default_admission_needs_two_sightings_and_keeps_first_ones_in_a_doorkeeper():
    adm = FrequencyFilter()
    once, twice = hashes(0, 1), hashes(900, 1)
    adm.sight(once)
    assert adm.sketch.door is not None and adm.sketch.table.sum() == 0
    adm.sight(twice)
    adm.sight(twice)
    assert adm.bar == 2 and adm.frequency(twice[0]) == 2
    assert not adm.duel(once[0]) and adm.duel(twice[0])
    lenient = FrequencyFilter(min_sightings=1, sketch=CountMinSketch(width=1024, doorkeeper=True))
    lenient.sight(once)
    assert lenient.duel(once[0]) and (lenient.admits, lenient.rejects) == (1, 0)


def test_the_thrash_ratio_is_a_fraction_of_what_lru_would_match():
    assert 0 < THRASH_RATIO <= 1


def test_a_queue_of_one_holds_the_most_valuable_and_a_queue_of_none_is_refused():
    q: StoreQueue[str] = StoreQueue(1)
    assert q.push(1.0, "a") is None and len(q) == 1
    assert q.push(2.0, "b") == "a" and q.items() == ["b"]
    for bad in (0, -1):
        with pytest.raises(ValueError, match="capacity"):
            StoreQueue(bad)


@pytest.mark.parametrize("value", [3.0, -3.0])
def test_a_full_queue_of_equal_values_drops_the_newcomer(value):
    q: StoreQueue[str] = StoreQueue(2)
    q.push(value, "a")
    q.push(value, "b")
    assert q.push(value, "c") == "c" and q.drops == 1
    assert [q.pop(), q.pop()] == ["a", "b"]


def test_queue_items_are_least_valuable_first_and_remove_if_counts_what_it_removed():
    q: StoreQueue[str] = StoreQueue(5)
    for value, item in ((5.0, "a"), (1.0, "b"), (9.0, "c"), (1.0, "d")):
        q.push(value, item)
    assert len(q) == 4 and q.items() == ["d", "b", "a", "c"]
    assert q.remove_if(lambda item: item in ("b", "c", "x")) == 2
    assert len(q) == 2 and q.items() == ["d", "a"]
    assert q.remove_if(lambda item: False) == 0 and [q.pop(), q.pop(), q.pop()] == ["a", "d", None]


def test_a_full_queue_keeps_arrival_order_among_equal_values_it_lets_in():
    # "x" is the least valuable and goes; "a" and "b" tie, and the older one comes out first
    # (arrival order, not the items' own order, whichever way that sorts).
    for first, second in (("a", "b"), ("b", "a")):
        q: StoreQueue[str] = StoreQueue(2)
        assert q.push(1.0, "x") is None and q.push(5.0, first) is None
        assert q.push(5.0, second) == "x"
        assert [q.pop(), q.pop(), q.pop()] == [first, second, None]
