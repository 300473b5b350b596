"""Bounded, prioritised work: a flood of warm-ups toward a stalled peer fills only the
bounded warm queue (the rest are answered 429 with Retry-After) and the warm pool,
while engine lookups that need a request-path peer fetch keep their latency — compared
with a baseline measured in the same test, before the flood."""
from __future__ import annotations

import json
import socket
import statistics
import time

import redis as redis_sync

from kvtier.keys import block_hashes
from kvtier_sidecar.client import EngineHit, SidecarClient
from kvtier_sidecar.service import MAX_WARM_JOBS, WARM_RETRY_AFTER_S

from .test_sidecar_process import poll, prompt, seed_cache

FLOOD = 300
PROMPTS = 10  # per phase
# Lookups during the flood may be this many times slower than before it (median); an
# unbounded design blocked them for the whole peer timeout, hundreds of times longer.
LATENCY_RATIO_BOUND = 4.0


def registered(r, root, tokens, host: str) -> bool:
    last = block_hashes(root, tokens, 16)[-1].hex()
    return bool(r.hexists(f"kvt:{{{root.digest().hex()}}}:{last}", host))


def peer_lookup_s(client: SidecarClient, root, tokens) -> float:
    t0 = time.perf_counter()
    hit = client.lookup(root, tokens)
    elapsed = time.perf_counter() - t0
    assert isinstance(hit, EngineHit) and hit.tier == "peer", hit
    client.release(hit)
    return elapsed


def post_warm(side, ref: str, peer: str) -> tuple[int, dict[str, str]]:
    status, headers, _ = side.control.exchange(
        "POST", "/cache/warm", {"tenant": "t", "from_peer": peer, "max_bytes": 1 << 20, "ref": ref})
    return status, headers


def test_warm_flood_toward_a_stalled_peer_is_bounded_and_engine_lookups_keep_their_latency(
        spawn, oracle, redis_url, secret_file):
    silent = socket.create_server(("127.0.0.4", 0))  # accepts, never greets: a stalled peer
    stalled = "%s:%d" % silent.getsockname()[:2]
    a = spawn("a", "127.0.0.2", redis_url, secret_file)
    # Warm-ups dial only the fleet: the stalled peer is one of it by config.
    b = spawn("b", "127.0.0.3", redis_url, secret_file, warm_peers=[stalled])
    ca, cb = SidecarClient(a.socket), SidecarClient(b.socket)
    r = redis_sync.Redis.from_url(redis_url)
    root = oracle.root("t")
    prompts = [prompt(120, seed=100 + i) for i in range(2 * PROMPTS)]
    for p in prompts:
        seed_cache(ca, oracle, "t", p)
    poll(lambda: all(registered(r, root, p, a.peer) for p in prompts))

    before = [peer_lookup_s(cb, root, p) for p in prompts[:PROMPTS]]

    try:
        answers = [post_warm(b, f"flood/{i}", stalled) for i in range(FLOOD)]
        statuses = [s for s, _ in answers]
        # The queue fills, then refuses; a slot frees only as a job ends (failed connects end early).
        assert statuses[:MAX_WARM_JOBS] == [202] * MAX_WARM_JOBS and set(statuses) == {202, 429}
        finished = sum(1 for j in json.loads(b.get("/cache/jobs")[1]).values() if j["state"] != "running")
        assert statuses.count(202) <= MAX_WARM_JOBS + finished
        refused = next(h for s, h in answers if s == 429)
        assert refused.get("Retry-After") == str(WARM_RETRY_AFTER_S)
        assert b.stats()["sidecar"]["warm_refused"] == statuses.count(429)

        during = [peer_lookup_s(cb, root, p) for p in prompts[PROMPTS:]]
        running = sum(1 for j in json.loads(b.get("/cache/jobs")[1]).values() if j["state"] == "running")
        assert 0 < running <= MAX_WARM_JOBS  # the flood is still on, and bounded
    finally:
        silent.close()
    ratio = statistics.median(during) / statistics.median(before)
    print(f"peer-hit lookup median: before the flood {statistics.median(before) * 1e3:.2f} ms, "
          f"during it {statistics.median(during) * 1e3:.2f} ms, ratio {ratio:.2f}")
    assert ratio <= LATENCY_RATIO_BOUND, (before, during)
    assert b.get("/healthz")[0] == 200 and b.proc.poll() is None
