"""One sidecar process: the engine client over shared memory, HTTP control, lifecycle."""
import json
import os
import re
import threading
import time

import numpy as np
import redis as redis_sync

from kvtier_sidecar.client import EngineHit, Miss, SidecarClient

BB = 8192  # SyntheticOracle's block bytes (2 layers, 2 kv heads, head_dim 16, fp32, 16 tokens)


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n).astype(np.uint32)


def seed_cache(client, oracle, tenant: str, tokens: np.ndarray) -> None:
    """Two sightings: the store is admitted on the second (rule: admission)."""
    root = oracle.root(tenant)
    kv = oracle.kv(root, tokens)
    for _ in range(2):
        client.release(client.lookup(root, tokens))
        client.store(root, tokens, kv)


def poll(fn, timeout_s: float = 10.0, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        time.sleep(every_s)


def test_a_store_into_free_space_is_taken_and_hits_materialize_exact_bytes_from_shared_memory(spawn, oracle):
    sc = spawn()
    client = SidecarClient(sc.socket)
    root, tokens = oracle.root("acme"), prompt(100)
    kv = oracle.kv(root, tokens)
    assert isinstance(client.lookup(root, tokens), Miss)
    assert client.store(root, tokens, kv) is True   # free space is never refused
    hit = client.lookup(root, tokens)
    assert isinstance(hit, EngineHit) and hit.matched_tokens == 96 and hit.tier == "dram"
    dst = np.zeros(6 * BB, np.uint8)
    assert client.materialize(hit, dst) == 6 * BB
    assert np.array_equal(dst, kv[: 6 * BB])
    client.release(hit)
    # A whole-prompt match gives back its last block: one token is always computed.
    exact = client.lookup(root, tokens[:96])
    assert exact.matched_tokens == 80
    client.release(exact)


def test_a_store_of_blocks_already_cached_is_counted_as_cached_not_declined(spawn, oracle):
    """Storing a prompt the cache holds has nothing to write: the engine is told so
    (`last_store_cached`), and the sidecar counts it under its own outcome; a store the
    admission refuses (one sighting, a full cache) is the only "declined"."""
    sc = spawn(dram_capacity_bytes=6 * BB)
    client = SidecarClient(sc.socket)
    root, tokens = oracle.root("acme"), prompt(100)
    assert client.store(root, tokens, oracle.kv(root, tokens)) is True
    assert client.store(root, tokens, oracle.kv(root, tokens)) is False and client.last_store_cached
    hit = client.lookup(root, tokens)  # pins all 6 slots: another prompt finds no room
    other = prompt(100, seed=5)
    assert client.store(root, other, oracle.kv(root, other)) is False and not client.last_store_cached
    client.release(hit)
    stats = sc.stats("acme")
    assert (stats["stores"], stats["stores_cached"], stats["stores_declined"]) == (1, 1, 1)
    text = sc.get("/metrics")[1].decode()
    for outcome, n in (("accepted", 1), ("cached", 1), ("declined", 1)):
        assert re.search(rf'^kvtier_stores_total\{{[^}}]*outcome="{outcome}"[^}}]*\}} {n}\.0$', text, re.M), outcome


def test_tenants_never_hit_each_others_blocks(spawn, oracle):
    sc = spawn()
    client = SidecarClient(sc.socket)
    tokens = prompt(64)
    seed_cache(client, oracle, "tenant-a", tokens)
    assert client.lookup(oracle.root("tenant-a"), tokens)
    assert isinstance(client.lookup(oracle.root("tenant-b"), tokens), Miss)
    stats_b = sc.stats("tenant-b")
    assert stats_b["hits"] == 0 and stats_b["lookups"] == 1


def test_platform_owned_prefix_is_shared_across_tenants(spawn, oracle):
    system = [int(t) for t in prompt(48, seed=7)]
    sc = spawn(platform_prefixes=[system])
    client = SidecarClient(sc.socket)
    a_tokens = np.asarray(system + [1, 2, 3] * 10, dtype=np.uint32)
    seed_cache(client, oracle, "tenant-a", a_tokens)
    b_tokens = np.asarray(system + [9, 8] * 20, dtype=np.uint32)
    hit = client.lookup(oracle.root("tenant-b"), b_tokens)
    assert isinstance(hit, EngineHit) and hit.matched_tokens == 48
    dst = np.zeros(3 * BB, np.uint8)
    client.materialize(hit, dst)
    # The platform prefix's KV is the same whoever computed it only if the key root is
    # the platform's: the oracle is keyed by root, so compare with the platform root.
    expected = oracle.kv(oracle.root("tenant-a"), a_tokens)[: 3 * BB]
    assert np.array_equal(dst, expected)
    # A prompt that does not start with the platform prefix gets nothing from tenant-a.
    assert isinstance(client.lookup(oracle.root("tenant-b"), a_tokens[3:]), Miss)


def test_tp_ranks_in_separate_clients_store_shards_that_commit_together(spawn, oracle):
    from kvtier.layout import shard_for_rank

    sc = spawn()
    ranks = [SidecarClient(sc.socket) for _ in range(2)]
    root, tokens = oracle.root("tp"), prompt(64, seed=3)
    kv = oracle.kv(root, tokens)
    shape = (-1, 2, 2, 2, 16, 16)  # (n, L, K|V, H, B, D)
    blocks = kv.view(np.float32).reshape(shape)
    for _ in range(2):  # two sightings: admitted
        ranks[0].lookup(root, tokens)
    shards = [np.ascontiguousarray(shard_for_rank(blocks, 2, r)) for r in range(2)]
    assert ranks[0].store(root, tokens, shards[0], tp=2, rank=0)
    assert isinstance(ranks[0].lookup(root, tokens), Miss)  # rank 1 has not written yet
    assert ranks[1].store(root, tokens, shards[1], tp=2, rank=1)
    hit = poll(lambda: ranks[0].lookup(root, tokens))
    full = np.zeros(len(hit.blocks) * BB, np.uint8)
    ranks[0].materialize(hit, full)
    assert np.array_equal(full, kv[: len(full)])
    for r in range(2):
        out = np.zeros(len(hit.blocks) * BB // 2, np.uint8)
        ranks[r].materialize(hit, out, tp=2, rank=r)
        assert np.array_equal(out, shards[r].reshape(-1).view(np.uint8)[: len(out)])


def test_engine_that_disconnects_releases_its_pins(spawn, oracle):
    sc = spawn(dram_capacity_bytes=8 * BB)
    a = SidecarClient(sc.socket)
    tokens = prompt(100)
    seed_cache(a, oracle, "t", tokens)
    hit = a.lookup(oracle.root("t"), tokens)
    assert hit
    a.close()  # dies holding the pin
    b = SidecarClient(sc.socket)
    # Fill the arena with other prompts: the dead engine's blocks must become evictable.
    for seed in range(1, 6):
        seed_cache(b, oracle, "t", prompt(100, seed=seed))
    assert sc.stats()["cache"]["evictions"] > 0


def test_sidecar_restart_is_a_miss_then_the_client_reconnects_to_the_new_arena(spawn, oracle):
    sc = spawn()
    client = SidecarClient(sc.socket)
    root, tokens = oracle.root("t"), prompt(80)
    seed_cache(client, oracle, "t", tokens)
    old_hit = client.lookup(root, tokens)
    assert old_hit
    sc.kill()
    assert isinstance(client.lookup(root, tokens), Miss)  # no exception
    sc.start()
    got = poll(lambda: (client.lookup(root, tokens), client.connect())[1], timeout_s=10)
    assert got
    assert isinstance(client.lookup(root, tokens), Miss)  # a new, empty cache
    client.release(old_hit)  # releasing a hit of the dead sidecar is a no-op
    seed_cache(client, oracle, "t", tokens)
    hit = client.lookup(root, tokens)
    dst = np.zeros(len(hit.blocks) * BB, np.uint8)
    client.materialize(hit, dst)
    assert np.array_equal(dst, oracle.kv(root, tokens)[: len(dst)])


def test_full_arena_refuses_stores_but_lookups_still_serve(spawn, oracle):
    sc = spawn(dram_capacity_bytes=6 * BB)
    client = SidecarClient(sc.socket)
    root, tokens = oracle.root("t"), prompt(100)
    seed_cache(client, oracle, "t", tokens)
    hit = client.lookup(root, tokens)  # pins all 6 slots
    assert hit and len(hit.blocks) == 6
    other = prompt(100, seed=9)
    for _ in range(3):
        client.lookup(oracle.root("t"), other)
        assert client.store(oracle.root("t"), other, oracle.kv(oracle.root("t"), other)) is False
    again = client.lookup(root, tokens)
    assert again.matched_tokens == 96
    client.release(again)
    client.release(hit)


def test_invalidate_model_version_drops_blocks_in_background(spawn, oracle):
    sc = spawn()
    client = SidecarClient(sc.socket)
    tokens = prompt(64)
    seed_cache(client, oracle, "t", tokens)
    status, body = sc.post("/cache/invalidate", {"model_version": "dev"})
    assert status == 202, body
    poll(lambda: isinstance(client.lookup(oracle.root("t"), tokens), Miss))
    status, _ = sc.post("/cache/invalidate", {"model_version": "other"})
    assert status == 202


def test_metrics_label_cardinality_is_bounded_to_top_n_plus_other(spawn, oracle):
    sc = spawn(metrics_top_tenants=3)
    client = SidecarClient(sc.socket)
    for i in range(12):
        for _ in range(i + 1):
            client.lookup(oracle.root(f"t{i:02d}"), prompt(40))
    status, body = sc.get("/metrics")
    text = body.decode()
    tenants = {line.split('tenant="')[1].split('"')[0] for line in text.splitlines()
               if line.startswith("kvtier_lookups_total{")}
    assert tenants == {"t11", "t10", "t09", "other"}
    other = [line for line in text.splitlines() if line.startswith('kvtier_lookups_total{tenant="other",')]
    assert float(other[0].split()[-1]) == sum(range(1, 10))


def metric(text: str, name: str) -> float:
    """The sum of a metric's series in a /metrics body."""
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_engine_facing_counters_in_metrics_follow_stores_and_engine_reports(spawn, oracle):
    """Lookups, queried and hit tokens, stored bytes from the sidecar's own view; loaded
    bytes and load errors as the engine reports them over the socket. A bad report is
    refused with a message and counts nothing."""
    sc = spawn()
    client = SidecarClient(sc.socket)
    before = sc.get("/metrics")[1].decode()
    assert metric(before, "kvtier_stored_bytes_total") == 0  # exported before the first store
    assert metric(before, "kvtier_engine_load_errors_total") == 0
    root, tokens = oracle.root("acme"), prompt(100)
    matched = 0
    for _ in range(3):  # stored once admission lets it in; later lookups hit
        found = client.lookup(root, tokens)
        matched += found.matched_tokens if isinstance(found, EngineHit) else 0
        client.release(found)
        client.store(root, tokens, oracle.kv(root, tokens))
    assert matched > 0
    assert client.report(loaded_bytes=6 * BB, load_errors=2) is True
    assert client.report(loaded_bytes=BB) is True
    try:
        client.report(loaded_bytes=-1)
        raise AssertionError("a negative report was accepted")
    except ValueError as exc:
        assert "loaded_bytes" in str(exc)
    text = sc.get("/metrics")[1].decode()
    assert metric(text, "kvtier_lookups_total") == 3
    assert metric(text, "kvtier_prefix_cache_queries_total") == 300
    assert metric(text, "kvtier_prefix_cache_hits_total") == matched
    assert metric(text, "kvtier_stored_bytes_total") == 6 * BB
    assert metric(text, "kvtier_engine_loaded_bytes_total") == 7 * BB
    assert metric(text, "kvtier_engine_load_errors_total") == 2
    assert client.lookup(oracle.root("acme"), tokens)  # the connection still serves


def test_http_rejects_malformed_requests_with_4xx_and_keeps_serving(spawn):
    sc = spawn()
    cases = [
        ("/cache/invalidate", b"not json"),
        ("/cache/invalidate", b"[1,2]"),
        ("/cache/invalidate", json.dumps({}).encode()),
        ("/cache/invalidate", json.dumps({"model_version": ""}).encode()),
        ("/cache/invalidate", json.dumps({"model_version": "v", "extra": 1}).encode()),
        ("/cache/warm", json.dumps({"tenant": "t", "from_peer": "nohost", "max_bytes": 10}).encode()),
        ("/cache/warm", json.dumps({"tenant": "t", "from_peer": "h:1", "max_bytes": -1}).encode()),
        ("/cache/warm", b"\xff\xfe"),
    ]
    for path, body in cases:
        status, text = sc.post(path, body)
        assert 400 <= status < 500, (path, body, status)
        assert b"error" in text
    assert sc.get("/cache/stats?tenant=")[0] == 400
    assert sc.get("/nope")[0] == 404
    assert sc.get("/healthz")[0] == 200 and sc.get("/readyz")[0] == 200


def test_http_fuzz_thousands_of_random_requests_server_keeps_serving(spawn):
    import http.client
    import random

    sc = spawn()
    rng = random.Random(1)
    paths = ["/cache/invalidate", "/cache/warm", "/cache/stats", "/metrics", "/readyz", "/x"]
    statuses = set()
    conn = sc.control.connection(5)
    for i in range(2000):
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
        if i % 3 == 0:
            body = json.dumps({rng.choice(["tenant", "model_version", "from_peer", "max_bytes"]):
                               rng.choice([None, 1, -5, "x", [], {}, "a" * 300])}).encode()
        try:
            conn.request(rng.choice(["POST", "GET", "PUT"]), rng.choice(paths) + rng.choice(["", "?tenant=%ff", "?a=b"]), body)
            resp = conn.getresponse()
            resp.read()
            statuses.add(resp.status)
        except (http.client.HTTPException, OSError):
            conn.close()
            conn = sc.control.connection(5)
    assert not any(s >= 500 for s in statuses), statuses
    assert sc.get("/healthz")[0] == 200 and sc.proc.poll() is None


def test_engine_socket_fuzz_bad_frames_never_take_the_sidecar_down(spawn, oracle):
    import random
    import socket
    import struct

    from kvtier_sidecar.engine_proto import encode

    sc = spawn()
    rng = random.Random(2)
    for i in range(1500):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(2)
        s.connect(sc.socket)
        kind = i % 3
        if kind == 0:
            frame = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
        elif kind == 1:
            frame = encode(rng.randrange(0, 9), i, {rng.choice(["root", "hit", "ticket", "tp"]): rng.choice([1, "x", None, {}, {"tenant": ""}])},
                           np.arange(rng.randrange(0, 5), dtype=np.uint32))
        else:
            frame = struct.pack("<IBII", rng.randrange(1 << 32), 2, i, rng.randrange(1 << 32))
        try:
            s.sendall(frame)
            if kind == 1:
                s.recv(4096)
        except OSError:
            pass
        s.close()
    client = SidecarClient(sc.socket)
    tokens = prompt(64)
    seed_cache(client, oracle, "t", tokens)
    assert client.lookup(oracle.root("t"), tokens)
    assert sc.proc.poll() is None


def test_config_reload_applies_live_fields_and_keeps_the_cache(spawn, oracle):
    sc = spawn(metrics_top_tenants=20)
    client = SidecarClient(sc.socket)
    tokens = prompt(64)
    seed_cache(client, oracle, "t", tokens)
    for i in range(3):
        client.lookup(oracle.root(f"x{i}"), tokens)
    sc.config["metrics_top_tenants"] = 1
    sc.config["dram_capacity_bytes"] = 1 << 20  # needs a restart: logged, not applied
    sc.write_config()

    def reloaded():
        text = sc.get("/metrics")[1].decode()
        return 'tenant="other"' in text
    poll(reloaded, timeout_s=10)
    assert client.lookup(oracle.root("t"), tokens).matched_tokens == 48
    poll(lambda: "dram_capacity_bytes" in sc.log_tail(50))


def test_graceful_shutdown_deregisters_and_unlinks_shared_memory(spawn, oracle, redis_url):
    sc = spawn(redis_url=redis_url)
    client = SidecarClient(sc.socket)
    seed_cache(client, oracle, "t", prompt(64))
    r = redis_sync.Redis.from_url(redis_url)
    poll(lambda: r.zscore("kvt:members", sc.peer) is not None)
    poll(lambda: any(r.scan_iter("kvt:{*")))
    shm = "/dev/shm/" + sc.ready["shm_name"]
    assert os.path.exists(shm)
    client.close()
    assert sc.stop() == 0
    assert r.zscore("kvt:members", sc.peer) is None
    for key in r.scan_iter("kvt:{*"):
        assert not r.hexists(key, sc.peer)
    assert not os.path.exists(shm) and not os.path.exists(sc.socket)


def test_thousand_concurrent_lookups_have_no_errors(spawn, oracle):
    sc = spawn()
    seeder = SidecarClient(sc.socket)
    tokens = prompt(200)
    seed_cache(seeder, oracle, "t", tokens)
    errors, hits = [], []
    barrier = threading.Barrier(50)

    def worker():
        c = SidecarClient(sc.socket)
        barrier.wait()
        for _ in range(20):
            try:
                h = c.lookup(oracle.root("t"), tokens)
                hits.append(h.matched_tokens)
                c.release(h)
            except Exception as exc:  # pragma: no cover - the assertion below reports it
                errors.append(exc)
        c.close()
    threads = [threading.Thread(target=worker) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(hits) == 1000 and set(hits) == {192}


def test_the_engine_socket_names_the_blocks_eviction_took_from_the_removal_log(spawn, oracle):
    """REMOVED: the blocks the DRAM tier removed since a position (the one a store's
    reservation answer carries), by their key-chain hash; every block named no longer
    hits, a position the sidecar never had gets "cannot say", a bad one a refusal and
    the sidecar goes on serving."""
    from kvtier.keys import block_hashes

    sc = spawn(dram_capacity_bytes=8 * BB)
    client = SidecarClient(sc.socket)
    root, tokens = oracle.root("t"), prompt(100)
    seed_cache(client, oracle, "t", tokens)
    start = client.last_store_removals
    assert isinstance(start, int)
    assert client.removed_since(start) == (start, [])
    for seed in range(1, 6):
        seed_cache(client, oracle, "t", prompt(100, seed=seed))
    assert sc.stats()["cache"]["evictions"] > 0
    nxt, removed = client.removed_since(start)
    assert nxt == start + len(removed) and len(set(removed)) == len(removed)
    chain = block_hashes(root, tokens, 16)
    gone = [i for i, h in enumerate(chain) if h in set(removed)]
    assert gone, "filling the arena evicted none of the first prompt's blocks"
    hit = client.lookup(root, tokens)
    assert (hit.matched_tokens if isinstance(hit, EngineHit) else 0) <= gone[0] * 16
    client.release(hit)
    assert client.removed_since(nxt + 1_000_000)[1] is None
    try:
        client.removed_since(-1)
        raise AssertionError("a negative position was taken")
    except ValueError as exc:
        assert "since" in str(exc)
    assert client.removed_since(nxt) is not None and isinstance(client.lookup(root, prompt(100, seed=5)), EngineHit)
