"""The control API over TLS, against real sidecar processes: HTTPS only on the control
port (a plain HTTP request gets no HTTP answer), a client with the wrong CA or the
wrong name never gets through, the operator's own client (`SidecarClient`) sends its
token only after a handshake that verified, a renewed certificate is served without a
restart, and bad certificate files stop the sidecar at start with a message naming
them."""
from __future__ import annotations

import asyncio
import datetime as dt
import http.client
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvtier import control_tls
from kvtier_operator import control_ca
from kvtier_operator.membership import Member, MemberName
from kvtier_operator.sidecar_client import ControlTls, SidecarClient
from kvtier_testenv.control_client import ControlEndpoint
from kvtier_testenv.fleet import FLEET_CERT_LIFETIME, fleet_namespace, fleet_tls, sidecar_config
from kvtier_testenv.polling import wait_for

TOKEN = "operator-token-that-must-not-leak"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def plain_http_answer(host: str, port: int) -> bytes:
    """What a plain HTTP request to the port gets back before the server hangs up."""
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(b"GET /cache/stats HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n")
        received = b""
        try:
            while chunk := sock.recv(4096):
                received += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    return received


def test_the_control_port_speaks_https_only(spawn):
    sc = spawn()
    host, port = sc.ready["http"].rsplit(":", 1)
    assert sc.http.startswith("https://")
    assert sc.get("/cache/stats")[0] == 200  # the fleet's CA, the fleet's name
    assert not plain_http_answer(host, int(port)).startswith(b"HTTP/")
    with pytest.raises((OSError, http.client.HTTPException)):  # the server answers with no HTTP at all
        ControlEndpoint(host, int(port)).get("/healthz")
    assert sc.proc.poll() is None


def test_a_client_with_another_ca_or_another_name_fails_the_handshake(spawn, tmp_path):
    sc = spawn()
    host, port = sc.ready["http"].rsplit(":", 1)
    tls = fleet_tls(tmp_path)
    other_ca = control_ca.new_ca(_now()).cert_pem
    with pytest.raises(ssl.SSLCertVerificationError):
        ControlEndpoint(host, int(port), tls.server_name, other_ca).get("/healthz")
    with pytest.raises(ssl.SSLCertVerificationError):
        ControlEndpoint(host, int(port), control_tls.server_name("other-ns", "fleet"), tls.ca_pem).get("/healthz")
    assert ControlEndpoint(host, int(port), tls.server_name, tls.ca_pem).get("/healthz")[0] == 200


class RecordingServer:
    """A TLS (or plain) server that records every byte it decrypts and answers 200 `{}`:
    what a client sent past the handshake, and nothing else, is in `received`."""

    def __init__(self, cert_file: Path | None, key_file: Path | None) -> None:
        self.listener = socket.create_server(("127.0.0.9", 0))
        self.port = self.listener.getsockname()[1]
        self.ctx = None
        if cert_file is not None:
            self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self.ctx.load_cert_chain(cert_file, key_file)
        self.received = b""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            try:
                conn.settimeout(5)
                if self.ctx is not None:
                    conn = self.ctx.wrap_socket(conn, server_side=True)
                data = conn.recv(65536)
                self.received += data
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                             b"Connection: close\r\n\r\n{}")
            except (OSError, ssl.SSLError):
                pass
            finally:
                conn.close()

    def close(self) -> None:
        self.listener.close()


def _issue(tmp_path: Path, ca: control_ca.KeyPair, names: tuple[str, ...], tag: str) -> tuple[Path, Path]:
    pair, _ = control_ca.issue(ca, names, _now())
    cert, key = tmp_path / f"{tag}.crt", tmp_path / f"{tag}.key"
    cert.write_bytes(pair.cert_pem)
    key.write_bytes(pair.key_pem)
    return cert, key


def _stats(make_client, member: Member):
    async def go():
        client = make_client()
        try:
            return await client._stats(member)
        finally:
            await client.close()
    return asyncio.run(go())


def _client(tmp_path: Path, ca_pem: bytes | None, port: int):
    """The operator's client with a token file: made inside the loop `_stats` runs."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    tls = ControlTls.from_ca(ca_pem) if ca_pem is not None else None
    return lambda: SidecarClient.create(token_file=str(token_file), tls=tls, http_port=port)


# The recorder's member: pod "pod-0" of policy "chat" in namespace "ns".
MEMBER = Member(MemberName("pod-0"), "127.0.0.9", 1.0, "ns", "chat")


@pytest.mark.parametrize("what", ["another CA", "another name"])
def test_the_operator_client_sends_no_token_to_a_server_whose_certificate_does_not_verify(tmp_path, what):
    ours = control_ca.new_ca(_now())
    signer = control_ca.new_ca(_now()) if what == "another CA" else ours
    names = (control_tls.server_name("ns", "chat" if what == "another CA" else "other"),)
    server = RecordingServer(*_issue(tmp_path, signer, names, "impostor"))
    try:
        assert _stats(_client(tmp_path, ours.cert_pem, server.port), MEMBER) is None
        assert TOKEN.encode() not in server.received and b"GET" not in server.received
    finally:
        server.close()


def test_the_operator_client_reaches_a_server_whose_certificate_verifies_and_only_then_sends_its_token(tmp_path):
    """The recorder above does see the token when the certificate is right: its silence
    in the impostor cases is the client's doing, not the recorder's blindness."""
    ours = control_ca.new_ca(_now())
    server = RecordingServer(*_issue(tmp_path, ours, (control_tls.server_name("ns", "chat"),), "right"))
    try:
        assert _stats(_client(tmp_path, ours.cert_pem, server.port), MEMBER) is not None  # "{}": empty stats
        assert b"GET /cache/stats" in server.received and f"Bearer {TOKEN}".encode() in server.received
    finally:
        server.close()


def test_without_tls_the_operator_client_never_sends_its_token(tmp_path):
    server = RecordingServer(None, None)
    try:
        assert _stats(_client(tmp_path, None, server.port), MEMBER) is not None
        assert b"GET /cache/stats" in server.received and TOKEN.encode() not in server.received
    finally:
        server.close()


def test_the_operator_client_gets_stats_from_a_real_sidecar_over_tls(spawn, tmp_path):
    sc = spawn()
    host, port = sc.ready["http"].rsplit(":", 1)
    member = Member(MemberName(sc.name), host, 1.0, fleet_namespace(tmp_path), "fleet")
    stats = _stats(_client(tmp_path, fleet_tls(tmp_path).ca_pem, int(port)), member)
    assert stats is not None and stats.member == sc.name and stats.lookups == 0


def _served_cert(host: str, port: int, server_name: str, ca_pem: bytes) -> bytes:
    with socket.create_connection((host, port), timeout=5) as raw:
        with control_tls.client_context(ca_pem).wrap_socket(raw, server_hostname=server_name) as tls:
            return tls.getpeercert(binary_form=True)


def test_a_renewed_certificate_is_served_without_a_restart(spawn, tmp_path):
    sc = spawn()
    host, port = sc.ready["http"].rsplit(":", 1)
    tls = fleet_tls(tmp_path)
    before = _served_cert(host, int(port), tls.server_name, tls.ca_pem)
    # A renewal from a new CA: the client below trusts only it, so a handshake that
    # verifies proves the new pair is the one served.
    new_ca = control_ca.new_ca(_now())
    pair, _ = control_ca.issue(new_ca, (tls.server_name,), _now(), FLEET_CERT_LIFETIME)
    for path, content in ((tls.key_file, pair.key_pem), (tls.cert_file, pair.cert_pem)):
        tmp = path.with_suffix(".new")
        tmp.write_bytes(content)
        tmp.replace(path)
    def renewed() -> bytes | None:
        try:  # until the sidecar polled the files it serves the old pair, which the new CA did not sign
            return _served_cert(host, int(port), tls.server_name, new_ca.cert_pem)
        except ssl.SSLCertVerificationError:
            return None
    after = wait_for("the renewed certificate served", renewed, timeout_s=30)
    assert after != before and sc.proc.poll() is None


def _start_with(tmp_path: Path, oracle, **tls) -> subprocess.CompletedProcess:
    import json

    cfg = sidecar_config("bad", "127.0.0.2", tmp_path, oracle, peer_enabled=False)
    if tls:
        cfg["control_tls"] = tls
    else:
        cfg.pop("control_tls")
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps(cfg))
    return subprocess.run([sys.executable, "-m", "kvtier_sidecar", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_bad_certificate_files_stop_the_sidecar_at_start_naming_them(tmp_path, oracle):
    good = fleet_tls(tmp_path)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    other_key = tmp_path / "other.key"
    other_key.write_bytes(control_ca.new_ca(_now()).key_pem)
    cases = {
        "missing": ({"cert_file": str(tmp_path / "nope.crt"), "key_file": str(good.key_file)}, "nope.crt does not exist"),
        "garbage": ({"cert_file": str(garbage), "key_file": str(good.key_file)}, "cannot use cert_file"),
        "wrong key": ({"cert_file": str(good.cert_file), "key_file": str(other_key)}, "cannot use cert_file"),
        "half": ({"cert_file": str(good.cert_file)}, "set both cert_file and key_file"),
    }
    for what, (tls, message) in cases.items():
        done = _start_with(tmp_path, oracle, **tls)
        assert done.returncode == 2, (what, done.stderr)
        assert message in done.stderr, (what, done.stderr)


def test_no_certificate_and_no_explicit_plain_http_is_refused(tmp_path, oracle):
    done = _start_with(tmp_path, oracle)
    assert done.returncode == 2
    assert "serves HTTPS only" in done.stderr and "plain_http" in done.stderr


def test_plain_http_is_an_explicit_choice_and_is_logged_loudly(spawn):
    sc = spawn(control_tls={"plain_http": True}, log_level="INFO")
    assert sc.http.startswith("http://")
    assert sc.get("/healthz")[0] == 200
    wait_for("the plain-HTTP warning", lambda: "CONTROL API WITHOUT TLS" in sc.log_tail(200))


def test_a_renewed_pair_that_does_not_load_leaves_the_running_certificate_served(spawn, tmp_path):
    sc = spawn(log_level="INFO")
    host, port = sc.ready["http"].rsplit(":", 1)
    tls = fleet_tls(tmp_path)
    before = _served_cert(host, int(port), tls.server_name, tls.ca_pem)
    # A key that is not the certificate's: loading it half-way would strip the live key.
    tmp = tls.key_file.with_suffix(".new")
    tmp.write_bytes(control_ca.new_ca(_now()).key_pem)
    tmp.replace(tls.key_file)
    wait_for("the rejected change logged", lambda: "certificate change rejected" in sc.log_tail(200))
    assert _served_cert(host, int(port), tls.server_name, tls.ca_pem) == before
