"""Several sidecar processes on loopback, engine processes replaying a multi-tenant
workload, and the faults: Redis and peers SIGKILLed mid-run, bytes corrupted on the
wire, a stalled peer. Every hit is checked against a recompute: zero wrong KV, zero
errors on the request path."""
import dataclasses
import json
import threading
import time

import numpy as np
import redis as redis_sync

from kvtier.keys import block_hashes
from kvtier_sidecar.client import EngineHit, Miss, SidecarClient
from kvtier_testenv.fleet import run_engines, split_requests
from kvtier_testenv.polling import wait_for
from kvtier_testenv.workload import make_workload

from .proxy import FaultyProxy
from .test_sidecar_process import poll, prompt, seed_cache

BB = 8192


def assert_peer_serves_the_miss(ca, cb, a_peer: str, index, oracle, tenant: str, tokens) -> None:
    """Store a prompt through sidecar A, wait until the global index names A for its
    last block, then B's lookup must be a byte-exact peer hit of 192 tokens."""
    root = oracle.root(tenant)
    seed_cache(ca, oracle, tenant, tokens)
    last = block_hashes(root, tokens, 16)[-1].hex()
    poll(lambda: index.hexists(f"kvt:{{{root.digest().hex()}}}:{last}", a_peer))
    hit = cb.lookup(root, tokens)
    assert isinstance(hit, EngineHit) and hit.tier == "peer" and hit.matched_tokens == 192
    dst = np.zeros(12 * BB, np.uint8)
    cb.materialize(hit, dst)
    assert np.array_equal(dst, oracle.kv(root, tokens)[: 12 * BB])
    cb.release(hit)


def test_a_miss_on_one_sidecar_is_served_by_the_peer_that_stored_it(spawn, oracle, redis_url, secret_file):
    a = spawn("a", "127.0.0.2", redis_url, secret_file)
    b = spawn("b", "127.0.0.3", redis_url, secret_file)
    ca, cb = SidecarClient(a.socket), SidecarClient(b.socket)
    root, tokens = oracle.root("acme"), prompt(200)
    assert_peer_serves_the_miss(ca, cb, a.peer, redis_sync.Redis.from_url(redis_url), oracle, "acme", tokens)
    again = cb.lookup(root, tokens)
    assert again.tier == "dram" and again.matched_tokens == 192
    stats = b.stats("acme")
    assert stats["hits_by_tier"] == {"dram": 1, "peer": 1} and stats["peer_bytes_fetched"] == 12 * BB


def test_warm_pulls_a_tenants_hot_prefixes_from_a_peer(spawn, oracle, redis_url, secret_file):
    a = spawn("a", "127.0.0.2", redis_url, secret_file)
    b = spawn("b", "127.0.0.3", None, secret_file)  # no index: only the warm-up can fill it
    ca, cb = SidecarClient(a.socket), SidecarClient(b.socket)
    prompts = [prompt(100, seed=s) for s in range(3)]
    for p in prompts:
        seed_cache(ca, oracle, "moved", p)
    seed_cache(ca, oracle, "stays", prompt(100, seed=9))
    status, body = b.post("/cache/warm", {"tenant": "moved", "from_peer": a.peer, "max_bytes": 1 << 20})
    assert status == 202, body
    poll(lambda: b.stats()["cache"]["blocks_used"] >= 18)
    for p in prompts:
        hit = cb.lookup(oracle.root("moved"), p)
        assert hit.matched_tokens == 96
        dst = np.zeros(6 * BB, np.uint8)
        cb.materialize(hit, dst)
        assert np.array_equal(dst, oracle.kv(oracle.root("moved"), p)[: 6 * BB])
    assert isinstance(cb.lookup(oracle.root("stays"), prompt(100, seed=9)), Miss)


def jobs(sidecar) -> list[dict]:
    status, body = sidecar.get("/cache/jobs")
    assert status == 200, body
    return list(json.loads(body).values())


def test_warm_pulls_only_the_weights_version_this_pod_serves(spawn, oracle, secret_file):
    """Mid-rollout the old home holds both versions; the new home takes only its own."""
    a = spawn("a", "127.0.0.2", None, secret_file)
    b = spawn("b", "127.0.0.3", None, secret_file)
    ca, cb = SidecarClient(a.socket), SidecarClient(b.socket)
    serving = oracle.root("moved")
    previous = dataclasses.replace(serving, weights_version=serving.weights_version + "-previous")
    p_now, p_old = prompt(100, seed=1), prompt(100, seed=2)
    seed_cache(ca, oracle, "moved", p_now)
    for _ in range(2):  # two sightings: the store is admitted on the second (rule: admission)
        ca.release(ca.lookup(previous, p_old))
        ca.store(previous, p_old, oracle.kv(previous, p_old))
    poll(lambda: ca.lookup(previous, p_old).matched_tokens == 96)
    status, body = b.post("/cache/warm", {"tenant": "moved", "from_peer": a.peer, "max_bytes": 1 << 20})
    assert status == 202, body
    poll(lambda: any(j.get("finished_s") for j in jobs(b)))
    assert cb.lookup(serving, p_now).matched_tokens == 96
    assert isinstance(cb.lookup(previous, p_old), Miss)


def test_corrupted_peer_bytes_are_never_served(spawn, oracle, redis_url, secret_file, tmp_path):
    a = spawn("a", "127.0.0.2", redis_url, secret_file)
    proxy = FaultyProxy(a.ready["peer_bound"], flip_at=4000)
    # `a` advertises the proxy: every peer fetch from it crosses the corrupting wire.
    a.stop()
    a.config["peer_advertise"] = proxy.address
    a.config["peer_port"] = int(a.ready["peer_bound"].split(":")[1])
    a.start()
    b = spawn("b", "127.0.0.3", redis_url, secret_file)
    ca, cb = SidecarClient(a.socket), SidecarClient(b.socket)
    root, tokens = oracle.root("t"), prompt(120)
    seed_cache(ca, oracle, "t", tokens)
    poll(lambda: _registered(redis_url, root, tokens, proxy.address))
    hit = cb.lookup(root, tokens)
    assert isinstance(hit, Miss)
    assert proxy.connections >= 1
    assert b.stats()["sidecar"]["peer_checksum_mismatches"] >= 1
    proxy.close()


def _registered(redis_url, root, tokens, host) -> bool:
    r = redis_sync.Redis.from_url(redis_url)
    last = block_hashes(root, tokens, 16)[-1].hex()
    return bool(r.hexists(f"kvt:{{{root.digest().hex()}}}:{last}", host))


def test_stalled_peer_costs_a_timeout_and_a_miss_never_an_error(spawn, oracle, redis_url, secret_file):
    import socket

    silent = socket.create_server(("127.0.0.4", 0))
    stalled = "%s:%d" % silent.getsockname()[:2]
    root, tokens = oracle.root("t"), prompt(120)
    r = redis_sync.Redis.from_url(redis_url)
    r.zadd("kvt:members", {stalled: time.time() + 3600})
    for h in block_hashes(root, tokens, 16):
        r.hset(f"kvt:{{{root.digest().hex()}}}:{h.hex()}", stalled, int(time.time()) + 600)
    b = spawn("b", "127.0.0.3", redis_url, secret_file, peer_timeout_s=1.0, peer_connect_timeout_s=0.25)
    cb = SidecarClient(b.socket)
    # the stats name the live members a lookup may fetch from: the stalled one among them
    wait_for("the stalled peer among b's members", lambda: stalled in b.stats()["index"]["members"], 10)
    t0 = time.monotonic()
    assert isinstance(cb.lookup(root, tokens), Miss)
    # The sidecar answered (no client-side timeout) within its own peer deadlines: the
    # connect, the fetch's deadline, and at most one more socket wait.
    assert cb.faults == 0
    cfg = b.config
    assert time.monotonic() - t0 < cfg["peer_connect_timeout_s"] + 2 * cfg["peer_timeout_s"]
    assert b.stats()["sidecar"]["peer_fetch_errors"] >= 1
    silent.close()


# Lookups each live sidecar must serve in a phase before the next fault: the chaos
# follows the engines' progress, not the clock (engines and a restarted sidecar start
# late on a loaded machine).
LOOKUPS_PER_PHASE = 20
CHAOS_PHASE_TIMEOUT_S = 60.0
# A guard against a hang only: the engines are stopped (stop file) as soon as the chaos
# ends, well or not. Above the chaos's own deadlines (five phases and the probe's seeding),
# so engines never stop under a chaos still waiting for their traffic.
ENGINE_CAP_S = 7 * CHAOS_PHASE_TIMEOUT_S


def lookups(handle) -> int:
    return handle.stats()["lookups"]


def wait_served(handles, extra: int = LOOKUPS_PER_PHASE) -> None:
    """Until each sidecar in `handles` has served `extra` more lookups."""
    start = [lookups(h) for h in handles]
    poll(lambda: all(lookups(h) >= s + extra for h, s in zip(handles, start)), timeout_s=CHAOS_PHASE_TIMEOUT_S)


def peer_serves_the_restarted_sidecar(holder, restarted, redis_url, oracle) -> None:
    """A prompt only `holder` has stored, once the index names it, is a byte-exact peer
    hit on `restarted`. Polled: on a loaded machine a lookup may meet a slow index or
    peer (a miss, as designed) - and a miss stores nothing on `restarted`, so the next
    lookup has the same chance. (The engines' own traffic cannot be the probe: each
    prefix is a peer miss once, then their stores make it a local hit for good.)"""
    tenant, tokens = "probe-after-restart", prompt(200, seed=77)
    root = oracle.root(tenant)
    seed_cache(SidecarClient(holder.socket), oracle, tenant, tokens)
    poll(lambda: _registered(redis_url, root, tokens, holder.peer), timeout_s=CHAOS_PHASE_TIMEOUT_S)
    client = SidecarClient(restarted.socket)

    def peer_hit():
        hit = client.lookup(root, tokens)
        if isinstance(hit, EngineHit) and hit.tier == "peer" and hit.matched_tokens == 192:
            return hit
        client.release(hit)
        return None
    hit = poll(peer_hit, timeout_s=CHAOS_PHASE_TIMEOUT_S)
    dst = np.zeros(12 * BB, np.uint8)
    client.materialize(hit, dst)
    client.release(hit)
    assert np.array_equal(dst, oracle.kv(root, tokens)[: 12 * BB])
    assert restarted.stats()["hits_by_tier"].get("peer", 0) > 0


def test_fleet_under_redis_and_peer_sigkill_serves_zero_wrong_kv(spawn, oracle, redis_server_fn, secret_file, tmp_path):
    handles = [spawn(f"s{i}", f"127.0.0.{2 + i}", redis_server_fn.url, secret_file) for i in range(3)]
    work = make_workload(tenants=5, templates=3, requests=400, seed=11)
    parts = split_requests(work, 3, seed=11)
    assignments = [(handles[i].socket, parts[i]) for i in range(3)]
    stop_file = tmp_path / "engines.stop"
    faults: list[str] = []
    failures: list[BaseException] = []

    def chaos():
        try:
            wait_served(handles)  # every engine is up and served
            redis_server_fn.kill(); faults.append("redis killed")
            wait_served(handles)
            redis_server_fn.start(); faults.append("redis back")
            wait_served(handles)
            handles[2].kill(); faults.append("peer s2 killed")
            wait_served(handles[:2])
            handles[2].start(); faults.append("peer s2 back")
            # The restarted s2 is empty: a miss on it is served by the peer that holds the prefix.
            peer_serves_the_restarted_sidecar(handles[0], handles[2], redis_server_fn.url, oracle)
        except BaseException as exc:
            failures.append(exc)
        finally:
            stop_file.touch()
    t = threading.Thread(target=chaos)
    t.start()
    results = run_engines(assignments, "synthetic", duration_s=ENGINE_CAP_S, stop_file=str(stop_file))
    t.join()
    assert not failures, (failures, faults)  # faults: how far the chaos got
    assert faults == ["redis killed", "redis back", "peer s2 killed", "peer s2 back"]
    assert all(r.requests > 0 for r in results)
    total = results[0]
    for r in results[1:]:
        total.merge(r)
    assert total.errors == 0, total.error_samples
    assert total.wrong_kv == 0
    assert total.hits.get("dram", 0) > 0 and total.hits.get("peer", 0) > 0, total.hits
    # The survivors noticed the faults and kept serving.
    assert handles[0].proc.poll() is None and handles[1].proc.poll() is None


def test_fleet_with_reference_engines_reports_tier_hit_rates_and_serves_no_wrong_kv(tmp_path):
    from kvtier_testenv.fleet import run_fleet

    report = run_fleet(sidecars=2, tenants=4, templates=2, requests=120, oracle="reference", workdir=str(tmp_path))
    assert report["errors"] == 0, report["error_samples"]
    assert report["wrong_kv"] == 0
    assert report["requests"] == 120
    assert report["tiers"]["dram"]["hits"] > 0 and report["tiers"]["peer"]["hits"] > 0
    assert report["bytes_from_peers"] > 0 and report["bytes_materialized"] > 0
    assert 0 < report["hit_rate"] <= 1
