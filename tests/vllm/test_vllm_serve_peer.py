"""`vllm serve` (its own prefix cache on) with a kvtier sidecar on the peer tier: the
prompts are held by another pod's sidecar (stored there by an engine that then
exited), found through the real Redis index and fetched over the real peer tier.

- healthy, every figure of a hit agrees: the connector's loaded tokens, vLLM's own
  external-hit counter and what the sidecar was told, within one block;
- the peer hung (SIGSTOP): 8 concurrent requests finish within 2x their healthy time
  plus the lookup budget, a stream already decoding keeps its pace (its largest gap
  between tokens within 2x the healthy one plus the budget), the peer fetch ends at the
  sidecar's per-fetch deadline as a miss, and every answer equals the recompute."""
from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from kvtier_testenv.fleet import SidecarHandle
from kvtier_testenv.polling import WaitTimeout, wait_for
from kvtier_testenv.tiny_llama import TinyLlama, write_model
from kvtier_testenv.vllm_engine import VllmEngine, connector_config
from kvtier_testenv.vllm_serve import VllmServer, peer_sidecar, sidecar_metric

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow]

SHAPE = TinyLlama()
WEIGHTS = "sha256:" + "b7" * 32
BLOCK = 32
PROMPT_TOKENS = 200
HIT_TOKENS = (PROMPT_TOKENS - 1) // BLOCK * BLOCK
"""What a full hit of a stored prompt gives vLLM: its full blocks, one token left to compute."""
BUDGET_MS = 2000.0
"""The connector's lookup budget: eight healthy lookups with their peer fetches, one
after another on the lookup thread, fit in it on two busy cores; a hung peer's socket
timeout would not."""
PEER_TIMEOUT_S = 0.5
"""The engine sidecar's per-fetch deadline: a hung peer costs a lookup this, then a miss."""
SOCKET_TIMEOUT_S = 5.0
BACKOFF_S = 2.0
CONCURRENT = 8
STREAM_TOKENS = 48


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, SHAPE.vocab) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


HEALTHY, HUNG = _prompts(1, CONCURRENT), _prompts(2, CONCURRENT)
WARMS = [_prompts(3 + i, CONCURRENT) for i in range(3)]
"""The peer holds every set; the engine's sidecar holds none until it fetches them. A
WARM round takes the first peer fetch's costs (the connection, its handshake) out of
the way: on a loaded machine they alone can pass the per-fetch deadline, so up to three
rounds are tried, each with prompts no round has fetched yet."""
HELD = [q for w in WARMS for q in w] + HEALTHY + HUNG
SALT = "peer-tenant"


@dataclass
class Peered:
    server: VllmServer
    peer: SidecarHandle       # holds the prompts (its engine is gone)
    sidecar: SidecarHandle    # the serving engine's own
    baseline: dict[tuple, list[int]]
    rng: random.Random

    def fresh(self) -> list[int]:
        return [self.rng.randrange(3, SHAPE.vocab) for _ in range(PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def peered(tmp_path_factory, redis_server):
    workdir = tmp_path_factory.mktemp("serve-peer")
    if not redis_server.ping():
        redis_server.start()
    redis.Redis.from_url(redis_server.url).flushall()
    secret = workdir / "peer-secret"
    secret.write_text(os.urandom(32).hex())
    model = write_model(workdir / "model", seed=0)
    peer = peer_sidecar(workdir, "serve-peer-a", "127.0.0.2", SHAPE, WEIGHTS, redis_server.url, str(secret))
    sidecar = peer_sidecar(workdir, "serve-peer-b", "127.0.0.3", SHAPE, WEIGHTS, redis_server.url, str(secret),
                           peer_timeout_s=PEER_TIMEOUT_S)
    server = None
    try:
        # Another pod's engine computes the prompts (first sight: the recompute, the
        # answers' baseline) and stores them in its sidecar, then goes away.
        source = VllmEngine(workdir, model, connector_config(peer.socket, WEIGHTS, model_id="tiny-llama",
                                                             block_size=BLOCK), name="peer-source").start()
        try:
            out = source.generate(HELD, salts=[SALT] * len(HELD))
        finally:
            source.close()
        assert out["cached"] == [0] * len(HELD)
        baseline = {tuple(p): toks for p, toks in zip(HELD, out["outputs"])}
        blocks = len(HELD) * (PROMPT_TOKENS // BLOCK)
        wait_for("the peer's blocks stored and in the index",
                 lambda: peer.stats()["cache"]["stored_blocks"] >= blocks
                 and peer.stats()["index"]["counters"].get("registered_blocks", 0) >= blocks, 60)
        ktc = connector_config(sidecar.socket, WEIGHTS, model_id="tiny-llama", block_size=BLOCK,
                               lookup_budget_ms=BUDGET_MS, lookup_timeout_s=SOCKET_TIMEOUT_S,
                               breaker_backoff_s=BACKOFF_S)
        server = VllmServer(workdir, model, ktc, name="peer-b").start()
        yield Peered(server, peer, sidecar, baseline, random.Random(27))
    finally:
        if peer.proc is not None and peer.proc.poll() is None:
            peer.proc.send_signal(signal.SIGCONT)
        if server is not None:
            server.close()
        sidecar.kill()
        peer.kill()


def _round(p: Peered, prompts: list[list[int]], hang: bool) -> dict:
    """A stream decoding, then the CONCURRENT prompts at once (the peer SIGSTOPped
    first when `hang`): how long they took, the stream's largest gap between tokens
    while they ran, and every answer."""
    stream_prompt = p.fresh()
    stream: dict = {}
    streamer = threading.Thread(target=p.server.stream, args=(stream_prompt, "stream", STREAM_TOKENS, stream))
    streamer.start()
    wait_for("the stream decoding", lambda: len(stream.get("times", ())) >= 4, 120, 0.01)
    if hang:
        p.peer.proc.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        answers = list(pool.map(lambda q: p.server.complete(q, SALT), prompts))
    ended = time.monotonic()
    streamer.join(300)
    times = [t for t in stream["times"] if started <= t <= ended] or [ended]
    gaps = [b - a for a, b in zip([started] + times, times + [ended])]
    return {"seconds": ended - started, "max_gap_s": max(gaps), "answers": answers}


def _peer_remembered(p: Peered) -> None:
    """Wait until the engine's sidecar lists the peer among the live members it fetches
    from (after a failed fetch it skips the peer until its next heartbeat)."""
    wait_for("the peer among the sidecar's live members",
             lambda: len(p.sidecar.stats()["index"]["members"] or ()) >= 2, 30, 0.1)


def _warm_up(p: Peered) -> None:
    """Rounds of peer-held prompts until one has every prompt hit and no peer fetch
    failed: the first-use costs are then paid, and the peer is remembered."""
    tried = []
    for prompts in WARMS:
        _peer_remembered(p)
        before = _figures(p)
        answers = _round(p, prompts, hang=False)["answers"]
        d = _delta(_figures(p), before)
        cached = [a["cached"] for a in answers]
        tried.append((cached, d["peer_transport_errors"]))
        if cached == [HIT_TOKENS] * CONCURRENT and d["peer_transport_errors"] == 0:
            return
    pytest.fail(f"no warm-up round fetched every prompt from the peer cleanly: {tried}")


def _figures(p: Peered) -> dict[str, float]:
    """Every party's count of what the engine loaded and looked up."""
    m = p.server.metrics()
    stats = p.sidecar.stats()
    return {"connector_loaded": m.get("vllm:kvtier_loaded_tokens_dram_total", 0)
            + m.get("vllm:kvtier_loaded_tokens_peer_total", 0),
            "connector_peer": m.get("vllm:kvtier_loaded_tokens_peer_total", 0),
            "connector_prompt": m.get("vllm:kvtier_prompt_tokens_total", 0),
            "vllm_external": m.get("vllm:external_prefix_cache_hits_total", 0),
            "vllm_prompt": m.get("vllm:prompt_tokens_total", 0),
            "sidecar_loaded": sum(stats["engine"]["loaded_tokens_by_tier"].values()),
            "sidecar_peer": stats["engine"]["loaded_tokens_by_tier"]["peer"],
            "sidecar_prompt": stats["engine"]["prompt_tokens"],
            "lookup_timeouts": m.get("vllm:kvtier_lookup_timeouts_total", 0),
            "peer_transport_errors": _transport_errors(p),
            "sidecar_lookups": stats["lookups"]}


def _transport_errors(p: Peered) -> float:
    return sidecar_metric(p.sidecar, "kvtier_peer_errors_total", reason="transport")


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def test_a_hung_peer_costs_requests_a_miss_at_the_fetch_deadline_never_the_engine(peered):
    p = peered
    budget_s = BUDGET_MS / 1000
    _warm_up(p)  # first-use costs out of the way, the peer's too

    _peer_remembered(p)
    before = _figures(p)
    healthy = _round(p, HEALTHY, hang=False)
    # the sidecar hears of loads off the request path: wait until it has them all
    seen: list[dict] = []

    def told() -> bool:
        seen[:] = [d := _delta(_figures(p), before)]
        return d["sidecar_loaded"] >= d["connector_loaded"] > 0
    try:
        wait_for("the sidecar told of every load", told, 30, 0.2)
    except WaitTimeout as e:
        raise AssertionError(f"{e}: {seen}") from None
    d = _delta(_figures(p), before)
    assert [a["tokens"] for a in healthy["answers"]] == [p.baseline[tuple(q)] for q in HEALTHY]
    assert [a["cached"] for a in healthy["answers"]] == [HIT_TOKENS] * CONCURRENT
    # One hit figure, read three ways, agrees within one block: what the workers
    # loaded, what vLLM counts as external hits, what the sidecar was told; all of it
    # came over the peer tier, and the prompts looked up agree the same way.
    assert d["connector_peer"] == d["connector_loaded"] and abs(d["connector_loaded"] - CONCURRENT * HIT_TOKENS) < BLOCK
    assert abs(d["vllm_external"] - d["connector_loaded"]) < BLOCK
    assert abs(d["sidecar_loaded"] - d["connector_loaded"]) < BLOCK and d["sidecar_peer"] == d["sidecar_loaded"]
    assert abs(d["sidecar_prompt"] - d["connector_prompt"]) < BLOCK
    assert abs(d["connector_prompt"] - d["vllm_prompt"]) < BLOCK

    before = _figures(p)
    try:
        hung = _round(p, HUNG, hang=True)
        # The engine's answers may come first (its lookup budget is the shorter): the
        # sidecar's fetches from the still-stopped peer end at their own deadline,
        # which a loaded machine reaches later. Continued before that, the peer would
        # serve them after all.
        wait_for("the fetches from the hung peer to end at their deadline",
                 lambda: _transport_errors(p) > before["peer_transport_errors"], 60)
    finally:
        p.peer.proc.send_signal(signal.SIGCONT)
    d = _delta(_figures(p), before)
    print(f"\n{CONCURRENT} peer-held prompts: healthy {healthy['seconds']:.3f} s, peer hung {hung['seconds']:.3f} s; "
          f"stream's largest gap: healthy {healthy['max_gap_s']:.3f} s, hung {hung['max_gap_s']:.3f} s; "
          f"budget {budget_s} s, per-fetch deadline {PEER_TIMEOUT_S} s; {d}")
    assert hung["seconds"] <= 2 * healthy["seconds"] + budget_s, (hung["seconds"], healthy["seconds"])
    assert hung["max_gap_s"] <= 2 * healthy["max_gap_s"] + budget_s, (hung["max_gap_s"], healthy["max_gap_s"])
    # answers equal the recompute; nothing came from kvtier while the peer was hung
    assert [a["tokens"] for a in hung["answers"]] == [p.baseline[tuple(q)] for q in HUNG]
    assert [a["cached"] for a in hung["answers"]] == [0] * CONCURRENT
    assert d["connector_loaded"] == 0
    # the per-fetch deadline made it a miss: the sidecar's fetch from the hung peer
    # ended (a transport error), and it answered that lookup itself, in the budget
    assert d["peer_transport_errors"] >= 1 and d["sidecar_lookups"] >= 1
    assert d["lookup_timeouts"] < CONCURRENT

    # kvtier still serves this engine: a prompt fetched in the healthy round is now in
    # its own sidecar's DRAM, and comes from there once vLLM's cache forgets it
    p.server.reset_prefix_cache()
    again = p.server.complete(HEALTHY[0], SALT)
    assert again == {**again, "tokens": p.baseline[tuple(HEALTHY[0])], "cached": HIT_TOKENS}
