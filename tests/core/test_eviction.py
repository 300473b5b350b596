"""The eviction policy's pure parts: decayed frequency, the duel rule, the shadow LRU, the
miniature simulations and the window tuners."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.eviction import (
    DecayedFrequencyPolicy,
    FrequencyState,
    MAIN,
    WINDOW,
    MINI_SAMPLE_BITS,
    MiniatureCache,
    MiniatureTuner,
    EvictionConfig,
    SHADOW_SAMPLED_SLOTS,
    ShadowLru,
    WindowTuner,
    adaptations,
    admits,
    make_tuner,
)
from kvtier.sim.tuners import ADAPTATIONS, GhostTuner, HillClimber, LruReferenceTuner


def test_frequency_halves_every_half_life():
    p = DecayedFrequencyPolicy(half_life_s=10.0)
    s = FrequencyState()
    for _ in range(8):
        p.touch(s, 100.0)
    assert p.frequency(s, 100.0) == 8.0
    assert math.isclose(p.frequency(s, 110.0), 4.0)
    assert math.isclose(p.frequency(s, 130.0), 1.0)


@pytest.mark.parametrize("bad", [0, -1.0])
def test_half_life_must_be_positive(bad):
    with pytest.raises(ValueError, match="half_life_s"):
        DecayedFrequencyPolicy(bad)


def test_the_duel_needs_min_sightings():
    assert admits(2, min_sightings=2)
    assert admits(9, min_sightings=2)
    assert not admits(1, min_sightings=2)      # one sighting never displaces anything
    assert not admits(2, min_sightings=3)


def test_shadow_lru_matches_prefixes_caps_at_the_limit_and_evicts_tails_first():
    lru = ShadowLru(4)
    assert lru.access(["a", "b", "c"], limit=3) == 0
    assert lru.access(["a", "b", "c"], limit=2) == 2          # the last-token rule's cap
    assert lru.access(["x", "y"], limit=2) == 0               # 5 blocks: c, the oldest tail, goes
    assert lru.access(["a", "b", "c"], limit=3) == 2


def test_reference_tuner_starts_as_lru_shrinks_while_ahead_and_retreats_twice_as_fast_while_behind():
    t = LruReferenceTuner(100, window_fraction=1.0)
    assert t.window_target == 100.0
    moved = [t.on_lookup([f"h{i}"], limit=1, matched=0, cached=0) for i in range(100)]  # filling: LRU evicts nothing
    assert not any(moved) and t.window_target == 100.0                      # a sample with room says nothing
    moved = [t.on_lookup([f"g{i}"], limit=1, matched=0, cached=0) for i in range(100)]  # LRU misses and evicts: level
    assert moved[-1] and not any(moved[:-1])                                # one move per sample
    assert t.window_target == 100.0 - t.step                                # level at LRU explores: a step down
    for i in range(100):                                                    # level below a whole-cache window
        t.on_lookup([f"k{i}"], limit=1, matched=0, cached=0)
    assert t.window_target == 100.0 - t.step                                # holds: a tie says nothing
    for i in range(100 * 2):                                                # we hit what LRU misses: ahead
        t.on_lookup([f"new{i}"], limit=1, matched=1, cached=0)
    assert t.window_target == 100.0 - 3 * t.step
    for i in range(50):                                                     # LRU hits, we miss: behind
        t.on_lookup(["same", f"x{i}"], limit=2, matched=0, cached=0)
    assert t.window_target == 100.0 - t.step                                # two steps back up
    for i in range(100 * 20):
        t.on_lookup([f"more{i}"], limit=1, matched=1, cached=0)
    assert t.window_target == 0.0


def test_window_target_stays_within_the_capacity():
    t = LruReferenceTuner(10, window_fraction=1.0)
    for i in range(200):
        t.on_lookup(["k", f"new{i}"], limit=2, matched=0, cached=0)  # always behind, LRU evicting
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
        EvictionConfig(**kw)


def test_an_unknown_adapt_is_refused_naming_the_registered_tuners():
    with pytest.raises(ValueError, match=r"adapt must be one of mini, off.*got 'sometimes'"):
        EvictionConfig(adapt="sometimes")


def test_the_core_ships_only_the_tuners_production_selects():
    code = ("import sys, kvtier.cache, kvtier.eviction as e; "
            "print(e.adaptations(), any(m.startswith('kvtier.sim') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["('mini',", "'off')", "False"]


def test_the_simulator_registers_its_ablation_tuners_with_the_core():
    assert set(ADAPTATIONS) == set(adaptations())
    for adapt in ADAPTATIONS:
        tuner = make_tuner(EvictionConfig(window_fraction=0.5, adapt=adapt), 100, 2)
        assert isinstance(tuner, WindowTuner) and tuner.window_target == 50.0


def test_the_cache_drives_its_tuner_only_through_the_interface():
    source = (Path(__file__).resolve().parents[2] / "kvtier" / "cache.py").read_text()
    assert ".adapt" not in source                  # chosen once, by make_tuner
    for name in ("MiniatureTuner", "LruReferenceTuner", "HillClimber", "GhostTuner"):
        assert name not in source


def test_arc_ghost_tuner_grows_the_window_on_its_ghost_hits_and_shrinks_it_on_mains():
    t = GhostTuner(100, window_fraction=0.5)
    t.on_evict(WINDOW, ["w1", "w2"])
    t.on_evict(MAIN, ["m1"])
    assert t.missed(["w1", "w2", "x"])            # two blocks a larger window would have kept
    grown = t.window_target
    assert grown > 50 and "w1" not in t.ghosts[WINDOW]
    assert t.missed(["m1"]) and t.window_target < grown
    assert not t.missed(["never-seen", "w1"])     # only the run right after the cached prefix counts


def test_arc_ghost_lists_hold_only_what_their_region_could_have_gained():
    t = GhostTuner(10, window_fraction=0.8)       # the window could gain 2 blocks, main 8
    t.on_evict(WINDOW, [f"w{i}" for i in range(5)])
    t.on_evict(MAIN, [f"m{i}" for i in range(12)])
    assert list(t.ghosts[WINDOW]) == ["w3", "w4"]
    assert len(t.ghosts[MAIN]) == 8 and "m11" in t.ghosts[MAIN]


def test_symmetric_reference_tuner_holds_when_level_and_steps_once_either_way():
    t = LruReferenceTuner(100, window_fraction=0.5, symmetric=True)
    for i in range(200):
        t.on_lookup([f"h{i}"], limit=1, matched=0, cached=0)    # filling, then level
    assert t.window_target == 50.0
    for i in range(50):
        t.on_lookup(["same", f"x{i}"], limit=2, matched=0, cached=0)  # behind: one step up
    assert t.window_target == 50.0 + t.step
    for i in range(100):
        t.on_lookup([f"new{i}"], limit=1, matched=1, cached=0)  # ahead: one step down
    assert t.window_target == 50.0


def _sampled(*ids: int) -> list[bytes]:
    """Block hashes the miniatures sample (low bits of the first byte zero)."""
    return [bytes([(i << MINI_SAMPLE_BITS) & 0xFF]) + i.to_bytes(8, "little") for i in ids]


def _unsampled(*ids: int) -> list[bytes]:
    return [b"\x01" + i.to_bytes(8, "little") for i in ids]


def test_a_miniature_keeps_its_shares_and_takes_a_block_into_main_on_its_second_sighting():
    m, counts = MiniatureCache(10, 0.2), {}        # window 2, main 8

    def serve(*ids: int) -> None:
        blocks = _sampled(*ids)
        for h in blocks:
            counts[h] = counts.get(h, 0) + 1
        m.serve(blocks, counts, 2)

    for i in range(10):
        serve(i)                                   # free space in main is never refused
    assert len(m.window) == 2 and list(m.main) == _sampled(*range(8))
    for i in (100, 101, 102):
        serve(i)                                   # one-shot newcomers never displace main
    assert list(m.main) == _sampled(*range(8)) and len(m.window) == 2
    serve(200)
    serve(200)                                     # seen twice, then pushed out of the window
    serve(201)
    serve(202)
    assert _sampled(200)[0] in m.main and _sampled(0)[0] not in m.main   # main's LRU block paid
    assert len(m.main) == 8


def test_a_miniature_counts_hits_only_along_the_prompts_cached_prefix():
    m, counts = MiniatureCache(10, 1.0), {}
    for ids in ((1, 2), (1, 2), (9, 1, 2)):
        m.serve(_sampled(*ids), counts, 2)
    assert m.hits == 2                             # the second prompt: 2; the third breaks at 9


def _run(t: MiniatureTuner, requests) -> None:
    for blocks in requests:
        t.on_lookup(blocks, limit=len(blocks), matched=0, cached=0)


def test_the_miniature_tuner_starts_as_lru_and_stays_there_while_its_miniatures_tie():
    t = MiniatureTuner(400, min_sightings=2)
    assert t.window_target == 400.0
    _run(t, [_unsampled(i, i + 1) for i in range(2_000)])          # nothing sampled
    _run(t, [_sampled(10_000 + i) for i in range(2_000)])          # every miniature misses alike
    assert t.window_target == 400.0 and t.adjustments > 0


def test_the_miniature_tuner_takes_a_small_window_under_a_scan_and_returns_to_lru_after_it():
    t = MiniatureTuner(400, min_sightings=2)                       # miniatures of 100 slots
    hot = 60                                                       # fits main, not LRU under the scan
    scan = [_sampled(i % hot) + _sampled(1_000 + i) for i in range(20_000)]
    _run(t, scan)
    assert t.window_target <= 0.25 * 400                           # frequency admission pays
    reuse = [_sampled(100_000 + i // 2) for i in range(40_000)]    # each block asked twice in a row
    _run(t, reuse)
    assert t.window_target == 400.0                                # every window hits alike: LRU


def test_the_miniature_tuner_needs_the_whole_cache_window_among_its_choices():
    with pytest.raises(ValueError, match="whole-cache"):
        MiniatureTuner(100, min_sightings=2, windows=(0.01, 0.5))


def test_the_miniatures_choose_the_same_whether_they_catch_up_at_each_lookup_or_at_the_sample_end():
    eager, lazy = MiniatureTuner(400, min_sightings=2), MiniatureTuner(400, min_sightings=2)
    requests = [_sampled(i % 60) + _sampled(1_000 + i) + _unsampled(i) for i in range(6_000)]
    targets = []
    for blocks in requests:
        eager.on_lookup(blocks, limit=len(blocks), matched=0, cached=0)
        eager.catch_up()                                   # as a release after every lookup does
        lazy.on_lookup(blocks, limit=len(blocks), matched=0, cached=0)  # replayed only when a sample ends
        assert round(eager.window_target) == round(lazy.window_target)   # the same share chosen
        targets.append(round(lazy.window_target))
    assert min(targets) < 400                              # the choice did move
    assert any(m.hits for m in eager.minis) and not any(m.hits for m in lazy.minis)  # lazy: still queued
    lazy.catch_up()
    assert [m.hits for m in eager.minis] == [m.hits for m in lazy.minis]


def _conversations(seed: int, n: int, hash_of) -> list[list[bytes]]:
    """Prompts that share prefixes as traffic does: each one a random earlier prompt's
    first blocks (or nothing) plus new blocks; block ids chain, so equal ids mean an
    equal prefix. `hash_of` turns a block id into its hash."""
    import random
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    next_id = 0
    for _ in range(n):
        base = rng.choice(prompts[-300:])[:rng.randint(0, 30)] if prompts and rng.random() < 0.8 else []
        new = list(range(next_id, next_id + rng.randint(1, 12)))
        next_id += len(new)
        prompts.append(base + new)
    return [[hash_of(i) for i in p] for p in prompts]


class _NaiveLru:
    """ShadowLru as first written: check every block, tail first."""

    def __init__(self, capacity: int) -> None:
        from collections import OrderedDict
        self.capacity, self.blocks = capacity, OrderedDict()

    def access(self, hashes: list, limit: int) -> int:
        hit = 0
        for h in hashes:
            if h not in self.blocks:
                break
            hit += 1
        for h in reversed(hashes):
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                self.blocks[h] = None
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return min(hit, limit)


@pytest.mark.parametrize("seed", range(3))
def test_the_shadow_lru_serves_exactly_like_checking_every_block(seed):
    fast, naive = ShadowLru(60), _NaiveLru(60)
    for hashes in _conversations(seed, 3_000, lambda i: i.to_bytes(16, "little")):
        limit = max(0, len(hashes) - 1)
        assert fast.access(hashes, limit) == naive.access(hashes, limit)
    assert list(fast._blocks) == list(naive.blocks) and fast.evictions > 0


def test_a_large_caches_thrash_gauge_samples_and_agrees_with_an_exact_lru():
    import hashlib
    slots = SHADOW_SAMPLED_SLOTS                           # the gauge samples from here on
    t, exact = MiniatureTuner(slots, min_sightings=2), ShadowLru(slots)
    assert t.shadow.capacity == slots >> MINI_SAMPLE_BITS
    prompts = _conversations(0, 40_000, lambda i: hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest())
    for hashes in prompts:
        t.on_lookup(hashes, len(hashes) - 1, exact.access(hashes, len(hashes) - 1), cached=0)  # a cache that is LRU
    assert t.adjustments > 0 and t.last_lru > 100 and exact.evictions > 0
    assert 0.9 * t.last_lru <= t.last_ours <= 1.1 * t.last_lru  # the sampled estimate of the same LRU
    samples, recent = t.adjustments, prompts[-300:]
    for i in range(10_000):                                # a whole sample of a cache matching nothing ...
        t.on_lookup(recent[i % 300], len(recent[i % 300]) - 1, 0, cached=0)
    assert t.adjustments >= samples + 2
    assert t.last_ours == 0 < t.last_lru                   # ... reads as far behind LRU
