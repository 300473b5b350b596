"""A lookup carries the engine's own prefix-cache hit (`local_tokens`): the sidecar
fetches from a peer only a prefix longer than it, so a prompt the engine already
holds costs no peer bytes. Real sidecars, real Redis, the real peer tier."""
import re

import numpy as np
import redis as redis_sync

from kvtier.keys import block_hashes
from kvtier_sidecar.client import EngineHit, SidecarClient
from kvtier_testenv import engine_io

from .test_sidecar_process import poll, prompt, seed_cache

BB = 8192
BLOCK = 16


def _peer_bytes(sidecar) -> int:
    return sidecar.stats("acme")["peer_bytes_fetched"]


def _served(sidecar) -> dict[str, float]:
    """kvtier_served_bytes_total by tier, summed over tenants."""
    status, body = sidecar.get("/metrics")
    assert status == 200
    out = {"dram": 0.0, "peer": 0.0}
    for m in re.finditer(r'^kvtier_served_bytes_total\{[^}]*tier="(\w+)"[^}]*\} (\S+)$', body.decode(), re.M):
        out[m.group(1)] += float(m.group(2))
    return out


def test_a_prompt_the_engine_holds_itself_costs_no_peer_bytes(spawn, oracle, redis_url, secret_file):
    a = spawn("a", "127.0.0.2", redis_url, secret_file)
    b = spawn("b", "127.0.0.3", redis_url, secret_file)
    ca, cb = SidecarClient(a.socket), SidecarClient(b.socket)
    root, tokens = oracle.root("acme"), prompt(200)
    seed_cache(ca, oracle, "acme", tokens)
    last = block_hashes(root, tokens, BLOCK)[-1].hex()
    index = redis_sync.Redis.from_url(redis_url)
    poll(lambda: index.hexists(f"kvt:{{{root.digest().hex()}}}:{last}", a.peer))

    # the engine's cache covers every full block but the last token's: nothing to fetch
    covered = cb.lookup(root, tokens, local_tokens=192)
    assert not covered and _peer_bytes(b) == 0
    # it holds half: the peer holds more, so the whole prefix comes over (the sidecar's
    # tier keeps prefixes whole) and is offered
    half = cb.lookup(root, tokens, local_tokens=96)
    assert isinstance(half, EngineHit) and half.tier == "peer" and half.matched_tokens == 192
    assert _peer_bytes(b) == 12 * BB
    dst = np.zeros(12 * BB, np.uint8)
    cb.materialize(half, dst)
    assert np.array_equal(dst, oracle.kv(root, tokens)[: 12 * BB])
    cb.release(half)


def test_local_tokens_past_the_prompt_are_refused_and_the_connection_serves_on(spawn, oracle):
    sc = spawn("a", "127.0.0.2")
    client = SidecarClient(sc.socket)
    root, tokens = oracle.root("acme"), prompt(64)
    try:
        client.lookup(root, tokens, local_tokens=65)
    except ValueError as exc:
        assert "local_tokens" in str(exc)
    else:
        raise AssertionError("a local hit longer than the prompt was accepted")
    assert not client.lookup(root, tokens, local_tokens=64)  # the same connection still answers


def test_a_partly_local_hit_counts_its_local_blocks_as_dram_and_only_the_rest_as_peer(
        spawn, oracle, redis_url, secret_file):
    """b holds the prompt's first 6 blocks, a all 12: b's lookup fetches blocks 6..11
    from a. The hit is a "peer" hit whose first 96 tokens were b's own: offered tokens,
    served bytes and (as the engine reports them) loaded tokens count 96 under dram and
    only 96 under peer."""
    a = spawn("a", "127.0.0.2", redis_url, secret_file)
    b = spawn("b", "127.0.0.3", redis_url, secret_file)
    ca, cb = SidecarClient(a.socket), SidecarClient(b.socket)
    root, tokens = oracle.root("acme"), prompt(200)
    seed_cache(ca, oracle, "acme", tokens)
    seed_cache(cb, oracle, "acme", tokens[:96])
    last = block_hashes(root, tokens, BLOCK)[-1].hex()
    index = redis_sync.Redis.from_url(redis_url)
    poll(lambda: index.hexists(f"kvt:{{{root.digest().hex()}}}:{last}", a.peer))
    peer_before = _peer_bytes(b)
    own = cb.lookup(root, tokens[:100])
    assert own.tier == "dram" and own.matched_tokens == 96  # b holds 6 blocks itself
    cb.release(own)
    before, served_before = b.stats("acme"), _served(b)

    hit = cb.lookup(root, tokens)
    assert isinstance(hit, EngineHit) and hit.tier == "peer" and hit.matched_tokens == 192 and hit.dram_tokens == 96
    assert hit.split(0, 192) == {"dram": 96, "peer": 96}
    assert hit.split(64, 160) == {"dram": 32, "peer": 64}
    assert _peer_bytes(b) - peer_before == 6 * BB  # only the blocks b lacked came over
    assert engine_io.report(cb, len(tokens), hit, len(hit.blocks), BB)
    cb.release(hit)

    after = b.stats("acme")
    offered = {t: after["hit_tokens_by_tier"][t] - before["hit_tokens_by_tier"][t] for t in ("dram", "peer")}
    served = {t: _served(b)[t] - served_before[t] for t in ("dram", "peer")}
    assert offered == {"dram": 96, "peer": 96} and served == {"dram": 6 * BB, "peer": 6 * BB}
    assert after["hits_by_tier"]["peer"] - before["hits_by_tier"]["peer"] == 1  # the request needed the peer
    assert b.stats()["engine"]["loaded_tokens_by_tier"] == {"dram": 96, "peer": 96}
