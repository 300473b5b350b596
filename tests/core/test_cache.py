"""LocalCache: the engine-facing API, W-TinyLFU admission and eviction, placement, the arena."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

import kvtier.cache as cache_mod
from kvtier.cache import MAX_TENANT_COUNTERS, Hit, LocalCache, Miss
from kvtier.eviction import EvictionConfig
from kvtier.keys import KeyRoot
from kvtier.sim.tuners import CAFFEINE_WINDOW_FRACTION

B = 16
BB = 64  # bytes per block: small, so payloads are cheap to check
ROOT = KeyRoot("acme", "m", "w1", "fp16", "rope", "flash")
OTHER_TENANT = KeyRoot("globex", "m", "w1", "fp16", "rope", "flash")


SMALL_WINDOW = EvictionConfig(window_fraction=CAFFEINE_WINDOW_FRACTION, adapt="off")
"""W-TinyLFU with Caffeine's 1% window and no tuner: the duel decides every eviction
(the shipped policy starts as LRU and moves there only while it keeps up)."""


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(blocks: int = 64, **kw) -> LocalCache:
    kw.setdefault("drain_budget_s", 0)
    return LocalCache(blocks * BB, BB, block_size=B, **kw)


def kv(tokens: np.ndarray, salt: int = 0) -> np.ndarray:
    """One BB-byte block per full block, each filled with a value naming the block."""
    n = len(tokens) // B
    out = np.empty((n, BB), dtype=np.uint8)
    for i in range(n):
        out[i] = (int(tokens[(i + 1) * B - 1]) + 7 * i + salt) % 251
    return out


def warm(cache: LocalCache, root: KeyRoot, tokens: np.ndarray, salt: int = 0) -> None:
    """`bar` sightings then a store, as that many requests of an engine would do."""
    for _ in range(cache._admission.bar):
        cache.release(cache.lookup(root, tokens))
    cache.store(root, tokens, kv(tokens, salt))
    cache.flush()


def read(cache: LocalCache, hit: Hit) -> np.ndarray:
    dst = np.zeros(len(hit.blocks) * BB, dtype=np.uint8)
    cache.materialize(hit, dst)
    return dst.reshape(-1, BB)


def test_full_prompt_hit_gives_back_its_last_block():
    c = make()
    t = np.arange(64, dtype=np.uint32)
    warm(c, ROOT, t)
    hit = c.lookup(ROOT, t)
    assert hit.matched_tokens == 48  # 4 blocks cached, one given back so logits exist
    c.release(hit)
    longer = np.arange(65, dtype=np.uint32)
    hit = c.lookup(ROOT, longer)
    assert hit.matched_tokens == 64
    c.release(hit)
    hit = c.lookup(ROOT, t, allow_full=True)
    assert hit.matched_tokens == 64
    c.release(hit)


def test_hit_is_block_aligned_1507_token_prompt_matches_1504():
    c = make(200)
    warm(c, ROOT, np.arange(2000, dtype=np.uint32))
    hit = c.lookup(ROOT, np.arange(1507))
    assert hit.matched_tokens == 1504 and len(hit.blocks) == 94
    c.release(hit)


def test_materialize_returns_exactly_the_stored_blocks():
    c = make()
    t = np.arange(100, dtype=np.uint32)
    warm(c, ROOT, t)
    hit = c.lookup(ROOT, t)
    assert np.array_equal(read(c, hit), kv(t)[:len(hit.blocks)])


def test_free_space_takes_every_store_from_the_first_sighting():
    c = make()
    t = np.arange(64, dtype=np.uint32)
    assert not c.lookup(ROOT, t)                     # sighting 1: a miss ...
    assert c.store(ROOT, t, kv(t)) is True           # ... stored at once: slots are free
    c.flush()
    assert c.lookup(ROOT, t).matched_tokens == 48    # the next turn hits
    s = c.stats()
    assert s.evictions == 0 and s.admission_rejects == 0 and s.window_blocks == 4


def test_a_one_shot_stream_through_a_full_cache_never_displaces_a_reused_prefix():
    clock = Clock()
    c = make(blocks=16, clock=clock, policy=SMALL_WINDOW)
    system = np.arange(64, dtype=np.uint32)
    for _ in range(6):                               # reused: hit on every request
        c.release(c.lookup(ROOT, np.append(system, 0)))
        c.store(ROOT, system, kv(system))
        c.flush()
        clock.t += 1.0
    for d in range(40):                              # 40 one-shot 4-block documents
        doc = np.arange(10_000 + 64 * d, 10_064 + 64 * d, dtype=np.uint32)
        c.release(c.lookup(ROOT, doc))
        c.store(ROOT, doc, kv(doc))
        c.flush()
        clock.t += 1.0
    assert c.peek(ROOT, np.append(system, 0)) == 64
    s = c.stats()
    assert s.admission_rejects > 0 and s.evictions > 0 and s.blocks_used == 16


def test_a_one_shot_stream_that_evicts_a_lot_is_not_thrash_when_lru_would_do_no_better():
    c = make(blocks=8)
    for d in range(200):                             # every prompt new: no policy can hit
        doc = np.arange(10_000 + 64 * d, 10_064 + 64 * d, dtype=np.uint32)
        c.release(c.lookup(ROOT, doc))
        c.store(ROOT, doc, kv(doc))
        c.flush()
    s = c.stats()
    assert s.evictions > 100 and s.lookups == 200
    assert not s.thrashing and s.thrash_events == 0


def test_min_sightings_is_the_least_a_newcomer_needs_to_displace_anything():
    for min_sightings, wins in ((3, False), (2, True)):
        clock = Clock()
        c = make(blocks=4, clock=clock, min_sightings=min_sightings, policy=SMALL_WINDOW)
        old = np.arange(64, dtype=np.uint32)
        c.store(ROOT, old, kv(old))
        c.flush()
        clock.t += 100 * 3600                        # the old prefix's hits have decayed away
        new = np.arange(5000, 5064, dtype=np.uint32)
        c.lookup(ROOT, new)
        c.lookup(ROOT, new)                          # seen twice
        c.store(ROOT, new, kv(new))
        c.flush()
        assert (c.peek(ROOT, np.append(new, 0)) == 64) is wins


def test_released_blocks_stay_hittable_until_their_slots_are_reused():
    clock = Clock()
    c = make(blocks=4, clock=clock)
    a = np.arange(80, dtype=np.uint32)        # 5 full blocks: 4 fit
    warm(c, ROOT, a[:64])
    for _ in range(3):                        # released, no pressure: still hittable
        hit = c.lookup(ROOT, a)
        assert hit.matched_tokens == 64
        c.release(hit)
    clock.t += 3600                           # an hour unseen: A's frequency has decayed
    b = np.arange(5000, 5064, dtype=np.uint32)
    warm(c, ROOT, b)                          # needs the slots (seen twice): now A's are reused
    assert c.lookup(ROOT, a).matched_tokens == 0
    assert c.stats().evictions == 4


def _reused_prefix_filling(blocks: int) -> tuple[LocalCache, np.ndarray]:
    c = make(blocks=blocks, policy=SMALL_WINDOW)
    a = np.arange(80, dtype=np.uint32)
    warm(c, ROOT, a[:64])
    for _ in range(5):
        c.release(c.lookup(ROOT, a))
    return c, a


def test_under_a_small_window_a_newcomer_needs_a_second_sighting_to_evict_a_reused_prefix():
    c, a = _reused_prefix_filling(4)
    b = np.arange(5000, 5064, dtype=np.uint32)
    assert c.lookup(ROOT, b).matched_tokens == 0   # one sighting: below the duel's bar
    assert c.reserve(ROOT, b) is None
    assert c.peek(ROOT, a) == 64 and c.stats().evictions == 0
    c.release(c.lookup(ROOT, b))                   # the second sighting: main takes it, LRU's way
    res = c.reserve(ROOT, b)
    assert res is not None and res.num_blocks == 4 and c.peek(ROOT, a) == 0


def test_a_forced_warm_up_store_evicts_by_policy_whatever_its_sightings():
    c, a = _reused_prefix_filling(4)
    res = c.reserve(ROOT, np.arange(5000, 5064, dtype=np.uint32), force=True)
    assert res.num_blocks == 4 and c.peek(ROOT, a) == 0
    c.abort(res)


def test_pinned_hit_survives_pressure_and_keeps_its_bytes():
    c = make(blocks=4)
    a = np.arange(80, dtype=np.uint32)
    warm(c, ROOT, a[:64])
    hit = c.lookup(ROOT, a)
    before = read(c, hit).copy()
    warm(c, ROOT, np.arange(5000, 5064, dtype=np.uint32))  # no free slot: store gives up
    assert np.array_equal(read(c, hit), before)
    assert c.stats().evictions == 0
    c.release(hit)


def test_materialize_copies_each_contiguous_run_once(monkeypatch):
    c = make(blocks=16)
    x = np.arange(5000, 5064, dtype=np.uint32)
    warm(c, ROOT, x)                                  # slots 0-3
    c.invalidate(lambda r: True)                      # free 0-3 again
    warm(c, ROOT, np.arange(7000, 7032, dtype=np.uint32))  # slots 0-1
    t = np.arange(128, dtype=np.uint32)
    warm(c, ROOT, t)                                  # 8 blocks: slots 2..9, one run
    hit = c.lookup(ROOT, np.arange(129, dtype=np.uint32))
    assert hit.blocks == list(range(2, 10))

    reads = []

    class Spy(np.ndarray):
        def __getitem__(self, key):
            reads.append(key)
            return np.ndarray.__getitem__(self, key)

    monkeypatch.setattr(c, "_arena", c._arena.view(Spy))
    data = read(c, hit)
    assert len(reads) == 1
    assert np.array_equal(data, kv(t))


def test_materialize_handles_fragmented_runs_in_order():
    c = make(blocks=8)
    warm(c, ROOT, np.arange(9000, 9032, dtype=np.uint32))      # slots 0-1
    warm(c, ROOT, np.arange(8000, 8016, dtype=np.uint32))      # slot 2
    c.invalidate(lambda r: True)
    warm(c, OTHER_TENANT, np.arange(9000, 9016, dtype=np.uint32))  # slot 0
    c.invalidate(lambda r: r.tenant == "acme")
    warm(c, OTHER_TENANT, np.arange(9100, 9116, dtype=np.uint32))  # slot 1
    t = np.arange(96, dtype=np.uint32)
    warm(c, ROOT, t)   # blocks land on slots 2..7 (sorted)
    hit = c.lookup(ROOT, np.arange(97))
    assert np.array_equal(read(c, hit), kv(t))


def test_a_forced_hash_collision_never_yields_wrong_kv(monkeypatch):
    monkeypatch.setattr(cache_mod, "chain_hashes",
                        lambda parent, tb, bs, first=0, num=None:
                        [b"\x00" * 16] * ((len(tb) // (4 * bs) - first) if num is None else num))
    c = make()
    a = np.arange(64, dtype=np.uint32)
    b = np.arange(64, dtype=np.uint32)[::-1].copy()
    for t, salt in ((a, 1), (b, 2)):
        res = c.reserve(ROOT, t, force=True)
        for i, off in enumerate(res.offsets):
            c.arena[off:off + BB] = kv(t, salt)[res.first_block + i]
        c.commit(res)
    for t, salt in ((a, 1), (b, 2)):
        hit = c.lookup(ROOT, np.append(t, 1))
        assert np.array_equal(read(c, hit), kv(t, salt))
        c.release(hit)
    assert not c.lookup(ROOT, np.arange(1, 65))


def test_other_tenants_never_hit_and_stats_are_per_tenant():
    c = make()
    t = np.arange(64, dtype=np.uint32)
    warm(c, ROOT, t)
    c.release(c.lookup(ROOT, t))
    assert not c.lookup(OTHER_TENANT, t)
    mine, theirs = c.stats("acme"), c.stats("globex")
    assert mine.hits == 1 and mine.bytes_used == 4 * BB and mine.tier_hits["dram"] == 1
    assert theirs.hits == 0 and theirs.lookups == 1 and theirs.bytes_used == 0
    assert c.stats().lookups == mine.lookups + theirs.lookups


def test_releasing_twice_or_materializing_after_release_is_a_value_error():
    c = make()
    t = np.arange(64, dtype=np.uint32)
    warm(c, ROOT, t)
    hit = c.lookup(ROOT, t)
    c.release(hit)
    with pytest.raises(ValueError, match="released"):
        c.release(hit)
    with pytest.raises(ValueError, match="released"):
        c.materialize(hit, bytearray(1024))
    c.release(Miss())  # releasing a miss is harmless


def test_hits_of_another_cache_are_rejected():
    a, b = make(), make()
    t = np.arange(64, dtype=np.uint32)
    warm(a, ROOT, t)
    with pytest.raises(ValueError, match="this cache"):
        b.release(a.lookup(ROOT, t))


@pytest.mark.parametrize("bad", [[-1] * 20, [2**32] * 20, [], [0.5] * 20])
def test_bad_token_ids_raise_and_change_nothing(bad):
    c = make()
    before = c.stats()
    with pytest.raises(ValueError):
        c.lookup(ROOT, bad)
    with pytest.raises(ValueError):
        c.store(ROOT, bad, b"")
    with pytest.raises(ValueError):
        c.reserve(ROOT, bad)
    assert c.stats() == before


def test_kv_blocks_of_the_wrong_size_raise_and_store_nothing():
    c = make()
    t = np.arange(64, dtype=np.uint32)
    c.lookup(ROOT, t)
    c.lookup(ROOT, t)
    with pytest.raises(ValueError, match="kv_blocks"):
        c.store(ROOT, t, np.zeros(3 * BB, dtype=np.uint8))
    with pytest.raises(ValueError, match="kv_blocks"):
        c.store(ROOT, t, None)
    c.flush()
    assert c.stats().blocks_used == 0 and c.stats().queue_depth == 0


def test_dst_too_small_is_a_value_error():
    c = make()
    t = np.arange(64, dtype=np.uint32)
    warm(c, ROOT, t)
    hit = c.lookup(ROOT, t)
    with pytest.raises(ValueError, match="dst"):
        c.materialize(hit, bytearray(BB))


@pytest.mark.parametrize("kw", [dict(capacity_bytes=0, block_bytes=64), dict(capacity_bytes=32, block_bytes=64),
                                dict(capacity_bytes=640, block_bytes=64, block_size=0),
                                dict(capacity_bytes=640, block_bytes=64, min_sightings=0)])
def test_bad_constructor_arguments_raise_value_error(kw):
    with pytest.raises(ValueError):
        LocalCache(**kw)


def test_store_queue_drops_its_least_valuable_entry():
    c = make(queue_capacity=2)
    short = np.arange(32, dtype=np.uint32)
    mid = np.arange(1000, 1064, dtype=np.uint32)
    long_ = np.arange(2000, 2128, dtype=np.uint32)
    for t in (mid, short, long_):
        c.lookup(ROOT, t)
        c.lookup(ROOT, t)
    assert c.store(ROOT, mid, kv(mid))
    assert c.store(ROOT, short, kv(short))
    assert c.store(ROOT, long_, kv(long_))   # queue full: `short` (least value) goes
    s = c.stats()
    assert s.queue_drops == 1 and s.queue_depth == 2
    c.flush()
    assert not c.lookup(ROOT, np.append(short, 0))
    assert c.lookup(ROOT, np.append(mid, 0)).matched_tokens == 64
    assert c.lookup(ROOT, np.append(long_, 0)).matched_tokens == 128


def test_small_hot_prefix_is_promoted_to_the_pinned_tier():
    c = make(blocks=200, policy=SMALL_WINDOW)
    system = np.arange(32, dtype=np.uint32)   # 2 blocks = 1% of capacity: small
    warm(c, ROOT, system)
    tiers = []
    for _ in range(5):
        hit = c.lookup(ROOT, np.append(system, 5))
        tiers.append(hit.tier)
        c.release(hit)
    assert tiers[0] == "dram" and tiers[-1] == "pinned"
    s = c.stats()
    assert s.pinned_bytes == 2 * BB and s.tier_hits["pinned"] >= 1


def test_the_shipped_policy_starts_as_lru_with_no_pinned_tier_until_the_tuner_opens_a_main_region():
    c = make(blocks=200)
    assert c.pinned_budget_blocks == 0
    system = np.arange(32, dtype=np.uint32)
    warm(c, ROOT, system)
    for _ in range(5):
        hit = c.lookup(ROOT, np.append(system, 5))
        assert hit.tier == "dram"
        c.release(hit)
    assert c.stats().pinned_bytes == 0


def test_large_hot_prefix_stays_in_dram():
    c = make(blocks=200)
    doc = np.arange(16 * 40, dtype=np.uint32)  # 40 blocks = 20% of capacity: not small
    warm(c, ROOT, doc)
    for _ in range(10):
        hit = c.lookup(ROOT, np.append(doc, 1))
        assert hit.tier == "dram"
        c.release(hit)


def test_pinned_tier_is_evicted_after_dram():
    system = np.arange(16, dtype=np.uint32)
    c2 = make(blocks=8, pin_max_bytes=BB, pinned_fraction=0.5, policy=SMALL_WINDOW)
    warm(c2, ROOT, system)
    for _ in range(5):
        c2.release(c2.lookup(ROOT, np.append(system, 1)))
    assert c2.lookup(ROOT, np.append(system, 1)).tier == "pinned"
    c2.release(c2.lookup(ROOT, np.append(system, 1)))
    other = np.arange(500, 500 + 16 * 7, dtype=np.uint32)
    warm(c2, ROOT, other)      # fills the remaining 7 slots
    more = np.arange(900, 916, dtype=np.uint32)
    warm(c2, ROOT, more)       # must evict: takes a DRAM block, not the pinned one
    assert c2.lookup(ROOT, np.append(system, 1)).matched_tokens == 16


def test_two_phase_store_commit_and_abort():
    c = make(blocks=16)
    t = np.arange(64, dtype=np.uint32)
    res = c.reserve(ROOT, t, force=True)
    assert res.first_block == 0 and res.num_blocks == 4
    assert res.offsets == [c.block_offset(s) for s in res.slots]
    assert not c.lookup(ROOT, np.append(t, 0))   # invisible until committed
    for i, off in enumerate(res.offsets):
        c.arena[off:off + BB] = kv(t)[i]
    assert c.commit(res) == 4
    hit = c.lookup(ROOT, np.append(t, 0))
    assert np.array_equal(read(c, hit), kv(t))
    c.release(hit)
    with pytest.raises(ValueError, match="already"):
        c.commit(res)
    longer = np.arange(96, dtype=np.uint32)
    res2 = c.reserve(ROOT, longer, force=True)
    assert res2.first_block == 4 and res2.num_blocks == 2
    c.abort(res2)
    assert c.stats().reserved_blocks == 0 and c._pool.free_count == 12


def test_reserve_takes_free_space_and_only_a_forced_one_overrides_the_duel():
    clock = Clock()
    c = make(blocks=4, clock=clock, policy=SMALL_WINDOW)
    t = np.arange(64, dtype=np.uint32)
    res = c.reserve(ROOT, t)                          # free space: never refused
    assert res is not None and res.num_blocks == 4
    c.commit(res)
    for _ in range(5):
        c.release(c.lookup(ROOT, np.append(t, 0)))    # hit: it is worth keeping
    newcomer = np.arange(5000, 5064, dtype=np.uint32)
    assert c.reserve(ROOT, newcomer) is None          # seen once: loses to the hit prefix
    res = c.reserve(ROOT, newcomer, force=True)       # a warm-up takes what policy gives
    assert res is not None and res.num_blocks == 4
    c.abort(res)


def test_racing_reservations_for_one_prompt_store_it_once():
    c = make(blocks=16)
    t = np.arange(64, dtype=np.uint32)
    r1, r2 = c.reserve(ROOT, t, force=True), c.reserve(ROOT, t, force=True)
    assert c.commit(r1) == 4
    assert c.commit(r2) == 0
    assert c.stats().blocks_used == 4 and c._pool.free_count == 12


def test_invalidate_drops_the_roots_and_cancels_pending_work():
    c = make(blocks=32)
    v1, v2 = ROOT, KeyRoot("acme", "m", "w2", "fp16", "rope", "flash")
    t = np.arange(64, dtype=np.uint32)
    warm(c, v1, t)
    warm(c, v2, t)
    held = c.lookup(v1, np.append(t, 0))
    pending = c.reserve(v1, np.arange(500, 564, dtype=np.uint32), force=True)
    t2 = np.arange(700, 764, dtype=np.uint32)
    c.lookup(v1, t2)
    c.lookup(v1, t2)
    c.store(v1, t2, kv(t2))
    assert c.invalidate(lambda r: r.weights_version == "w1") == 4
    assert not c.lookup(v1, np.append(t, 0))
    assert c.lookup(v2, np.append(t, 0)).matched_tokens == 64
    assert np.array_equal(read(c, held), kv(t))      # a reader keeps its bytes
    assert c.commit(pending) == 0
    assert c.stats().queue_depth == 0
    c.release(held)
    assert c._index.dead_blocks == 0


def test_hottest_prefixes_lists_value_first_within_the_byte_budget():
    c = make(blocks=64)
    hot = np.arange(64, dtype=np.uint32)
    warm_ = np.arange(1000, 1096, dtype=np.uint32)
    cold = np.arange(2000, 2032, dtype=np.uint32)
    for t in (hot, warm_, cold):
        warm(c, ROOT, t)
    for _ in range(6):
        c.release(c.lookup(ROOT, np.append(hot, 0)))
    for _ in range(3):
        c.release(c.lookup(ROOT, np.append(warm_, 0)))
    warm(c, OTHER_TENANT, np.arange(5000, 5064, dtype=np.uint32))
    got = c.hottest_prefixes("acme", max_bytes=10 * BB)
    assert [(r, t.tolist()) for r, t in got] == [(ROOT, hot.tolist()), (ROOT, warm_.tolist())]
    assert [t.tolist() for _, t in c.hottest_prefixes("acme", max_bytes=100 * BB)][-1] == cold.tolist()
    assert c.hottest_prefixes("acme", max_bytes=BB) == []


def test_hot_prompts_spend_the_budget_on_templates_before_one_templates_questions():
    """A hot template with many leaves (one question each) must not crowd out the
    tenant's other template: ranked by whole-prefix saving, the hot template's six
    leaves filled the budget (18 blocks) and the second template was left out."""
    c = make(blocks=64)
    a = np.arange(128, dtype=np.uint32)           # template A: 8 blocks
    b = np.arange(1000, 1128, dtype=np.uint32)    # template B: 8 blocks
    leaves_a = [np.append(a, np.arange(10_000 + 100 * i, 10_032 + 100 * i, dtype=np.uint32)) for i in range(6)]
    leaves_b = [np.append(b, np.arange(20_000 + 100 * i, 20_032 + 100 * i, dtype=np.uint32)) for i in range(2)]
    for t in leaves_a + leaves_b:
        warm(c, ROOT, t)
    for i in range(24):  # A is the hotter template; each request a new question
        c.release(c.lookup(ROOT, np.append(a, np.arange(30_000 + 100 * i, 30_032 + 100 * i, dtype=np.uint32))))
    for i in range(4):
        c.release(c.lookup(ROOT, np.append(b, np.arange(40_000 + 100 * i, 40_032 + 100 * i, dtype=np.uint32))))
    got = c.hot_prompts("acme", max_tokens=18 * B)
    tokens = [t.tolist() for _, t, _ in got]
    assert any(t[:128] == a.tolist() for t in tokens)
    assert any(t[:128] == b.tolist() for t in tokens), tokens
    covered = {blk for t in tokens for blk in (tuple(t[:k + B]) for k in range(0, len(t), B))}
    assert len(covered) <= 18
    # Best first: the hotter template, and each prompt's frequency is its saving per token.
    assert tokens[0][:128] == a.tolist()
    assert got[0][2] > got[-1][2] > 0


def test_metadata_only_cache_runs_the_real_index_without_payload():
    c = LocalCache(1000 * BB, BB, block_size=B, metadata_only=True, drain_budget_s=0)
    t = np.arange(160, dtype=np.uint32)
    c.lookup(ROOT, t)
    c.lookup(ROOT, t)
    assert c.store(ROOT, t, None)
    c.flush()
    hit = c.lookup(ROOT, t)
    assert hit.matched_tokens == 144 and c.arena is None
    with pytest.raises(RuntimeError, match="metadata_only"):
        c.materialize(hit, bytearray(10 * BB))


def test_external_arena_holds_the_slots():
    buf = mmap.mmap(-1, 16 * BB)
    c = LocalCache(16 * BB, BB, block_size=B, arena=buf, drain_budget_s=0)
    t = np.arange(64, dtype=np.uint32)
    warm(c, ROOT, t)
    hit = c.lookup(ROOT, np.append(t, 0))
    for i, slot in enumerate(hit.blocks):
        off = c.block_offset(slot)
        assert buf[off:off + BB] == kv(t)[i].tobytes()
    with pytest.raises(ValueError, match="arena"):
        LocalCache(16 * BB, BB, arena=bytes(16 * BB))
    with pytest.raises(ValueError, match="arena"):
        LocalCache(16 * BB, BB, arena=bytearray(8 * BB))


def test_store_drains_in_slices_and_lookup_never_drains():
    c = LocalCache(64 * BB, BB, block_size=B, drain_budget_s=0.5)
    t = np.arange(64, dtype=np.uint32)
    c.lookup(ROOT, t)
    c.lookup(ROOT, t)
    c.store(ROOT, t, kv(t))
    assert c.stats().queue_depth == 0 and c.stats().stores_applied == 1
    idle = make()
    idle.lookup(ROOT, t)
    idle.lookup(ROOT, t)
    idle.store(ROOT, t, kv(t))
    idle.lookup(ROOT, t)
    assert idle.stats().queue_depth == 1
    assert idle.drain(0.0) == 1


def test_partial_commit_publishes_only_the_verified_blocks():
    c = make(blocks=16)
    t = np.arange(96, dtype=np.uint32)
    res = c.reserve(ROOT, t, force=True)
    assert c.commit(res, num_blocks=2) == 2
    assert c.peek(ROOT, t) == 32
    assert c.stats().blocks_used == 2 and c._pool.free_count == 14
    res = c.reserve(ROOT, t, force=True)
    with pytest.raises(ValueError, match="num_blocks"):
        c.commit(res, num_blocks=99)
    assert c.commit(res, num_blocks=0) == 0 and c._pool.free_count == 14


def before_additions(c: LocalCache) -> int:
    return c._admission.sketch.additions


def test_peek_neither_pins_nor_counts():
    c = make()
    t = np.arange(64, dtype=np.uint32)
    warm(c, ROOT, t)
    before = c.stats()
    sighted = before_additions(c)
    assert c.peek(ROOT, t) == 48 and c.peek(ROOT, t, allow_full=True) == 64
    assert c.stats() == before
    assert all(n.pins == 0 for n in c._index.iter_nodes())
    fresh = np.arange(900, 964, dtype=np.uint32)
    c.peek(ROOT, fresh)
    assert before_additions(c) == sighted   # peek was not a sighting


def test_per_tenant_state_stays_bounded_under_many_one_off_tenants_and_totals_are_conserved():
    c = make(blocks=8, policy=SMALL_WINDOW)
    n = MAX_TENANT_COUNTERS + 2_000
    doc = np.arange(16, dtype=np.uint32)
    for i in range(n):                               # every tenant: one lookup, one stored block
        root = KeyRoot(f"t{i}", "m", "v1", "fp16", "rope", "attn")
        c.release(c.lookup(root, np.append(doc, 0)))
        c.store(root, doc, kv(doc))
        c.flush()
    s = c.stats()
    assert s.lookups == n and s.stored_blocks == n and s.evictions == n - 8
    assert len(c._tenants) == MAX_TENANT_COUNTERS                     # the oldest tenants' counters went
    assert len(c._index.tenant_blocks) <= 8 and len(c._index.tenant_evictions) <= 8
    first = c.stats("t0")                                              # forgotten: nothing held, not recent
    assert first.lookups == 0 and first.blocks_used == 0 and first.evictions == 0
    last = c.stats(f"t{n - 1}")                                        # recent and holding its block: exact
    assert last.lookups == 1 and last.stored_blocks == 1 and last.blocks_used == 1


def test_the_removal_log_names_each_evicted_block_once_in_order_and_says_when_it_cannot():
    """What eviction takes is named, by block hash, from a position taken before it
    (the position a store's reservation carries); a reader too far behind, one from
    before an invalidation, or one with another cache's position is told the log
    cannot say (None), never given a partial list."""
    from kvtier.keys import block_hashes

    clock = Clock()
    c = make(blocks=4, clock=clock)
    a = np.arange(64, dtype=np.uint32)
    start = c.removal_seq
    warm(c, ROOT, a)
    assert c.removed_since(start) == (start, [])      # nothing evicted yet
    clock.t += 3600
    b = np.arange(5000, 5064, dtype=np.uint32)
    warm(c, ROOT, b)                                   # takes A's four slots
    assert c.peek(ROOT, a) == 0
    nxt, removed = c.removed_since(start)
    assert nxt == start + 4 and c.removal_seq == nxt
    assert len(removed) == 4 and set(removed) == set(block_hashes(ROOT, a, B))
    assert c.removed_since(start, limit=3) == (start + 3, removed[:3])
    assert c.removed_since(start + 3) == (nxt, removed[3:])
    assert c.removed_since(nxt) == (nxt, [])
    assert c.removed_since(nxt + 1) == (nxt, None)     # a position this cache never had
    # Dropped trees are not named one by one: a reader from before it must assume all gone.
    c.invalidate(lambda root: True)
    assert c.removed_since(nxt) == (nxt + 1, None)
    assert c.removed_since(c.removal_seq) == (c.removal_seq, [])


def test_the_removal_log_keeps_only_its_newest_entries(monkeypatch):
    monkeypatch.setattr(cache_mod, "REMOVAL_LOG_BLOCKS", 2)
    c = make(blocks=2)
    a, b = np.arange(32, dtype=np.uint32), np.arange(7000, 7032, dtype=np.uint32)
    warm(c, ROOT, a)
    start = c.removal_seq
    c.evict(2)
    assert c.removed_since(start)[1] is not None       # two removals: within the log
    warm(c, ROOT, b)
    c.evict(2)
    assert c.removed_since(start) == (start + 4, None)  # four since: the first two are gone
    assert len(c.removed_since(start + 2)[1]) == 2
