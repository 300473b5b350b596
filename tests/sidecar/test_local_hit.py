"""A lookup carries the engine's own prefix-cache hit (`local_tokens`): the sidecar
fetches from a peer only a prefix longer than it, so a prompt the engine already
holds costs no peer bytes. Real sidecars, real Redis, the real peer tier."""
import numpy as np
import redis as redis_sync

from kvtier.keys import block_hashes
from kvtier_sidecar.client import Hit, SidecarClient

from .test_sidecar_process import poll, prompt, seed_cache

BB = 8192
BLOCK = 16


def _peer_bytes(sidecar) -> int:
    return sidecar.stats("acme")["peer_bytes_fetched"]


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
    assert isinstance(half, Hit) and half.tier == "peer" and half.matched_tokens == 192
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
