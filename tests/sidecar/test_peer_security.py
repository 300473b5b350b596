"""The peer handshake against an attacker on the same network: relay, reflection,
slow trickle, and secret rotation under load."""
import logging
import os
import socket
import threading
import time

import numpy as np
import pytest

from kvtier.sidecar_config import PeerSecretError
from kvtier_sidecar import wire
from kvtier_sidecar.peer_keys import PeerKeyring, SecretFileWatch
from kvtier_sidecar.peer_tcp import PeerAuthError, PeerServer, TcpTransport
from kvtier_sidecar.sockio import recv_exact

from .test_peer_transport import BB, ORACLE, Sink, fill, tier  # noqa: F401  (tier: fixture)

SECRET = b"fleet-secret-" * 3


def key(name: bytes) -> bytes:
    """A secret long enough for the peer tier (32 bytes and more), named for the test."""
    return name.ljust(32, b".")


# The slow-trickle attack (docs/SECURITY.md): one more connection than the server has slots,
# each sending one byte every 0.6 s.
TRICKLERS = 9
TRICKLE_EVERY_S = 0.6
# Deadlines for the legitimate side where the test is not about time: a loaded shared
# machine must not turn a slow answer into a failed fetch.
SLACK_S = 5.0


def tokens_of(n, seed=0):
    return np.random.default_rng(seed).integers(0, 30_000, n).astype(np.uint32)


def _dial(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=3)


def _until(probe, what: str, timeout_s: float = 10 * SLACK_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def _hot_request(tenant: str) -> bytes:
    return wire.encode_request(wire.Op.HOT, wire.HotRequest(tenant=tenant, max_bytes=1 << 30).model_dump_json().encode())


def _status(sock: socket.socket) -> wire.Status:
    status, length = wire.decode_response_header(recv_exact(sock, wire.RESPONSE.size))
    recv_exact(sock, length)
    return status


def test_relayed_handshake_through_a_fake_peer_reads_nothing(tier):
    """The attack: lure sidecar B into dialling a fake peer F, and relay between B and
    the victim A so that B's proof would open A. F forwards B's hello to A and A's
    challenge back to B, verbatim. B checks A's proof against the address it dialled
    (F's), finds it wrong and sends nothing more; F has no proof to give A, and A
    hands out nothing."""
    fill(tier, "victim", tokens_of(96))
    a = PeerServer(tier, "127.0.0.1", 0, SECRET, max_concurrency=4, timeout_s=2.0).start()
    fake = socket.create_server(("127.0.0.1", 0))
    fake_address = "127.0.0.1:%d" % fake.getsockname()[1]
    seen: dict = {}

    def relay() -> None:
        conn, _ = fake.accept()
        conn.settimeout(2.0)
        head = recv_exact(conn, wire.HELLO.size)
        hello = head + recv_exact(conn, head[-1])
        to_a = _dial(a.address)
        to_a.sendall(hello)
        challenge_head = recv_exact(to_a, wire.CHALLENGE.size)
        conn.sendall(challenge_head + recv_exact(to_a, challenge_head[-1] * wire.PROOF_BYTES))
        try:
            after = conn.recv(4096)  # whatever B sends next would be relayed to A
        except OSError:
            after = b""
        seen["from_b"] = after
        forged = after[:wire.PROOF_BYTES].ljust(wire.PROOF_BYTES, b"\0")
        to_a.sendall(forged + _hot_request("victim"))
        seen["a_answer"] = _status(to_a)
        conn.close(); to_a.close()

    attacker = threading.Thread(target=relay)
    attacker.start()
    b = TcpTransport(SECRET, identity="127.0.0.3:8082")
    with pytest.raises(PeerAuthError):
        b.hot_prefixes(fake_address, "victim", 1 << 30)
    attacker.join(10)
    assert seen["from_b"] == b""  # B sent neither a proof nor a request
    assert seen["a_answer"] is wire.Status.UNAUTHORIZED
    assert a.counters["unauthorized"] == 1 and a.counters["fetches"] == 0
    # The same B reaches A itself, by A's own address, without trouble.
    assert [r.tenant for r, _ in b.hot_prefixes(a.address, "victim", 1 << 30).prefixes] == ["victim"]
    a.close(); fake.close()


def test_a_servers_own_proof_reflected_back_is_refused(tier):
    fill(tier, "victim", tokens_of(64))
    a = PeerServer(tier, "127.0.0.1", 0, SECRET, max_concurrency=4, timeout_s=2.0).start()
    s = _dial(a.address)
    s.sendall(wire.encode_hello(os.urandom(wire.NONCE_BYTES), "127.0.0.9:1"))
    recv_exact(s, wire.CHALLENGE.size)
    server_proof = recv_exact(s, wire.PROOF_BYTES)
    s.sendall(server_proof + _hot_request("victim"))
    assert _status(s) is wire.Status.UNAUTHORIZED
    s.close(); a.close()


def test_proofs_bind_role_nonces_endpoint_and_identity():
    base = dict(role=wire.Role.CLIENT, client_nonce=b"c" * 16, server_nonce=b"s" * 16,
                server_endpoint="10.0.0.1:8082", client_id="10.0.0.2:8082")
    ref = wire.proof(SECRET, **base)
    for change in (dict(role=wire.Role.SERVER), dict(client_nonce=b"d" * 16), dict(server_nonce=b"t" * 16),
                   dict(server_endpoint="10.0.0.9:8082"), dict(client_id="10.0.0.3:8082")):
        assert wire.proof(SECRET, **{**base, **change}) != ref, change
    assert wire.proof(key(b"other"), **base) != ref
    assert wire.proof_matches([key(b"old"), SECRET], ref, **base) == SECRET
    assert wire.proof_matches([key(b"old")], ref, **base) is None


def test_slow_trickle_holds_no_slot_and_real_peers_keep_being_served(tier):
    toks = tokens_of(64)
    kv = fill(tier, "a", toks)
    # Generous deadlines: the shared test machine may be slow, and a real peer's handshake
    # must fit the server's deadline; the tricklers never finish theirs whatever it is.
    server = PeerServer(tier, "127.0.0.1", 0, SECRET, max_concurrency=8, timeout_s=10.0,
                        handshake_timeout_s=SLACK_S).start()
    hello = wire.encode_hello(os.urandom(wire.NONCE_BYTES), "x" * 200)
    stop = threading.Event()
    cut = []

    def trickle() -> None:
        s = _dial(server.address)
        try:
            for i in range(len(hello)):
                s.sendall(hello[i:i + 1])
                if stop.wait(TRICKLE_EVERY_S):
                    return
        except OSError:
            cut.append(1)  # the server hung up on us
        finally:
            s.close()

    threads = [threading.Thread(target=trickle) for _ in range(TRICKLERS)]
    for t in threads:
        t.start()
    transport = TcpTransport(SECRET, connect_timeout_s=SLACK_S, timeout_s=SLACK_S)
    outcomes = []
    # Fetch throughout the attack, past the point where the tricklers' handshakes expire.
    # Each fetch waits for the previous one's slot to come back (the server's worker sees
    # the hang-up a moment after the client's last read; on a loaded machine eight of
    # them can lag at once). A trickler holding a slot would keep it from ever coming back.
    while server.counters["handshake_timeouts"] < TRICKLERS or len(outcomes) < 20:
        _until(lambda: server.slots_in_use == 0, "the slots held by tricklers, or never given back")
        sink = Sink()
        out = transport.fetch(server.address, ORACLE.root("a"), toks, 16, BB, sink, max_blocks=4)
        outcomes.append((out.error, out.verified_blocks, np.array_equal(sink.buf[: 4 * BB], kv[: 4 * BB])))
    stop.set()
    for t in threads:
        t.join()
    assert all(o == (None, 4, True) for o in outcomes), [o for o in outcomes if o != (None, 4, True)][:3]
    assert server.counters["handshake_timeouts"] >= TRICKLERS and server.counters["busy"] == 0
    server.close()


def test_keyring_refuses_an_empty_or_short_secret():
    for bad in (b"", b"x" * 31):
        with pytest.raises(PeerSecretError, match="at least 32 bytes"):
            PeerKeyring(bad, overlap_s=1.0)
        with pytest.raises(PeerSecretError):
            TcpTransport(bad)
    ring = PeerKeyring(key(b"one"), overlap_s=1.0)
    with pytest.raises(PeerSecretError):
        ring.rotate(b"")
    assert ring.accepted() == [key(b"one")]


def test_keyring_accepts_the_previous_secret_only_during_the_overlap():
    ring = PeerKeyring(key(b"old"), overlap_s=30.0)
    assert ring.accepted(now=0.0) == [key(b"old")]
    assert ring.rotate(key(b"new"), now=100.0) and not ring.rotate(key(b"new"), now=101.0)
    assert ring.accepted(now=129.9) == [key(b"new"), key(b"old")]
    assert ring.accepted(now=130.0) == [key(b"new")]


def test_secret_file_watch_rotates_on_a_changed_file_and_ignores_an_empty_one(tmp_path, caplog):
    """An empty file (a Secret being replaced) is kept quiet; an unusable one is logged."""
    caplog.set_level(logging.WARNING, logger="kvtier.sidecar.peer")
    path = tmp_path / "peer-secret"
    path.write_bytes(key(b"one") + b"\n")
    ring = PeerKeyring(key(b"one"), overlap_s=60.0)
    watch = SecretFileWatch(str(path), ring)
    assert not watch.poll()
    path.write_text("")
    assert not watch.poll() and ring.accepted()[0] == key(b"one")
    assert not [r for r in caplog.records if "unusable secret" in r.getMessage()]
    path.write_text("short")  # a truncated Secret never replaces a usable one
    assert not watch.poll() and ring.accepted() == [key(b"one")]
    assert [r for r in caplog.records if "unusable secret" in r.getMessage()]
    tmp = tmp_path / "swap"
    tmp.write_bytes(key(b"two") + b"\n")
    tmp.replace(path)  # a mounted Secret changes by an atomic swap
    assert watch.poll() and ring.accepted() == [key(b"two"), key(b"one")]


def test_rotation_under_load_fails_no_fetch_and_the_old_secret_expires(tier):
    """Server first, then the clients one by one, as a mounted Secret reaches pods:
    every fetch in between succeeds; once the overlap passed, the old secret opens
    nothing."""
    toks = tokens_of(64)
    kv = fill(tier, "a", toks)
    overlap_s = 600.0  # longer than any run of this test: the overlap never ends mid-way
    server_keys = PeerKeyring(key(b"k1"), overlap_s)
    server = PeerServer(tier, "127.0.0.1", 0, server_keys, max_concurrency=8, timeout_s=SLACK_S,
                        handshake_timeout_s=SLACK_S).start()
    clients = [PeerKeyring(key(b"k1"), overlap_s) for _ in range(2)]
    transports = [TcpTransport(k, connect_timeout_s=SLACK_S, timeout_s=SLACK_S) for k in clients]
    failures, done = [], []
    stop = threading.Event()

    def load(transport: TcpTransport) -> None:
        while not stop.is_set():
            sink = Sink()
            out = transport.fetch(server.address, ORACLE.root("a"), toks, 16, BB, sink, max_blocks=4)
            if out.error or not np.array_equal(sink.buf[: 4 * BB], kv[: 4 * BB]):
                failures.append(out.error)
            done.append(1)

    threads = [threading.Thread(target=load, args=(t,)) for t in transports]
    for t in threads:
        t.start()

    def after_more(n: int) -> None:
        target = len(done) + n
        deadline = time.monotonic() + 30
        while len(done) < target and time.monotonic() < deadline:
            time.sleep(0.005)

    after_more(20)
    server_keys.rotate(key(b"k2"))
    after_more(20)
    clients[0].rotate(key(b"k2"))
    after_more(20)
    clients[1].rotate(key(b"k2"))
    after_more(20)
    stop.set()
    for t in threads:
        t.join()
    assert failures == [] and len(done) >= 80
    server.close()
    # Once a server's overlap is over, the old secret opens nothing.
    rotated = PeerKeyring(key(b"k1"), overlap_s=0.0)
    rotated.rotate(key(b"k2"))
    server = PeerServer(tier, "127.0.0.1", 0, rotated, max_concurrency=8, timeout_s=SLACK_S,
                        handshake_timeout_s=SLACK_S).start()
    stale = TcpTransport(key(b"k1"), connect_timeout_s=SLACK_S, timeout_s=SLACK_S)
    out = stale.fetch(server.address, ORACLE.root("a"), toks, 16, BB, Sink(), max_blocks=4)
    assert out.error == "peer failed authentication" and out.verified_blocks == 0
    fresh = TcpTransport(key(b"k2"), connect_timeout_s=SLACK_S, timeout_s=SLACK_S)
    assert fresh.fetch(server.address, ORACLE.root("a"), toks, 16, BB, Sink(), max_blocks=4).verified_blocks == 4
    server.close()


def test_secret_file_watch_survives_a_missing_file_and_one_it_cannot_read(tmp_path):
    path = tmp_path / "peer-secret"
    ring = PeerKeyring(key(b"one"), overlap_s=60.0)
    watch = SecretFileWatch(str(path), ring)  # not mounted yet: no error, nothing to rotate
    assert not watch.poll() and ring.accepted() == [key(b"one")]
    path.mkdir()  # there, but not readable as a file
    assert not watch.poll() and ring.accepted() == [key(b"one")]
    path.rmdir()
    path.write_bytes(key(b"two") + b"\n")
    assert watch.poll() and ring.accepted() == [key(b"two"), key(b"one")]
