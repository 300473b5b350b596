"""The rollout's warm-up requests (LOOKUP purpose "warmup", `kvtier.names.WARMUP_PURPOSE`)
are counted apart from traffic: a warm-up lookup moves the warm-up counters and none of
the traffic's (the tenants' lookups and hits, `kvtier_lookups_total`, the engine's hit
figure), while what its prefill stores is stored and served to the traffic that follows.
A lookup with no purpose (an older engine) or one the sidecar does not know is traffic,
and its message is the plain LOOKUP's, byte for byte. The operator's reading of these
stats (the recovery check's and the first minute's hit figure) is the traffic's alone.
A real sidecar process, the real engine socket."""
import json
import re

import numpy as np

from kvtier import names
from kvtier_sidecar.client import EngineHit, SidecarClient, root_payload
from kvtier_operator import rollout
from kvtier_operator.sidecar_client import parse_stats
from kvtier_testenv import engine_io

from .test_sidecar_process import prompt

BB = 8192
BLOCK = 16


def _metric(body: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    total = 0.0
    for m in re.finditer(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", body, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _metrics(sc) -> str:
    status, body = sc.get("/metrics")
    assert status == 200
    return body.decode()


def _traffic(stats: dict) -> tuple:
    """Every traffic figure a hit rate is read from: lookups and hits (the alarm's sample
    size, offered), and the engine's reported loads over prompt tokens."""
    engine = stats["engine"]
    return (stats["lookups"], stats["hits"], stats["lookup_tokens"], sum(stats["hit_tokens_by_tier"].values()),
            engine["prompt_tokens"], sum(engine["loaded_tokens_by_tier"].values()))


def test_a_warmup_miss_moves_only_the_warmup_counters_and_its_store_serves_the_next_traffic(spawn, oracle):
    sc = spawn()
    client = SidecarClient(sc.socket)
    root, tokens = oracle.root("acme"), prompt(200)

    # the warm-up's request, as the reference engine (and the connector) make it: a
    # miss (the pod is cold), not reported, its prefill stored
    hit, _ = engine_io.request(client, root, tokens, BB, warmup=True)
    assert not hit
    assert client.store(root, tokens, oracle.kv(root, tokens))

    stats = sc.stats()
    assert _traffic(stats) == (0, 0, 0, 0, 0, 0), "a warm-up lookup was counted as traffic"
    assert stats["sidecar"]["warmup_lookups"] == 1
    assert stats["sidecar"]["warmup_tokens_miss"] == 200
    assert stats["sidecar"].get("warmup_tokens_hit", 0) == 0
    assert stats["stores"] == 1  # the point of warming: the prefill is stored
    text = _metrics(sc)
    assert _metric(text, "kvtier_lookups_total") == 0
    assert _metric(text, "kvtier_prefix_cache_queries_total") == 0
    assert _metric(text, "kvtier_engine_prompt_tokens_total") == 0
    assert _metric(text, "kvtier_warmup_lookups_total") == 1
    assert _metric(text, "kvtier_warmup_tokens_total", result="miss") == 200
    assert _metric(text, "kvtier_warmup_tokens_total", result="hit") == 0

    # the first traffic request (no purpose: what every engine sends) hits what the
    # warm-up stored, and is counted as traffic
    hit, loaded = engine_io.request(client, root, tokens, BB)
    assert isinstance(hit, EngineHit) and hit.matched_tokens == 192
    assert np.array_equal(loaded, oracle.kv(root, tokens)[: 12 * BB])
    client.release(hit)
    stats = sc.stats()
    assert _traffic(stats) == (1, 1, 200, 192, 200, 192)
    assert stats["sidecar"]["warmup_lookups"] == 1  # unchanged by traffic
    # The operator's hit figure for this warmed pod: the traffic's 192 of 200 tokens,
    # not 192 of the 400 the warm-up's miss would make it.
    read = parse_stats("llm-3", stats)
    sample = rollout.PodSample("llm-3", "v2", True, read.lookups, read.loaded_tokens, read.prompt_tokens)
    assert (sample.lookups, rollout.hit_rate([sample]).rate) == (1, 0.96)

    # a warm-up that finds its prompt cached (a restarted operator warming again): a
    # warm-up hit, still none of the traffic's
    again = client.lookup(root, tokens, purpose=names.WARMUP_PURPOSE)
    assert isinstance(again, EngineHit) and again.matched_tokens == 192
    client.release(again)
    stats = sc.stats()
    assert _traffic(stats) == (1, 1, 200, 192, 200, 192)
    assert stats["sidecar"]["warmup_lookups"] == 2
    assert stats["sidecar"]["warmup_tokens_hit"] == 192
    text = _metrics(sc)
    assert _metric(text, "kvtier_lookups_total") == 1
    assert _metric(text, "kvtier_warmup_tokens_total", result="hit") == 192


def test_a_purpose_the_sidecar_does_not_know_is_traffic_and_a_malformed_one_is_refused(spawn, oracle):
    sc = spawn()
    client = SidecarClient(sc.socket)
    root, tokens = oracle.root("acme"), prompt(64)
    # What goes on the wire: a lookup without a purpose is the plain root-only payload
    # (the sidecar's fast path), byte for byte; one with a purpose names it.
    sent = []
    call = client._call_lookup
    client._call_lookup = lambda payload, ids: sent.append(payload) or call(payload, ids)
    assert not client.lookup(root, tokens)
    assert not client.lookup(root, tokens, purpose=names.WARMUP_PURPOSE)
    client._call_lookup = call
    assert sent[0] == json.dumps({"root": root_payload(root)}, separators=(",", ":")).encode()
    assert sent[1] == {"root": root_payload(root), names.PURPOSE_FIELD: names.WARMUP_PURPOSE}
    assert sc.stats()["lookups"] == 1
    assert not client.lookup(root, tokens, purpose="some-later-purpose")
    stats = sc.stats()
    assert stats["lookups"] == 2 and stats["sidecar"].get("warmup_lookups", 0) == 1
    try:
        client._call_lookup({"root": root_payload(root), names.PURPOSE_FIELD: 1}, tokens)
    except ValueError as exc:
        assert names.PURPOSE_FIELD in str(exc)
    else:
        raise AssertionError("a purpose that is not a string was accepted")
    assert not client.lookup(root, tokens)  # the same connection still answers
    assert sc.stats()["lookups"] == 3
