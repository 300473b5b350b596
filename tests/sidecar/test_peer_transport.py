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
from kvtier_sidecar.peer_session import PeerSession, sealed_size
from kvtier_sidecar.peer_tcp import PeerServer, TcpTransport
from kvtier_sidecar.transport import RECORD_AUTH_FAILED
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


def _block_offset(block: int, blocks_per_run: int, n_blocks: int) -> int:
    """Where block `block`'s ciphertext starts in the server-to-client stream of a
    fetch answered with `n_blocks` in runs of `blocks_per_run`."""
    answer = sealed_size(wire.RESPONSE.size + len(wire.FetchHeader(
        matched_tokens=n_blocks * 16, n_blocks=n_blocks, block_bytes=BB).model_dump_json()))
    run_header = sealed_size(wire.RUN.size + 8 * blocks_per_run)
    runs, within = divmod(block, blocks_per_run)
    return (CHALLENGE_BYTES + answer + runs * (run_header + blocks_per_run * sealed_size(BB)) + run_header
            + within * sealed_size(BB) + wire.RECORD.size)


@pytest.mark.parametrize("block", [0, 4])
def test_a_flipped_ciphertext_byte_fails_its_record_and_nothing_from_there_is_kept(tier, monkeypatch, block):
    monkeypatch.setattr(wire, "RUN_CHUNK_BYTES", 2 * BB)  # runs of two blocks
    toks = tokens_of(160)
    kv = fill(tier, "a", toks)
    server = serve(tier)
    proxy = FaultyProxy(server.address, flip_at=_block_offset(block, 2, 8) + 100)
    server.endpoint = proxy.address  # the address its peers dial (and sign)
    sink = Sink()
    out = TcpTransport(SECRET).fetch(proxy.address, ORACLE.root("a"), toks, 16, BB, sink, max_blocks=8)
    # The blocks before the flipped one passed their tags and digests; the flipped one
    # and everything after are dropped (block 0: a miss), never handed on.
    assert out.error == RECORD_AUTH_FAILED and out.verified_blocks == block
    assert np.array_equal(sink.buf[: block * BB], kv[: block * BB])
    proxy.close(); server.close()


def test_a_wiretap_reads_neither_kv_nor_token_ids_nor_the_tenant(tier):
    toks = tokens_of(160, seed=7)
    tenant = "tenant-acme-confidential"
    root = ORACLE.root(tenant)
    kv = ORACLE.kv(root, toks)
    res = tier.reserve(root, toks, None, None, admit=False)
    for i, slot in enumerate(res.slots):
        tier.slot_array(slot)[:] = kv[(res.first_block + i) * BB:(res.first_block + i + 1) * BB]
    assert tier.commit(res, len(res.slots)) == len(res.slots)
    server = serve(tier)
    tap = FaultyProxy(server.address)
    server.endpoint = tap.address
    sink = Sink()
    out = TcpTransport(SECRET).fetch(tap.address, root, toks, 16, BB, sink, max_blocks=10)
    assert out.error is None and out.verified_blocks == 10
    assert np.array_equal(sink.buf[: 10 * BB], kv[: 10 * BB])
    to_server, to_client = bytes(tap.seen["to_server"]), bytes(tap.seen["to_client"])
    assert len(to_client) > 10 * BB  # the blocks did cross the tap...
    assert to_server.startswith(wire.HELLO_MAGIC)  # ...and the tap sees the handshake in the clear
    ids = toks.astype("<u4").tobytes()
    for i in range(0, len(ids) - 32, 32):  # no 32-byte run of the prompt's token ids
        assert ids[i:i + 32] not in to_server
    for b in range(10):  # no 64-byte run of any block's KV
        assert kv[b * BB: b * BB + 64].tobytes() not in to_client
        assert kv[b * BB + BB // 2: b * BB + BB // 2 + 64].tobytes() not in to_client
    for direction in (to_server, to_client):
        assert tenant.encode() not in direction and b"model_id" not in direction
    tap.close(); server.close()


def test_a_replayed_record_is_refused_in_its_connection_and_in_another(tier):
    fill(tier, "a", tokens_of(64))
    server = serve(tier)
    hot = wire.encode_request(wire.Op.HOT, wire.HotRequest(tenant="a", max_bytes=1 << 20).model_dump_json().encode())
    s, session = _session(server.address, SECRET)
    record = session.seal(hot)
    s.sendall(record)
    status, _ = _sealed_reply(s, session)
    assert status is wire.Status.OK
    s.sendall(record)  # the same bytes again: the counter moved on, its tag fails
    assert _hung_up(s)  # closed without an answer
    assert server.counters["bad_records"] == 1
    s.close()
    other, _ = _session(server.address, SECRET)  # another connection: other keys
    other.sendall(record)
    assert _hung_up(other)
    assert server.counters["bad_records"] == 2
    other.close()
    server.close()


def test_a_peer_speaking_the_previous_protocol_is_refused_cleanly(tier):
    server = serve(tier)
    host, port = server.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    s.sendall(b"KVP2" + os.urandom(wire.NONCE_BYTES) + bytes([4]) + b"old1")
    assert _hung_up(s)  # no challenge: nothing of ours to an old peer
    assert server.counters["old_protocol"] == 1
    s.close()
    old_server = socket.create_server(("127.0.0.1", 0))  # answers a v3 hello as a v2 server would

    def answer() -> None:
        c, _ = old_server.accept()
        c.recv(4096)
        c.sendall(b"KVP2" + os.urandom(wire.NONCE_BYTES) + bytes([1]) + bytes(wire.PROOF_BYTES))
        c.close()

    import threading
    threading.Thread(target=answer, daemon=True).start()
    out = TcpTransport(SECRET).fetch("127.0.0.1:%d" % old_server.getsockname()[1], ORACLE.root("a"),
                                     tokens_of(64), 16, BB, Sink(), max_blocks=4)
    assert out.error == "connect: OldProtocolError" and out.verified_blocks == 0
    old_server.close(); server.close()


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
        kind = i % 5
        if kind == 0:
            s = socket.create_connection((host, int(port)), timeout=1)
        else:
            s, session = _session(server.address, SECRET)
        try:
            if kind == 0:
                s.sendall(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 80))))
            elif kind == 4:  # past the handshake, bytes that are no sealed record
                s.sendall(wire.RECORD.pack(wire.RECORD_MAGIC, rng.randrange(64)) + os.urandom(rng.randrange(80)))
            else:  # sealed garbage: the request parsing behind the session
                if kind == 1:
                    s.sendall(session.seal(wire.REQUEST.pack(wire.REQUEST_MAGIC, rng.randrange(256), rng.randrange(1 << 32))))
                elif kind == 2:
                    body = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
                    s.sendall(session.seal(wire.encode_request(wire.Op.FETCH, struct.pack("<I", len(body)) + body)))
                else:
                    s.sendall(session.seal(wire.encode_request(
                        wire.Op(rng.choice([1, 2])), b'{"root": 1}' + os.urandom(rng.randrange(8)))))
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


def _session(address: str, secret: bytes, client_id: str = "test-client") -> tuple[socket.socket, PeerSession]:
    """A socket past the handshake, as a real peer would leave it, and its session."""
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=2)
    client_nonce = os.urandom(wire.NONCE_BYTES)
    s.sendall(wire.encode_hello(client_nonce, client_id))
    server_nonce, n = wire.decode_challenge_head(s.recv(wire.CHALLENGE.size, socket.MSG_WAITALL))
    s.recv(n * wire.PROOF_BYTES, socket.MSG_WAITALL)
    s.sendall(wire.proof(secret, wire.Role.CLIENT, client_nonce, server_nonce, address, client_id))
    return s, PeerSession.for_client(secret, client_nonce, server_nonce, address, client_id)


def _authenticated(address: str, secret: bytes, client_id: str = "test-client") -> socket.socket:
    return _session(address, secret, client_id)[0]


def _hung_up(s: socket.socket) -> bool:
    """The server closed this connection without sending anything more."""
    try:
        return s.recv(100) == b""
    except ConnectionResetError:
        return True


def _sealed_reply(s: socket.socket, session: PeerSession) -> tuple[wire.Status, bytes]:
    head = s.recv(wire.RECORD.size, socket.MSG_WAITALL)
    n = wire.decode_record_header(head, wire.MAX_RESPONSE_RECORD_BYTES)
    frame = session.open(head, s.recv(n + wire.TAG_BYTES, socket.MSG_WAITALL))
    return wire.decode_response_header(frame[: wire.RESPONSE.size])[0], frame[wire.RESPONSE.size:]


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


class _LyingPeer:
    """Proves the fleet's secret (an insider gone bad), then answers every fetch with
    what `answer(session, rng)` makes of it: the client's side of the fuzz."""

    def __init__(self, answer, seed: int) -> None:
        import threading

        self.answer = answer
        self.rng = random.Random(seed)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        from kvtier_sidecar.sockio import recv_exact

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                conn.settimeout(5)
                client_nonce, id_len = wire.decode_hello_head(recv_exact(conn, wire.HELLO.size))
                client_id = recv_exact(conn, id_len).decode()
                server_nonce = os.urandom(wire.NONCE_BYTES)
                conn.sendall(wire.encode_challenge(server_nonce, [wire.proof(
                    SECRET, wire.Role.SERVER, client_nonce, server_nonce, self.address, client_id)]))
                recv_exact(conn, wire.PROOF_BYTES)
                session = PeerSession.for_server(SECRET, client_nonce, server_nonce, self.address, client_id)
                head = recv_exact(conn, wire.RECORD.size)
                session.open(head, recv_exact(conn, wire.decode_record_header(head, 1 << 30) + wire.TAG_BYTES))
                conn.sendall(self.answer(session, self.rng))
            except OSError:
                pass
            finally:
                conn.close()

    def close(self) -> None:
        self.sock.close()


def _ok(n_blocks: int) -> bytes:
    return wire.encode_response(wire.Status.OK, wire.FetchHeader(matched_tokens=16 * n_blocks, n_blocks=n_blocks,
                                                                 block_bytes=BB))


def _garbage_answers():
    """Answers a lying peer may give: each must end as an error with nothing verified."""
    def random_bytes(session, rng):
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))

    def sealed_random_frame(session, rng):
        return session.seal(bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64))))

    def wrong_digests(session, rng):  # well-formed, but the blocks are not what the digests say
        n = rng.randrange(1, 4)
        out = session.seal(_ok(n)) + session.seal(wire.encode_run_header(0, np.arange(n, dtype="<u8")))
        return out + b"".join(session.seal(os.urandom(BB)) for _ in range(n))

    def wrong_block_length(session, rng):
        return session.seal(_ok(2)) + session.seal(wire.encode_run_header(0, np.zeros(2, "<u8"))) + session.seal(
            os.urandom(BB - rng.randrange(1, 64)))

    def run_out_of_order(session, rng):
        return session.seal(_ok(3)) + session.seal(wire.encode_run_header(rng.randrange(1, 3), np.zeros(1, "<u8")))

    def unsealed_ok(session, rng):  # an OK in the clear is no answer a session accepts
        return _ok(1)

    def record_under_other_keys(session, rng):  # e.g. one recorded from another connection
        return PeerSession(os.urandom(32), os.urandom(32)).seal(_ok(1))

    return [random_bytes, sealed_random_frame, wrong_digests, wrong_block_length, run_out_of_order, unsealed_ok,
            record_under_other_keys]


@pytest.mark.parametrize("answer", _garbage_answers(), ids=lambda f: f.__name__)
def test_a_lying_peer_never_gets_a_block_accepted(answer):
    peer = _LyingPeer(answer, seed=11)
    transport = TcpTransport(SECRET, timeout_s=5.0)
    for i in range(20):
        sink = Sink()
        out = transport.fetch(peer.address, ORACLE.root("a"), tokens_of(64, seed=i), 16, BB, sink, max_blocks=3)
        assert out.error and out.verified_blocks == 0 and out.digests == [], out
    peer.close()


def test_session_keys_follow_hkdf_sha256_and_differ_per_direction_and_connection():
    from kvtier_sidecar.peer_session import _hkdf_sha256, derive_keys

    # RFC 5869, test case 1.
    okm = _hkdf_sha256(bytes([0x0B] * 22), bytes(range(13)), bytes(range(0xF0, 0xFA)), 42)
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
                         "34007208d5b887185865")
    base = (SECRET, b"c" * 16, b"s" * 16, "10.0.0.1:8082", "10.0.0.2:8082")
    c2s, s2c = derive_keys(*base)
    assert c2s != s2c and len(c2s) == len(s2c) == 32
    for i, other in ((0, SECRET[::-1]), (1, b"d" * 16), (2, b"t" * 16), (3, "10.0.0.9:8082"), (4, "10.0.0.3:8082")):
        changed = list(base)
        changed[i] = other
        assert derive_keys(*changed)[0] != c2s, i
