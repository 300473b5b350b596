"""The peer-pull hint (a router's "this pod holds the prefix", the LOOKUP's
`source_peer`): the sidecar asks the hinted peer first when it is a member of its own
fleet, and what that peer sends is verified as any peer's. Real sidecar processes, a
real redis-server, the real engine socket and peer transport.

The prompts the hint must find have their global-index entries removed, so only the
hint can lead the sidecar to the peer that holds them: a sidecar that ignored the hint
would miss them."""
from __future__ import annotations

import socket

import numpy as np
import pytest
import redis as redis_sync
from prometheus_client.parser import text_string_to_metric_families

from kvtier.keys import block_hashes
from kvtier_sidecar.client import EngineHit, Miss, SidecarClient, root_payload
from kvtier_sidecar.peer_hint import HintedPeers

from .proxy import FaultyProxy
from .test_sidecar_process import poll, prompt, seed_cache

BB = 8192
BLOCK = 16
OUTCOMES = ("used", "unknown", "miss", "failed")


def hints(sc) -> dict[str, float]:
    """`kvtier_peer_hint_total` by outcome."""
    status, body = sc.get("/metrics")
    assert status == 200
    got = {s.labels["outcome"]: s.value for f in text_string_to_metric_families(body.decode())
           for s in f.samples if s.name == "kvtier_peer_hint_total"}
    assert set(got) == set(OUTCOMES), got
    return got


def counted(sc, before: dict[str, float], **delta: int) -> None:
    after = hints(sc)
    assert {o: after[o] - before[o] for o in OUTCOMES} == {o: delta.get(o, 0) for o in OUTCOMES}


def block_keys(root, tokens) -> list[str]:
    tag = root.digest().hex()
    return [f"kvt:{{{tag}}}:{h.hex()}" for h in block_hashes(root, tokens, BLOCK)]


def stored_and_indexed(client, index, oracle, tenant: str, tokens, host: str) -> None:
    seed_cache(client, oracle, tenant, tokens)
    poll(lambda: index.hexists(block_keys(oracle.root(tenant), tokens)[-1], host))


def unindexed(index, root, tokens) -> None:
    """Remove the prompt's global-index entries: no holder can be found through Redis."""
    index.delete(*block_keys(root, tokens))


def known_member(client, sc, root, peer: str) -> None:
    """Wait until `sc` takes `peer` as a member of its fleet (its member list is as of its
    last heartbeat): a hinted lookup of a prompt no one holds is then a `miss`, not
    `unknown`."""
    nobody = prompt(40, seed=99)
    poll(lambda: client.lookup(root, nobody, source_peer=peer) is not None and hints(sc)["miss"] >= 1)


def materialized(client, hit, n_blocks: int) -> np.ndarray:
    dst = np.zeros(n_blocks * BB, np.uint8)
    client.materialize(hit, dst)
    client.release(hit)
    return dst


def test_the_hinted_member_serves_what_the_index_cannot_find_and_other_hints_change_nothing(
        spawn, oracle, redis_url, secret_file):
    a = spawn("a", "127.0.0.2", redis_url, secret_file)
    b = spawn("b", "127.0.0.3", redis_url, secret_file)
    ca, cb = SidecarClient(a.socket), SidecarClient(b.socket)
    index = redis_sync.Redis.from_url(redis_url)
    root = oracle.root("acme")
    indexed, hidden, by_host = prompt(200, seed=1), prompt(200, seed=2), prompt(200, seed=3)
    for tokens in (indexed, hidden, by_host):
        stored_and_indexed(ca, index, oracle, "acme", tokens, a.peer)
    for tokens in (hidden, by_host):
        unindexed(index, root, tokens)
    assert isinstance(cb.lookup(root, hidden), Miss), "without the hint nothing finds the peer"
    known_member(cb, b, root, a.peer)
    before = hints(b)

    # The hint names A: its blocks, exactly as stored, and no index entry led there.
    hit = cb.lookup(root, hidden, source_peer=a.peer)
    assert isinstance(hit, EngineHit) and hit.tier == "peer" and hit.matched_tokens == 192
    assert np.array_equal(materialized(cb, hit, 12), oracle.kv(root, hidden)[: 12 * BB])
    counted(b, before, used=1)

    # The router names a pod by its engine's port, not its sidecar's: A's host alone
    # matches exactly one member.
    before = hints(b)
    hit = cb.lookup(root, by_host, source_peer=a.peer.rsplit(":", 1)[0] + ":8000")
    assert isinstance(hit, EngineHit) and hit.tier == "peer" and hit.matched_tokens == 192
    assert np.array_equal(materialized(cb, hit, 12), oracle.kv(root, by_host)[: 12 * BB])
    counted(b, before, used=1)

    # A hint naming no member (nor this sidecar itself) is not dialled: the lookup is
    # the plain one, served through the index as before.
    before = hints(b)
    assert isinstance(cb.lookup(root, prompt(60, seed=7), source_peer=b.peer), Miss)
    hit = cb.lookup(root, indexed, source_peer="10.9.9.9:7400")
    assert isinstance(hit, EngineHit) and hit.tier == "peer" and hit.matched_tokens == 192
    assert np.array_equal(materialized(cb, hit, 12), oracle.kv(root, indexed)[: 12 * BB])
    counted(b, before, unknown=2)

    # A lookup the local tier answers never reaches the hint; a hint that is not a
    # string is refused, and the connection keeps serving.
    before = hints(b)
    assert cb.lookup(root, hidden, source_peer="10.9.9.9:7400").tier == "dram"
    counted(b, before)
    with pytest.raises(ValueError, match="source_peer must be a string"):
        cb._call_lookup({"root": root_payload(root), "source_peer": 7}, hidden)
    assert cb.lookup(root, hidden).tier == "dram"


def test_a_hinted_peer_serving_wrong_bytes_is_a_miss_never_wrong_kv(spawn, oracle, redis_url, secret_file):
    with socket.create_server(("127.0.0.2", 0)) as probe:
        peer_port = probe.getsockname()[1]
    proxy = FaultyProxy(f"127.0.0.2:{peer_port}", flip_at=4000)
    # `a` advertises the proxy: every peer fetch from it crosses the corrupting wire.
    a = spawn("a", "127.0.0.2", redis_url, secret_file, peer_port=peer_port, peer_advertise=proxy.address)
    b = spawn("b", "127.0.0.3", redis_url, secret_file)
    ca, cb = SidecarClient(a.socket), SidecarClient(b.socket)
    index = redis_sync.Redis.from_url(redis_url)
    root, tokens = oracle.root("t"), prompt(120)
    stored_and_indexed(ca, index, oracle, "t", tokens, proxy.address)
    unindexed(index, root, tokens)
    known_member(cb, b, root, proxy.address)
    before, mismatches = hints(b), b.stats()["sidecar"].get("peer_checksum_mismatches", 0)

    assert isinstance(cb.lookup(root, tokens, source_peer=proxy.address), Miss)
    counted(b, before, failed=1)
    assert b.stats()["sidecar"]["peer_checksum_mismatches"] > mismatches
    # nothing of it was kept: the next lookup (hint or not) finds nothing local
    assert isinstance(cb.lookup(root, tokens), Miss)
    proxy.close()


def test_a_hint_resolves_only_to_a_member_by_address_or_by_a_host_only_one_member_has():
    members = {"10.0.0.2:7400", "10.0.0.3:7400", "10.0.0.4:7400", "10.0.0.4:7401", "[fd00::7]:7400",
               "pod-9.serving.ns.svc:7400", "not an address", "10.0.0.1:7400"}
    warm: list[str] = ["10.0.0.5:7400"]
    peers = HintedPeers(lambda: members, lambda: warm, lambda: "10.0.0.1:7400")
    assert peers.resolve("10.0.0.2:7400") == "10.0.0.2:7400"
    assert peers.resolve("10.0.0.2:8000") == "10.0.0.2:7400"  # the engine's port: the host is the pod
    assert peers.resolve("10.0.0.4:7401") == "10.0.0.4:7401"  # exact
    assert peers.resolve("10.0.0.4:8000") is None  # two members on that host: which one is unknown
    assert peers.resolve("[FD00:0::7]:8000") == "[fd00::7]:7400"
    assert peers.resolve("POD-9.serving.ns.svc:7400") == "pod-9.serving.ns.svc:7400"
    assert peers.resolve("10.0.0.5:8000") == "10.0.0.5:7400"  # listed in warm_peers
    for hint in ("10.0.0.1:7400", "10.0.0.1:8000",  # this sidecar itself
                 "10.0.0.9:7400", "203.0.113.7:443", "not an address", "pod-9.serving.ns.svc", ""):
        assert peers.resolve(hint) is None, hint
    members.discard("10.0.0.2:7400")  # the index forgets a member that failed a fetch, in place
    assert peers.resolve("10.0.0.2:7400") is None
    members = {"10.0.0.6:7400"}  # a heartbeat replaces the set
    assert peers.resolve("10.0.0.6:1") == "10.0.0.6:7400" and peers.resolve("10.0.0.3:7400") is None
    assert HintedPeers(lambda: None, lambda: [], lambda: None).resolve("10.0.0.2:7400") is None
