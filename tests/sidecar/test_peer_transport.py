"""The peer protocol in-process: auth, checksums, partial answers, fuzz."""
import os
import random
import socket
import struct

import numpy as np
import pytest

from kvtier_sidecar import wire
from kvtier_sidecar.arena import Arena
from kvtier_sidecar.dram import DramTier
from kvtier_sidecar.peer_tcp import PeerServer, TcpTransport
from kvtier_testenv.workload import SyntheticOracle

from .proxy import FaultyProxy

ORACLE = SyntheticOracle()
BB = ORACLE.block_bytes
# Peer secrets are at least 32 bytes (a sidecar refuses shorter ones).
SECRET = b"s3cret" * 6


@pytest.fixture()
def tier():
    arena = Arena.create(f"kvt-test-{os.getpid()}-{random.randrange(1 << 30)}", 64, BB)
    t = DramTier(arena, 16, min_sightings=1, kv_heads=2)
    yield t
    arena.close()


def fill(tier: DramTier, tenant: str, tokens: np.ndarray) -> np.ndarray:
    root = ORACLE.root(tenant)
    kv = ORACLE.kv(root, tokens)
    res = tier.reserve(root, tokens, None, None, admit=False)
    for i, slot in enumerate(res.slots):
        tier.slot_array(slot)[:] = kv[(res.first_block + i) * BB:(res.first_block + i + 1) * BB]
    assert tier.commit(res, len(res.slots)) == len(res.slots)
    return kv


class Sink:
    def __init__(self, n_max: int = 64) -> None:
        self.buf = np.zeros(n_max * BB, np.uint8)

    def reserve(self, n: int):
        return [memoryview(self.buf)[i * BB:(i + 1) * BB] for i in range(n)]


# What the server sends before its response: the challenge with one proof.
CHALLENGE_BYTES = wire.CHALLENGE.size + wire.PROOF_BYTES


def serve(tier, secret=SECRET):
    return PeerServer(tier, "127.0.0.1", 0, secret, max_concurrency=4, timeout_s=1.0).start()


def tokens_of(n, seed=0):
    return np.random.default_rng(seed).integers(0, 30_000, n).astype(np.uint32)


def test_fetch_streams_the_token_matched_prefix_with_verified_runs(tier):
    toks = tokens_of(160)
    kv = fill(tier, "a", toks)
    server = serve(tier)
    sink = Sink()
    out = TcpTransport(SECRET).fetch(server.address, ORACLE.root("a"), toks, 16, BB, sink, max_blocks=10, skip_blocks=3)
    assert out.error is None and out.announced_blocks == 7 and out.verified_blocks == 7
    assert np.array_equal(sink.buf[: 7 * BB], kv[3 * BB: 10 * BB])
    # Another tenant's root with the same tokens matches nothing.
    miss = TcpTransport(SECRET).fetch(server.address, ORACLE.root("b"), toks, 16, BB, Sink(), max_blocks=10)
    assert miss.verified_blocks == 0 and miss.error is None
    server.close()


def test_wrong_secret_gets_nothing_and_sends_no_request(tier):
    toks = tokens_of(64)
    fill(tier, "a", toks)
    server = serve(tier)
    out = TcpTransport(b"guess" * 7).fetch(server.address, ORACLE.root("a"), toks, 16, BB, Sink(), max_blocks=4)
    # The server's proof does not check out under "guess": the client stops before its request.
    assert out.verified_blocks == 0 and out.error == "peer failed authentication"
    assert server.counters["fetches"] == 0
    # A client that answers the challenge with a wrong proof is refused.
    s = _authenticated(server.address, b"guess" * 7)
    s.sendall(wire.encode_request(wire.Op.HOT, wire.HotRequest(tenant="a", max_bytes=1 << 20).model_dump_json().encode()))
    status, _ = wire.decode_response_header(s.recv(wire.RESPONSE.size, socket.MSG_WAITALL))
    assert status is wire.Status.UNAUTHORIZED and server.counters["unauthorized"] == 1
    s.close()
    server.close()


def test_flipped_byte_fails_its_run_checksum_and_nothing_after_is_kept(tier, monkeypatch):
    monkeypatch.setattr(wire, "RUN_CHUNK_BYTES", 2 * BB)  # runs of two blocks
    toks = tokens_of(160)
    kv = fill(tier, "a", toks)
    server = serve(tier)
    header_bytes = CHALLENGE_BYTES + wire.RESPONSE.size + len(wire.FetchHeader(matched_tokens=160, n_blocks=8, block_bytes=BB).model_dump_json())
    run_header = wire.RUN.size + 2 * 8
    # Corrupt a byte inside the third run's first block (block 4).
    proxy = FaultyProxy(server.address, flip_at=header_bytes + 2 * (run_header + 2 * BB) + run_header + 100)
    server.endpoint = proxy.address  # the address its peers dial (and sign)
    sink = Sink()
    out = TcpTransport(SECRET).fetch(proxy.address, ORACLE.root("a"), toks, 16, BB, sink, max_blocks=8)
    assert out.error == "checksum mismatch" and out.verified_blocks == 4
    assert np.array_equal(sink.buf[: 4 * BB], kv[: 4 * BB])
    proxy.close(); server.close()


def test_peer_dying_mid_transfer_leaves_a_verified_partial_answer(tier, monkeypatch):
    monkeypatch.setattr(wire, "RUN_CHUNK_BYTES", 2 * BB)
    toks = tokens_of(160)
    kv = fill(tier, "a", toks)
    server = serve(tier)
    proxy = FaultyProxy(server.address, cut_at=CHALLENGE_BYTES + 200 + 3 * (wire.RUN.size + 16 + 2 * BB))
    server.endpoint = proxy.address
    sink = Sink()
    out = TcpTransport(SECRET).fetch(proxy.address, ORACLE.root("a"), toks, 16, BB, sink, max_blocks=9)
    assert out.error and 0 < out.verified_blocks < 9
    assert np.array_equal(sink.buf[: out.verified_blocks * BB], kv[: out.verified_blocks * BB])
    proxy.close(); server.close()


def test_stalled_peer_times_out_into_a_miss():
    silent = socket.create_server(("127.0.0.1", 0))
    addr = "%s:%d" % silent.getsockname()[:2]
    t = TcpTransport(SECRET, connect_timeout_s=0.2, timeout_s=1.0)
    import time
    t0 = time.monotonic()
    out = t.fetch(addr, ORACLE.root("a"), tokens_of(64), 16, BB, Sink(), max_blocks=4)
    # Bounded by its own timeouts (its deadline, and at most one more socket wait),
    # never by the peer: a stalled peer would hold it forever.
    assert out.verified_blocks == 0 and out.error
    assert time.monotonic() - t0 < t.connect_timeout_s + 2 * t.timeout_s
    silent.close()


def test_partial_commit_publishes_only_the_verified_blocks(tier):
    toks = tokens_of(96)
    root = ORACLE.root("a")
    kv = ORACLE.kv(root, toks)
    res = tier.reserve(root, toks, 0, 6, admit=False)
    for i, slot in enumerate(res.slots):
        tier.slot_array(slot)[:] = kv[i * BB:(i + 1) * BB] if i < 2 else 0xEE  # blocks 2.. are junk
    assert tier.commit(res, 2) == 2
    hit = tier.lookup(root, toks)
    assert hit.matched_tokens == 32
    got = np.concatenate([tier.slot_array(s) for s in hit.slots])
    assert np.array_equal(got, kv[: 2 * BB])
    tier.release(hit.handle)


def test_peer_protocol_fuzz_server_keeps_serving(tier):
    toks = tokens_of(64)
    kv = fill(tier, "a", toks)
    server = serve(tier)
    rng = random.Random(3)
    host, port = server.address.split(":")
    for i in range(2000):
        kind = i % 4
        s = (socket.create_connection((host, int(port)), timeout=1) if kind == 0
             else _authenticated(server.address, SECRET))
        try:
            if kind == 0:
                s.sendall(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 80))))
            else:
                if kind == 1:
                    s.sendall(wire.REQUEST.pack(wire.REQUEST_MAGIC, rng.randrange(256), rng.randrange(1 << 32)))
                elif kind == 2:
                    body = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
                    s.sendall(wire.encode_request(wire.Op.FETCH, struct.pack("<I", len(body)) + body))
                else:
                    s.sendall(wire.encode_request(wire.Op(rng.choice([1, 2])), b'{"root": 1}' + os.urandom(rng.randrange(8))))
            s.settimeout(1.0)
            try:
                s.shutdown(socket.SHUT_WR)  # the server sees the end of our garbage at once
                s.recv(100)
            except OSError:
                pass
        finally:
            s.close()
    sink = Sink()
    out = TcpTransport(SECRET).fetch(server.address, ORACLE.root("a"), toks, 16, BB, sink, max_blocks=4)
    assert out.verified_blocks == 4 and np.array_equal(sink.buf[: 4 * BB], kv[: 4 * BB])
    server.close()


def _authenticated(address: str, secret: bytes, client_id: str = "test-client") -> socket.socket:
    """A socket past the handshake, as a real peer would leave it."""
    host, port = address.split(":")
    s = socket.create_connection((host, int(port)), timeout=2)
    client_nonce = os.urandom(wire.NONCE_BYTES)
    s.sendall(wire.encode_hello(client_nonce, client_id))
    server_nonce, n = wire.decode_challenge_head(s.recv(wire.CHALLENGE.size, socket.MSG_WAITALL))
    s.recv(n * wire.PROOF_BYTES, socket.MSG_WAITALL)
    s.sendall(wire.proof(secret, wire.Role.CLIENT, client_nonce, server_nonce, address, client_id))
    return s


def test_connections_over_the_concurrency_bound_get_busy_and_their_slots_come_back(tier):
    import time

    toks = tokens_of(64)
    kv = fill(tier, "a", toks)
    server = PeerServer(tier, "127.0.0.1", 0, SECRET, max_concurrency=2, timeout_s=5.0).start()
    holders = [_authenticated(server.address, SECRET) for _ in range(2)]
    transport = TcpTransport(SECRET)
    out = transport.fetch(server.address, ORACLE.root("a"), toks, 16, BB, Sink(), max_blocks=4)
    assert out.error == "busy" and out.verified_blocks == 0 and server.counters["busy"] == 1
    for s in holders:
        s.close()
    deadline = time.monotonic() + 5
    while True:  # the server frees the slots once it sees the closes
        sink = Sink()
        out = transport.fetch(server.address, ORACLE.root("a"), toks, 16, BB, sink, max_blocks=4)
        if out.error != "busy" or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert out.error is None and out.verified_blocks == 4
    assert np.array_equal(sink.buf[: 4 * BB], kv[: 4 * BB])
    server.close()


def test_sendmsg_all_delivers_every_byte_in_order_through_a_small_socket_buffer():
    import threading

    from kvtier_sidecar.peer_tcp import sendmsg_all

    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)  # forces many partial sends
    head = b"HEAD" + bytes(range(60))
    body = np.random.default_rng(5).integers(0, 256, 3 << 20, dtype=np.uint8)
    got = bytearray()

    def drain():
        while len(got) < len(head) + body.nbytes:
            chunk = b.recv(1 << 16)
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    a.settimeout(5)
    sendmsg_all(a, [head, memoryview(body)], deadline=float("inf"))
    reader.join(10)
    assert bytes(got) == head + body.tobytes()
    a.close(); b.close()


def test_sendmsg_all_gives_up_at_its_deadline_when_nobody_reads():
    import time

    from kvtier_sidecar.peer_tcp import sendmsg_all

    a, b = socket.socketpair()
    socket_timeout_s, deadline_s = 0.5, 0.5
    a.settimeout(socket_timeout_s)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        sendmsg_all(a, [bytes(64 << 20)], deadline=time.monotonic() + deadline_s)
    # The deadline is checked between sends: it may be overrun by one socket wait.
    assert time.monotonic() - t0 < deadline_s + 2 * socket_timeout_s
    a.close(); b.close()
