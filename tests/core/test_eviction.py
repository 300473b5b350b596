"""The eviction policy's pure parts: decayed frequency, the duel rule, the shadow LRU and the
window tuners."""
from __future__ import annotations

import math

import pytest

from kvtier.eviction import (
    DecayedFrequencyPolicy,
    FrequencyState,
    GhostTuner,
    HillClimber,
    MAIN,
    WINDOW,
    LruReferenceTuner,
    PolicyConfig,
    ShadowLru,
    admits,
)


def test_frequency_halves_every_half_life():
    p = DecayedFrequencyPolicy(half_life_s=10.0)
    s = FrequencyState()
    for _ in range(8):
        p.touch(s, 100.0)
    assert p.frequency(s, 100.0) == 8.0
    assert math.isclose(p.frequency(s, 110.0), 4.0)
    assert math.isclose(p.frequency(s, 130.0), 1.0)


def test_score_order_is_the_same_at_every_instant():
    p = DecayedFrequencyPolicy(half_life_s=10.0)
    often_long_ago, once_recently = FrequencyState(), FrequencyState()
    for _ in range(8):
        p.touch(often_long_ago, 0.0)
    p.touch(once_recently, 25.0)
    # 8 hits 2.5 half-lives ago ~ 1.41 now, above one hit now.
    for now in (25.0, 40.0, 1000.0):
        assert (p.frequency(often_long_ago, now) > p.frequency(once_recently, now)) == \
               (p.score(often_long_ago) > p.score(once_recently))
    p.touch(once_recently, 26.0)  # two recent hits overtake
    assert p.score(once_recently) > p.score(often_long_ago)


def test_untouched_state_sorts_first():
    p = DecayedFrequencyPolicy()
    touched = FrequencyState()
    p.touch(touched, 0.0)
    assert p.score(FrequencyState()) < p.score(touched)


@pytest.mark.parametrize("bad", [0, -1.0])
def test_half_life_must_be_positive(bad):
    with pytest.raises(ValueError, match="half_life_s"):
        DecayedFrequencyPolicy(bad)


def test_the_duel_needs_min_sightings_and_at_least_the_victims_frequency():
    assert admits(2, 1.5, min_sightings=2)
    assert admits(3, 3.0, min_sightings=2)          # a tie goes to the newcomer (recency)
    assert not admits(3, 3.2, min_sightings=2)
    assert not admits(1, 0.0, min_sightings=2)      # one sighting never displaces anything


def test_shadow_lru_matches_prefixes_caps_at_the_limit_and_evicts_tails_first():
    lru = ShadowLru(4)
    assert lru.access(["a", "b", "c"], limit=3) == 0
    assert lru.access(["a", "b", "c"], limit=2) == 2          # the last-token rule's cap
    assert lru.access(["x", "y"], limit=2) == 0               # 5 blocks: c, the oldest tail, goes
    assert lru.access(["a", "b", "c"], limit=3) == 2


def test_reference_tuner_starts_as_lru_shrinks_while_ahead_and_retreats_twice_as_fast_while_behind():
    t = LruReferenceTuner(100, window_fraction=1.0)
    assert t.window_target == 100.0
    moved = [t.record([f"h{i}"], limit=1, matched=0) for i in range(100)]   # filling: LRU evicts nothing
    assert not any(moved) and t.window_target == 100.0                      # a sample with room says nothing
    moved = [t.record([f"g{i}"], limit=1, matched=0) for i in range(100)]   # LRU misses and evicts: level
    assert moved[-1] and not any(moved[:-1])                                # one move per sample
    assert t.window_target == 100.0 - t.step                                # level at LRU explores: a step down
    for i in range(100):                                                    # level below a whole-cache window
        t.record([f"k{i}"], limit=1, matched=0)
    assert t.window_target == 100.0 - t.step                                # holds: a tie says nothing
    for i in range(100 * 2):                                                # we hit what LRU misses: ahead
        t.record([f"new{i}"], limit=1, matched=1)
    assert t.window_target == 100.0 - 3 * t.step
    for i in range(50):                                                     # LRU hits, we miss: behind
        t.record(["same", f"x{i}"], limit=2, matched=0)
    assert t.window_target == 100.0 - t.step                                # two steps back up
    for i in range(100 * 20):
        t.record([f"more{i}"], limit=1, matched=1)
    assert t.window_target == 0.0


def test_window_target_stays_within_the_capacity():
    t = LruReferenceTuner(10, window_fraction=1.0)
    for i in range(200):
        t.record(["k", f"new{i}"], limit=2, matched=0)      # always behind, LRU evicting
    assert t.window_target == 10.0


def test_hill_climber_keeps_direction_on_improvement_and_turns_on_loss():
    c = HillClimber(100, window_fraction=0.5, sample_factor=1.0)
    c.record(100, 10)                     # first sample: moves up
    up = c.window_target
    assert up > 50
    c.record(100, 20)                     # better: same direction
    assert c.window_target > up
    higher = c.window_target
    c.record(100, 12)                     # worse: turn around
    assert c.window_target < higher


@pytest.mark.parametrize("kw", [dict(window_fraction=1.5), dict(window_fraction=-0.1), dict(adapt="sometimes")])
def test_policy_config_rejects_bad_values(kw):
    with pytest.raises(ValueError):
        PolicyConfig(**kw)


def test_arc_ghost_tuner_grows_the_window_on_its_ghost_hits_and_shrinks_it_on_mains():
    t = GhostTuner(100, window_fraction=0.5)
    t.evicted(WINDOW, ["w1", "w2"])
    t.evicted(MAIN, ["m1"])
    assert t.missed(["w1", "w2", "x"])            # two blocks a larger window would have kept
    grown = t.window_target
    assert grown > 50 and "w1" not in t.ghosts[WINDOW]
    assert t.missed(["m1"]) and t.window_target < grown
    assert not t.missed(["never-seen", "w1"])     # only the run right after the cached prefix counts


def test_arc_ghost_lists_hold_only_what_their_region_could_have_gained():
    t = GhostTuner(10, window_fraction=0.8)       # the window could gain 2 blocks, main 8
    t.evicted(WINDOW, [f"w{i}" for i in range(5)])
    t.evicted(MAIN, [f"m{i}" for i in range(12)])
    assert list(t.ghosts[WINDOW]) == ["w3", "w4"]
    assert len(t.ghosts[MAIN]) == 8 and "m11" in t.ghosts[MAIN]


def test_symmetric_reference_tuner_holds_when_level_and_steps_once_either_way():
    t = LruReferenceTuner(100, window_fraction=0.5, symmetric=True)
    for i in range(200):
        t.record([f"h{i}"], limit=1, matched=0)                 # filling, then level
    assert t.window_target == 50.0
    for i in range(50):
        t.record(["same", f"x{i}"], limit=2, matched=0)         # behind: one step up
    assert t.window_target == 50.0 + t.step
    for i in range(100):
        t.record([f"new{i}"], limit=1, matched=1)               # ahead: one step down
    assert t.window_target == 50.0
