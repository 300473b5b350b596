"""The replica caches the simulator drives: kvtier's LocalCache, plain LRU, the oracle."""
import numpy as np

from kvtier.keys import KeyRoot
from kvtier.sim.caches import KvtierCache, LruCache, OracleCache
from kvtier.sim.request import HashCache, SimRequest

ROOT = KeyRoot("t", "m", "sha256:v0", "fp16", "rope", "attn")
BS = 4


def _req(tokens, template_elems=0):
    r = SimRequest(hash_cache=HashCache(BS))
    r.tokens = np.asarray(tokens, dtype=np.uint32)
    r.token_bytes = r.tokens.tobytes()
    r.template_elems = template_elems
    r.template_key = 0
    return r


def test_oracle_gives_back_the_last_block_of_a_fully_cached_prompt():
    oracle = OracleCache(BS)
    prompt = list(range(12))  # exactly three blocks
    assert oracle.serve(_req(prompt), ROOT, 0.0) == 0
    assert oracle.serve(_req(prompt), ROOT, 1.0) == 8
    assert oracle.serve(_req(prompt + [99]), ROOT, 2.0) == 12


def test_lru_evicts_the_least_recently_used_prefix_tail_first():
    lru = LruCache(capacity_blocks=4, block_size=BS)
    a, b = list(range(0, 9)), list(range(100, 109))  # two full blocks each
    lru.serve(_req(a), ROOT, 0.0)
    lru.serve(_req(b), ROOT, 1.0)
    assert lru.peek(_req(a), ROOT) == 8
    lru.serve(_req(list(range(200, 205))), ROOT, 2.0)  # one new block: a's tail goes
    assert lru.peek(_req(a), ROOT) == 4
    assert lru.peek(_req(b), ROOT) == 8
    assert lru.used_blocks() == 4


def test_kvtier_cache_stores_into_free_space_at_once_and_hits_on_the_second_sighting():
    clock = [0.0]
    cache = KvtierCache(capacity_bytes=64 * 1024, block_bytes=1024, block_size=BS, clock=lambda: clock[0])
    prompt = list(range(17))
    got = []
    for t in range(3):
        clock[0] = float(t)
        got.append(cache.serve(_req(prompt), ROOT, clock[0]))
    assert got == [0, 16, 16]
    assert cache.peek(_req(prompt), ROOT) == 16
    cache.drop_all()
    assert cache.peek(_req(prompt), ROOT) == 0


def test_kvtier_cache_warms_a_peer_with_a_tenants_hot_prefix():
    clock = [0.0]
    src = KvtierCache(64 * 1024, 1024, BS, lambda: clock[0])
    dst = KvtierCache(64 * 1024, 1024, BS, lambda: clock[0])
    prompt = list(range(17))
    for t in range(3):
        src.serve(_req(prompt), ROOT, float(t))
    assert dst.warm_from(src, "t", 64 * 1024) == 4
    assert dst.serve(_req(prompt), ROOT, 5.0) == 16
