"""The peer port of a real sidecar process, spoken to byte by byte: a recorded
handshake replayed on a new connection opens nothing, no two handshakes are given
the same server challenge, and a hot-prefix listing with a budget that is not a
positive whole number of bytes is BAD_REQUEST while the sidecar keeps serving."""
import json
import os
import socket
from pathlib import Path

import pytest

from kvtier_sidecar import wire
from kvtier_sidecar.client import SidecarClient
from kvtier_sidecar.peer_session import PeerSession
from kvtier_sidecar.sockio import recv_exact

from .test_sidecar_process import prompt, seed_cache

CLIENT_ID = "127.0.0.9:8082"
# Handshakes whose challenges are compared: enough that a server nonce drawn from a
# small space, or derived from what the client sent, shows up as a repeat.
HANDSHAKES = 64
# Socket deadline for the test's own reads: generous on a loaded shared machine.
READ_TIMEOUT_S = 10.0


def _dial(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=READ_TIMEOUT_S)


def _challenge(sock: socket.socket) -> tuple[bytes, bytes]:
    """(server nonce, the server's proofs) of the CHALLENGE the server sent."""
    server_nonce, n = wire.decode_challenge_head(recv_exact(sock, wire.CHALLENGE.size))
    return server_nonce, recv_exact(sock, n * wire.PROOF_BYTES)


def _answer(sock: socket.socket, session: PeerSession) -> tuple[wire.Status, dict]:
    """The server's answer: sealed in the session, or a refusal in the clear (the
    server sends those before any session exists: bad proof, no free slot)."""
    head = recv_exact(sock, wire.RECORD.size)
    if head[:4] == wire.RESPONSE_MAGIC:
        status, length = wire.decode_response_header(head + recv_exact(sock, wire.RESPONSE.size - len(head)))
        return status, json.loads(recv_exact(sock, length))
    length = wire.decode_record_header(head, wire.MAX_RESPONSE_RECORD_BYTES)
    frame = session.open(head, recv_exact(sock, length + wire.TAG_BYTES))
    status, _ = wire.decode_response_header(frame[: wire.RESPONSE.size])
    return status, json.loads(frame[wire.RESPONSE.size:])


def _hot(tenant: str, max_bytes) -> bytes:
    """A HOT request with any JSON value as the budget (the model would refuse to
    build a bad one: this is what a buggy or hostile peer sends)."""
    return wire.encode_request(wire.Op.HOT, json.dumps({"tenant": tenant, "max_bytes": max_bytes}).encode())


def _secret(secret_file: str) -> bytes:
    return Path(secret_file).read_bytes().strip()


def _authenticated(address: str, secret: bytes) -> tuple[socket.socket, bytes, PeerSession]:
    """A connection past the server's challenge, the proof that answers it, and the
    session that seals what follows."""
    sock = _dial(address)
    client_nonce = os.urandom(wire.NONCE_BYTES)
    sock.sendall(wire.encode_hello(client_nonce, CLIENT_ID))
    server_nonce, _ = _challenge(sock)
    return (sock, wire.proof(secret, wire.Role.CLIENT, client_nonce, server_nonce, address, CLIENT_ID),
            PeerSession.for_client(secret, client_nonce, server_nonce, address, CLIENT_ID))


def _ask(address: str, secret: bytes, request: bytes) -> tuple[wire.Status, dict]:
    sock, proof, session = _authenticated(address, secret)
    try:
        sock.sendall(proof + session.seal(request))
        return _answer(sock, session)
    finally:
        sock.close()


@pytest.fixture()
def sidecar(spawn, oracle, secret_file):
    """A sidecar process holding one prompt of tenant `acme`."""
    side = spawn("a", "127.0.0.2", None, secret_file)
    seed_cache(SidecarClient(side.socket), oracle, "acme", prompt(96))
    return side


def test_a_recorded_handshake_replayed_on_a_new_connection_is_unauthorized(sidecar, secret_file):
    secret = _secret(secret_file)
    # A real peer's conversation, every byte the client sent recorded by an eavesdropper.
    sock = _dial(sidecar.peer)
    hello = wire.encode_hello(os.urandom(wire.NONCE_BYTES), CLIENT_ID)
    sock.sendall(hello)
    server_nonce, _ = _challenge(sock)
    client_nonce = hello[4:4 + wire.NONCE_BYTES]
    proof = wire.proof(secret, wire.Role.CLIENT, client_nonce, server_nonce, sidecar.peer, CLIENT_ID)
    session = PeerSession.for_client(secret, client_nonce, server_nonce, sidecar.peer, CLIENT_ID)
    request = session.seal(_hot("acme", 1 << 20))  # what went on the wire, sealed
    sock.sendall(proof + request)
    status, body = _answer(sock, session)
    assert status is wire.Status.OK and [p["root"]["tenant"] for p in body["prefixes"]] == ["acme"]

    # The same bytes on new connections, one while the original is still open and one
    # after it closed: the server's fresh challenge makes the recorded proof worthless.
    for close_first in (False, True):
        if close_first:
            sock.close()
        replay = _dial(sidecar.peer)
        replay.sendall(hello)
        fresh_nonce, _ = _challenge(replay)
        replay.sendall(proof + request)
        assert fresh_nonce != server_nonce
        assert _answer(replay, session) == (wire.Status.UNAUTHORIZED, {"error": "bad peer credentials"})
        replay.close()
    # The real peer, on its own fresh handshake, is still served.
    status, body = _ask(sidecar.peer, secret, _hot("acme", 1 << 20))
    assert status is wire.Status.OK and [p["root"]["tenant"] for p in body["prefixes"]] == ["acme"]


def test_no_two_handshakes_get_the_same_server_challenge(sidecar):
    """The same hello every time: the server's nonce, and so its proof, must still
    differ on every connection (a nonce the client could predict or steer is a
    challenge an old recording already answers)."""
    hello = wire.encode_hello(b"\x07" * wire.NONCE_BYTES, CLIENT_ID)
    challenges = []
    for _ in range(HANDSHAKES):
        sock = _dial(sidecar.peer)
        sock.sendall(hello)
        challenges.append(_challenge(sock))
        sock.close()
    nonces = [nonce for nonce, _ in challenges]
    proofs = [p for _, p in challenges]
    assert len(set(nonces)) == HANDSHAKES and len(set(proofs)) == HANDSHAKES
    assert all(len(n) == wire.NONCE_BYTES for n in nonces)


# Budgets a peer must refuse: none, negative, and numbers that are not JSON integers.
BAD_BUDGETS = [0, -1, -(1 << 40), "1048576", True, 1.5, None]


def test_hot_listing_with_a_budget_that_is_not_a_positive_integer_is_bad_request(sidecar, secret_file):
    secret = _secret(secret_file)
    for max_bytes in BAD_BUDGETS:
        status, body = _ask(sidecar.peer, secret, _hot("acme", max_bytes))
        assert (status, body) == (wire.Status.BAD_REQUEST, {"error": "bad hot-prefixes request"}), max_bytes
        # Nothing changed and the sidecar keeps serving: the same listing with a real budget.
        status, body = _ask(sidecar.peer, secret, _hot("acme", 1 << 20))
        assert status is wire.Status.OK and [p["root"]["tenant"] for p in body["prefixes"]] == ["acme"]
    assert sidecar.get("/healthz")[0] == 200 and sidecar.proc.poll() is None
