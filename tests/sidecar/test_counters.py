"""The sidecar's counters are bumped from the peer-fetch pool and the event loop at
once: no increment may be lost."""
from __future__ import annotations

import threading

from kvtier_sidecar.counters import Count, Counters

THREADS, ADDS = 8, 20_000


def test_concurrent_adds_from_many_threads_are_all_counted():
    counters = Counters()
    start = threading.Barrier(THREADS)

    def bump() -> None:
        start.wait()
        for _ in range(ADDS):
            counters.add(Count.PEER_FETCHES)
            counters.add(Count.PEER_BYTES_FETCHED, 3)

    threads = [threading.Thread(target=bump) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = counters.snapshot()
    assert snap["peer_fetches"] == THREADS * ADDS
    assert snap["peer_bytes_fetched"] == 3 * THREADS * ADDS
