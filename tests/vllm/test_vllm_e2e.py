"""Real vLLM (CPU build) engines with KvtierConnector, real sidecars, real Redis.

Every answer is checked against a reference engine without the connector (greedy
token ids, a tiny Llama with seeded random weights, so the KV decides the output).
Engine launches are few and shared: a reference engine, A (stores), B (a fresh
engine that loads, kept for the fault tests), C (checksums on; tenants), D (another
weights version) and E (another pod: the peer tier). vLLM's own prefix cache is off
in every engine, so each cached token vLLM reports came through the connector.
"""
from __future__ import annotations

import os
import random
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import redis

from kvtier.sidecar_config import ServedModel
from kvtier_sidecar.arena import Arena
from kvtier_testenv.fleet import SidecarHandle, fleet_tls
from kvtier_testenv.polling import wait_for
from kvtier_testenv.tiny_llama import TinyLlama, write_model
from kvtier_testenv.vllm_engine import VllmEngine, connector_config, sidecar_model

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow]

SHAPE = TinyLlama()
# These tests check what is served, not how fast: a lookup (with its peer fetch) gets
# far longer than in production before it counts as a miss (budget and socket
# timeout), so a machine busy starting vLLM engines does not turn a hit the test
# expects into a miss.
LOOKUP_TIMEOUT_S = 20.0
OVERLAP_LOG = "loads now overlap the forward pass layer by layer"
"""What the connector logs once vLLM showed that every layer waits for its load."""
BLOCK = 32
WEIGHTS = "sha256:" + "5e" * 32
OTHER_WEIGHTS = "sha256:" + "77" * 32
POLL_S = 60.0


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(10)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, SHAPE.vocab) for _ in range(n)]

    p = tokens(230)
    prompts = {"P": p, "P_MORE": p + tokens(70), "DIVERGE": p[:100] + tokens(130),
               "Q": tokens(200), "X": tokens(200)}
    for i in range(6):
        prompts[f"BATCH{i}"] = tokens(260)
    return prompts


PROMPTS = _prompts()
BATCH = [f"BATCH{i}" for i in range(6)]


def _hit(name: str) -> int:
    """Tokens a full hit of a stored prompt offers: its full blocks, one token left to compute."""
    return (len(PROMPTS[name]) - 1) // BLOCK * BLOCK


@dataclass
class World:
    workdir: Path
    model: Path
    redis_url: str
    sidecars: dict[str, SidecarHandle] = field(default_factory=dict)
    engines: list[VllmEngine] = field(default_factory=list)
    reference: dict[str, list[int]] = field(default_factory=dict)
    b: VllmEngine | None = None
    c: VllmEngine | None = None

    def engine(self, name: str, sidecar: str, **extra) -> VllmEngine:
        weights = extra.pop("weights_version", WEIGHTS)
        extra.setdefault("lookup_timeout_s", LOOKUP_TIMEOUT_S)
        extra.setdefault("lookup_budget_ms", LOOKUP_TIMEOUT_S * 1000)
        cfg = connector_config(self.sidecars[sidecar].socket, weights, model_id="tiny-llama", block_size=BLOCK,
                               **extra)
        eng = VllmEngine(self.workdir, self.model, cfg, name=name)
        self.engines.append(eng)
        return eng.start()

    def ask(self, eng: VllmEngine, names: list[str], salt: str | None = None) -> dict:
        return eng.generate([PROMPTS[n] for n in names], salts=[salt] * len(names))


def _sidecar(workdir: Path, name: str, ip: str, redis_url: str, secret: str) -> SidecarHandle:
    cfg = {"pod_name": name, "pod_namespace": "kvtier-vllm", "pod_ip": ip, "http_port": 0, "peer_port": 0,
           "engine_socket": str(workdir / f"{name}.sock"), "model": sidecar_model(SHAPE, WEIGHTS), "block_size": BLOCK,
           "dram_capacity_bytes": 64 << 20, "min_sightings": 1, "redis_url": redis_url,
           "peer_secret_file": secret, "peer_timeout_s": 15.0, "log_level": "WARNING",
           # No API server here to review tokens: the control API is open on loopback.
           "control_auth": {"mode": "open"}, "control_tls": fleet_tls(workdir).config()}
    return SidecarHandle(name, ip, workdir, cfg).start()


@pytest.fixture(scope="module")
def world(tmp_path_factory, redis_server):
    workdir = tmp_path_factory.mktemp("vllm")
    if not redis_server.ping():
        redis_server.start()
    redis.Redis.from_url(redis_server.url).flushall()
    secret = workdir / "peer-secret"
    secret.write_text(os.urandom(16).hex())
    w = World(workdir, write_model(workdir / "model", seed=0), redis_server.url)
    try:
        w.sidecars["s1"] = _sidecar(workdir, "s1", "127.0.0.2", w.redis_url, str(secret))
        w.sidecars["s3"] = _sidecar(workdir, "s3", "127.0.0.3", w.redis_url, str(secret))
        ref = VllmEngine(workdir, w.model, None, name="reference").start()
        w.engines.append(ref)
        names = list(PROMPTS)
        out = ref.generate([PROMPTS[n] for n in names])
        ref.close()
        w.reference = dict(zip(names, out["outputs"]))
        assert all(c == 0 for c in out["cached"])
        yield w
    finally:
        for eng in w.engines:
            eng.close()
        for h in w.sidecars.values():
            h.kill()


def _metric(sidecar: SidecarHandle, name: str, **labels) -> float:
    status, body = sidecar.get("/metrics")
    assert status == 200
    total = 0.0
    for line in body.decode().splitlines():
        m = re.match(rf"^{name}{{([^}}]*)}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_fresh_engine_serves_prefix_stored_by_another_with_identical_outputs(world):
    a = world.engine("a", "s1")
    got = world.ask(a, ["P"])
    assert got["outputs"] == [world.reference["P"]] and got["cached"] == [0]
    # stores reach the sidecar off the forward pass: wait for them before A goes
    wait_for("A's prompt stored",
             lambda: world.sidecars["s1"].stats()["cache"]["stored_blocks"] >= len(PROMPTS["P"]) // BLOCK, POLL_S)
    a.close()

    world.b = b = world.engine("b", "s1")
    for name, cached in (("P", _hit("P")), ("P_MORE", _hit("P")), ("DIVERGE", 100 // BLOCK * BLOCK)):
        got = world.ask(b, [name])
        assert got["outputs"] == [world.reference[name]], name
        assert got["cached"] == [cached], name
    assert _metric(world.sidecars["s1"], "kvtier_prefix_cache_hits_total", tier="dram") >= 2 * _hit("P")
    # the first pass showed vLLM asks before every layer: the later hits (P_MORE,
    # DIVERGE, identical outputs above) were loaded layer by layer during the pass
    wait_for("loads overlapping the forward pass", lambda: OVERLAP_LOG in (world.workdir / "b.log").read_text(),
             POLL_S)


def _arena(sidecar: SidecarHandle) -> Arena:
    hello = sidecar.ready
    block_bytes = ServedModel(**sidecar_model(SHAPE)).kv_bytes_per_token() * BLOCK
    return Arena.attach(hello["shm_name"], sidecar.config["dram_capacity_bytes"] // block_bytes * block_bytes,
                        block_bytes)


def _index_entries(url: str) -> int:
    return sum(1 for _ in redis.Redis.from_url(url).scan_iter("kvt:*"))


def test_corrupted_blocks_change_the_output_and_with_checksums_are_a_miss(world):
    b, s1 = world.b, world.sidecars["s1"]
    arena = _arena(s1)
    before = arena.array.copy()
    indexed = _index_entries(world.redis_url)
    assert world.ask(b, ["Q"])["outputs"] == [world.reference["Q"]]
    n_blocks = len(PROMPTS["Q"]) // BLOCK
    # the index learns blocks after their checksums are computed: only then corrupt
    wait_for("Q's blocks indexed", lambda: _index_entries(world.redis_url) >= indexed + n_blocks, POLL_S)
    changed = np.flatnonzero((arena.array != before).reshape(-1, arena.block_bytes).any(axis=1))
    assert len(changed) == n_blocks
    noise = np.random.default_rng(3).standard_normal(arena.block_bytes // 4).astype(np.float32) * 50
    for slot in changed:
        arena.slot_array(int(slot)).view(np.float32)[:] = noise

    # negative control: the loaded KV is what the engine attends to
    corrupted = world.ask(b, ["Q"])
    assert corrupted["cached"] == [_hit("Q")]
    assert corrupted["outputs"] != [world.reference["Q"]]

    c = world.engine("c", "s1", verify_checksums=True)
    # one intact load first: its pass shows vLLM asks before every layer, so the loads
    # below run layer by layer during the forward pass
    warm = world.ask(c, ["P_MORE"])  # stored whole by B in the first test
    assert warm["outputs"] == [world.reference["P_MORE"]] and warm["cached"] == [_hit("P_MORE")]
    wait_for("c's loads overlapping the pass", lambda: OVERLAP_LOG in (world.workdir / "c.log").read_text(), POLL_S)
    names = ("kvtier_engine_load_errors_total", "kvtier_engine_loaded_bytes_total", "kvtier_engine_loaded_tokens_total")
    reported = {n: _metric(s1, n) for n in names}
    got = world.ask(c, ["Q", "P"])
    assert got["outputs"] == [world.reference["Q"], world.reference["P"]]
    assert got["cached"][1] == _hit("P")  # intact blocks still load with checksums on
    # The connector's KVConnectorStats counts, as it reported them to the sidecar's
    # /metrics (sent off the forward pass, so polled): Q's blocks were handed back to
    # vLLM as load errors and recomputed, P's bytes and tokens loaded.
    wait_for("the load errors reported", lambda: _metric(s1, names[0]) - reported[names[0]] == _hit("Q") // BLOCK,
             POLL_S)
    wait_for("the loaded bytes reported", lambda: _metric(s1, names[1]) - reported[names[1]]
             == _hit("P") // BLOCK * arena.block_bytes, POLL_S)
    assert _metric(s1, names[2]) - reported[names[2]] == _hit("P")
    world.c = c


def test_tenants_never_share_blocks(world):
    c = world.c
    first = world.ask(c, ["X"], salt="tenant-a")
    assert first["outputs"] == [world.reference["X"]] and first["cached"] == [0]
    other = world.ask(c, ["X"], salt="tenant-b")
    assert other["outputs"] == [world.reference["X"]] and other["cached"] == [0]
    again = world.ask(c, ["X"], salt="tenant-a")
    assert again["outputs"] == [world.reference["X"]] and again["cached"] == [_hit("X")]
    c.close()


def test_an_engine_serving_other_weights_than_its_sidecar_is_refused_loudly_and_never_hits(world):
    """D serves OTHER_WEIGHTS next to s1, configured for WEIGHTS: the connector uses
    none of s1 (nothing would be counted under the wrong version), says so naming both
    digests, and counts it; every answer is the recompute."""
    s1 = world.sidecars["s1"]
    lookups = s1.stats()["lookups"]
    d = world.engine("d", "s1", weights_version=OTHER_WEIGHTS)
    got = world.ask(d, ["P", "Q"])
    assert got["outputs"] == [world.reference["P"], world.reference["Q"]]
    assert got["cached"] == [0, 0]
    assert s1.stats()["lookups"] == lookups  # never asked
    log = d.log_text()
    assert "serving WITHOUT kvtier" in log and OTHER_WEIGHTS in log and WEIGHTS in log
    d.close()


def test_second_pod_hits_over_the_peer_tier_found_in_the_redis_index(world):
    s3 = world.sidecars["s3"]
    e = world.engine("e", "s3")
    got = world.ask(e, ["P"])
    assert got["outputs"] == [world.reference["P"]] and got["cached"] == [_hit("P")]
    assert s3.stats()["hits_by_tier"]["peer"] >= 1
    assert _metric(s3, "kvtier_peer_fetched_bytes_total") > 0
    e.close()


def test_sidecar_killed_between_requests_and_mid_load_answers_equal_recompute(world):
    b, s1 = world.b, world.sidecars["s1"]
    s1.kill()
    gone = world.ask(b, ["P_MORE"])
    assert gone["outputs"] == [world.reference["P_MORE"]] and gone["cached"] == [0]

    s1.start()  # a new sidecar instance: empty arena, new shared-memory segment
    ask_until_hit = lambda: world.ask(b, ["P"])  # noqa: E731 (first asks store, or back off)
    results = []
    wait_for("B hits the restarted sidecar",
             lambda: results.append(ask_until_hit()) or results[-1]["cached"] == [_hit("P")], POLL_S)
    assert all(r["outputs"] == [world.reference["P"]] for r in results)

    stored = world.ask(b, BATCH)  # store the batch, then kill the sidecar while it loads
    assert stored["outputs"] == [world.reference[n] for n in BATCH]
    lookups = s1.stats()["lookups"]
    box = {}
    worker = threading.Thread(target=lambda: box.setdefault("out", world.ask(b, BATCH)))
    worker.start()
    wait_for("the batch's first lookups", lambda: s1.stats()["lookups"] > lookups, POLL_S)
    s1.kill()
    worker.join(300)
    out = box["out"]
    assert out["outputs"] == [world.reference[n] for n in BATCH]
    s1.start()
