"""Strict input on the control API and the engine socket: a clear refusal that changes
nothing, and the server (and the engine's connection) keeps serving."""
import json
import socket
import pytest

from kvtier_sidecar.client import SidecarClient, root_payload
from kvtier_sidecar.engine_proto import FRAME, EngineOp, encode
from kvtier.control_api import MAX_WARM_BYTES
from kvtier.peer_address import PeerAddress, parse_peer
from .test_sidecar_process import prompt, seed_cache


@pytest.mark.parametrize("text, why", [
    ("127.0.0.3:0", "1..65535"), ("127.0.0.3:99999", "1..65535"), ("127.0.0.3:", "1..65535"),
    ("127.0.0.3:-1", "1..65535"), ("127.0.0.3:1e3", "1..65535"), ("x:1", "single-label"),
    ("nohost", "host:port"), (":80", "host:port"), ("300.1.1.1:80", "IPv4"),
    ("fd00::1:80", "brackets"), ("[zz::1]:80", "IPv6"), ("a_b.svc:80", "RFC 1123"),
    ("-a.svc:80", "RFC 1123"), ("a..b:80", "RFC 1123"), ("a" * 64 + ".svc:80", "RFC 1123"),
])
def test_peer_address_refuses_bad_ports_and_hosts_with_the_reason(text, why):
    with pytest.raises(ValueError, match=why.replace(".", r"\.").replace("[", r"\[")):
        parse_peer(text)


def test_peer_address_accepts_ipv4_bracketed_ipv6_and_dotted_names():
    assert parse_peer("10.0.0.7:7400") == PeerAddress("10.0.0.7", 7400)
    assert parse_peer("[FD00::7]:1") == PeerAddress("fd00::7", 1)
    assert str(parse_peer("[fd00::7]:65535")) == "[fd00::7]:65535"
    assert parse_peer("Pod-0.serving.ns.svc:8080") == PeerAddress("pod-0.serving.ns.svc", 8080)


def _warm(side, **fields):
    body = {"tenant": "t", "from_peer": "127.0.0.9:7400", "max_bytes": 1 << 20, **fields}
    return side.post("/cache/warm", json.dumps(body).encode())


def test_warm_refuses_bad_peers_and_loose_integers_with_422_and_starts_no_job(spawn, secret_file):
    side = spawn("a", "127.0.0.2", None, secret_file)
    cases = [
        {"from_peer": "127.0.0.3:0"}, {"from_peer": "127.0.0.3:99999"}, {"from_peer": "x:1"},
        {"max_bytes": True}, {"max_bytes": "100"}, {"max_bytes": 10 ** 30}, {"max_bytes": 1.0},
        {"max_bytes": MAX_WARM_BYTES + 1}, {"max_bytes": 0},
    ]
    for fields in cases:
        status, text = _warm(side, **fields)
        assert status == 422, (fields, status, text)
        message = json.loads(text)["error"]
        assert next(iter(fields)) in message, (fields, message)
    assert json.loads(side.get("/cache/jobs")[1]) == {}
    assert _warm(side, max_bytes=MAX_WARM_BYTES)[0] == 202  # the bound itself is allowed
    assert side.get("/healthz")[0] == 200 and side.proc.poll() is None


def test_reused_ref_with_other_parameters_is_409_and_the_same_parameters_answer_the_first_job(spawn, secret_file):
    side = spawn("a", "127.0.0.2", None, secret_file)
    status, first = _warm(side, ref="epoch-3/t")
    assert status == 202
    first = json.loads(first)
    for changed in ({"max_bytes": 2 << 20}, {"tenant": "u"}, {"from_peer": "127.0.0.8:7400"}):
        status, text = _warm(side, ref="epoch-3/t", **changed)
        assert status == 409, (changed, status)
        assert "epoch-3/t" in json.loads(text)["error"]
    status, again = _warm(side, ref="epoch-3/t")
    assert status == 202 and json.loads(again) == {**first, "started": False}
    jobs = json.loads(side.get("/cache/jobs")[1])
    assert list(jobs) == [first["job"]] and jobs[first["job"]]["asks"] == 2


def _ask(sock: socket.socket, op: int, rid: int, payload_json: bytes, tail: bytes = b"") -> dict:
    sock.sendall(FRAME.pack(4 + len(payload_json) + len(tail), op, rid, len(payload_json)) + payload_json + tail)
    head = _recv(sock, FRAME.size)
    body_len, _, got_rid, json_len = FRAME.unpack(head)
    rest = _recv(sock, body_len - 4)
    assert got_rid == rid
    return json.loads(rest[:json_len])


def _recv(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "sidecar hung up"
        out += chunk
    return out


def test_engine_socket_numeric_overflow_and_loose_numbers_are_errors_on_a_connection_that_stays_usable(spawn, oracle):
    side = spawn()
    tokens = prompt(64)
    seed_cache(SidecarClient(side.socket), oracle, "t", tokens)
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(5)
    sock.connect(side.socket)
    bad = [
        (EngineOp.RELEASE, b'{"hit": 1e400}', "hit"),
        (EngineOp.RELEASE, b'{"hit": true}', "hit"),
        (EngineOp.RELEASE, b'{"hit": "7"}', "hit"),
        (EngineOp.RELEASE, b'{"hit": -1}', "hit"),
        (EngineOp.RELEASE, b'{"hit": 99999999999999999999999999}', "hit"),
        (EngineOp.STORE_COMMIT, b'{"ticket": 1, "rank": 1e400}', "rank"),
        (EngineOp.STORE_ABORT, b'{"ticket": NaN}', "ticket"),
        (EngineOp.STORE_ABORT, b'{}', "ticket"),
    ]
    for i, (op, payload, field) in enumerate(bad, start=1):
        answer = _ask(sock, op, i, payload)
        assert field in answer.get("error", ""), (payload, answer)
    # The same connection still serves: a lookup hits the seeded prefix.
    lookup = encode(EngineOp.LOOKUP, 99, {"root": root_payload(oracle.root("t"))}, tokens)
    sock.sendall(lookup)
    head = _recv(sock, FRAME.size)
    body_len, _, rid, json_len = FRAME.unpack(head)
    answer = json.loads(_recv(sock, body_len - 4)[:json_len])
    assert rid == 99 and answer["hit"] > 0 and answer["matched_tokens"] == 48
    sock.close()
    assert side.proc.poll() is None
    assert "Traceback" not in side.log_tail(200)
