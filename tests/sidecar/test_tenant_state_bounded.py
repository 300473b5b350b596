"""Bounded per-tenant state: a million distinct tenants keep memory flat (the tracked
set never exceeds its bound), totals are conserved in "other", and the heavy tenants
stay tracked with their exact counts (space-saving)."""
from __future__ import annotations

import sys

from kvtier_sidecar.metrics import OTHER, TenantCounters, TenantMetrics

CAPACITY = 1000
DISTINCT = 1_000_000
HOT = ("hot-a", "hot-b", "hot-c")
HOT_EVERY = 50  # each hot tenant: 1 event in 50 per tenant, far above 1/CAPACITY


def feed(m: TenantMetrics, start: int, stop: int) -> None:
    for i in range(start, stop):
        m.lookup(f"t{i}", 100, None, 0)
        if i % HOT_EVERY == 0:
            for h in HOT:
                m.lookup(h, 100, "dram", 64)


def footprint(m: TenantMetrics) -> int:
    """Bytes held by the structure: its dicts, heap, keys and per-tenant counters."""
    def counters(c: TenantCounters) -> int:
        return sys.getsizeof(c) + sys.getsizeof(c.hits) + sys.getsizeof(c.hit_tokens)
    return (sys.getsizeof(m.tenants) + sys.getsizeof(m._weight) + sys.getsizeof(m._heap)
            + sum(sys.getsizeof(t) + counters(c) for t, c in m.tenants.items())
            + sum(sys.getsizeof(e) for e in m._heap) + counters(m.other))


def test_a_million_distinct_tenants_keep_memory_flat_and_totals_conserved():
    m = TenantMetrics(capacity=CAPACITY)
    feed(m, 0, DISTINCT // 10)
    early = footprint(m)
    feed(m, DISTINCT // 10, DISTINCT)
    late = footprint(m)
    assert len(m.tenants) == CAPACITY and len(m._heap) <= 4 * CAPACITY
    assert late <= early * 1.25, (early, late)  # 10x the tenants, the same memory
    hot_lookups = len(HOT) * len(range(0, DISTINCT, HOT_EVERY))
    assert m.total().lookups == DISTINCT + hot_lookups
    for h in HOT:  # heavy hitters are never evicted, so their counts are exact
        assert m.tenants[h].lookups == DISTINCT // HOT_EVERY and m.tenants[h].hits["dram"] == DISTINCT // HOT_EVERY
    buckets = m.bucketed(len(HOT))
    assert list(buckets)[: len(HOT)] == sorted(HOT) or set(list(buckets)[: len(HOT)]) == set(HOT)
    assert sum(c.lookups for c in buckets.values()) == m.total().lookups
    assert buckets[OTHER].lookups == DISTINCT
    assert m.evicted == DISTINCT - (CAPACITY - len(HOT))


def test_a_one_off_newcomer_inherits_the_evicted_count_and_cannot_push_out_a_heavy_tenant():
    m = TenantMetrics(capacity=2)
    for _ in range(5):
        m.lookup("heavy", 10, None, 0)
    m.lookup("a", 10, None, 0)
    m.lookup("b", 10, None, 0)  # evicts "a" (1 event), inherits its count
    m.lookup("c", 10, None, 0)  # evicts "b" (weight 2), not "heavy" (5)
    assert set(m.tenants) == {"heavy", "c"} and m.other.lookups == 2 and m.total().lookups == 8


def test_stats_and_metrics_assembled_off_the_event_loop_stay_exact_while_new_tenants_arrive(spawn, oracle):
    # Reports are assembled on their own thread while the event loop keeps adding
    # tenants (and their first tier keys): every report answers 200, none raises, and
    # once the traffic stops the totals count every lookup.
    import json
    import threading

    from kvtier_sidecar.client import SidecarClient
    from .test_sidecar_process import prompt, seed_cache

    side = spawn(stats_max_tenants=50)
    client = SidecarClient(side.socket)
    tokens = prompt(64)
    seed_cache(client, oracle, "shared", tokens)
    statuses: list[int] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            for path in ("/cache/stats", "/metrics"):
                statuses.append(side.get(path)[0])

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        n = 1_500
        for i in range(n):
            hit = client.lookup(oracle.root(f"t{i}"), tokens)   # a miss for a new tenant
            client.release(hit)
            client.release(client.lookup(oracle.root("shared"), tokens))
    finally:
        stop.set()
        scraper.join(30)
    assert statuses and set(statuses) == {200}, sorted(set(statuses))
    stats = side.stats()
    assert stats["lookups"] == n * 2 + 2          # seed_cache looked up twice
    assert stats["tenants_total"] >= 50 and len(stats["tenants"]) <= 50
    status, body = side.get("/cache/stats?tenant=shared")
    assert status == 200 and json.loads(body)["hits"] == n + 1
