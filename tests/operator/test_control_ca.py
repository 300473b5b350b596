"""The operator's control CA and the certificates it issues, as pure functions: what a
certificate carries, when it is renewed (`control_ca.needs_renewal`), and that a
client trusting the CA verifies exactly the names it was issued for (a real TLS
handshake over a socket pair)."""
from __future__ import annotations

import datetime as dt
import socket
import ssl
import threading

import pytest
from cryptography import x509

from kvtier import control_tls
from kvtier_operator import control_ca, control_certs

NOW = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.timezone.utc)
NAMES = control_certs.policy_names("serving", "chat")


@pytest.fixture(scope="module")
def ca() -> control_ca.KeyPair:
    return control_ca.new_ca(NOW)


def test_a_policy_certificate_names_the_policy_then_the_scrapers_name(ca):
    pair, issued = control_ca.issue(ca, NAMES, NOW)
    cert = x509.load_pem_x509_certificate(pair.cert_pem)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert sans == ["chat.serving.kvtier-sidecar", "kvtier-sidecar"]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert cert.not_valid_after_utc - cert.not_valid_before_utc == control_ca.CERT_LIFETIME + control_ca.CLOCK_SKEW
    assert (issued.not_before, issued.not_after) == (cert.not_valid_before_utc, cert.not_valid_after_utc)
    assert issued.names == NAMES and issued.ca_digest == control_ca.ca_digest(ca.cert_pem)


def test_renewal_is_due_two_thirds_into_the_lifetime_and_not_a_second_before(ca):
    _, issued = control_ca.issue(ca, NAMES, NOW)
    due = control_ca.renew_at(issued)
    assert due == issued.not_before + (issued.not_after - issued.not_before) * 2 / 3
    # Eight hours (a third of the day, less the skew's share) before it expires.
    assert issued.not_after - due == (control_ca.CERT_LIFETIME + control_ca.CLOCK_SKEW) / 3
    second = dt.timedelta(seconds=1)
    assert not control_ca.needs_renewal(issued, NOW, ca.cert_pem, NAMES)
    assert not control_ca.needs_renewal(issued, due - second, ca.cert_pem, NAMES)
    assert control_ca.needs_renewal(issued, due, ca.cert_pem, NAMES)
    assert control_ca.needs_renewal(issued, issued.not_after + second, ca.cert_pem, NAMES)


def test_renewal_is_due_at_once_for_nothing_issued_another_ca_or_other_names(ca):
    _, issued = control_ca.issue(ca, NAMES, NOW)
    assert control_ca.needs_renewal(None, NOW, ca.cert_pem, NAMES)
    assert control_ca.needs_renewal(issued, NOW, control_ca.new_ca(NOW).cert_pem, NAMES)
    assert control_ca.needs_renewal(issued, NOW, ca.cert_pem, control_certs.policy_names("serving", "other"))


def test_the_issuance_record_round_trips_and_garbage_means_reissue(ca):
    _, issued = control_ca.issue(ca, NAMES, NOW)
    assert control_ca.Issued.from_record(issued.record()) == issued
    for garbage in (None, "", "{", "[]", '{"notAfter": "x"}', '{"notBefore": "2026", "notAfter": "y", "ca": 1}'):
        assert control_ca.Issued.from_record(garbage) is None


def test_only_a_ca_whose_key_is_its_own_is_a_usable_ca(ca):
    other = control_ca.new_ca(NOW)
    served, _ = control_ca.issue(ca, NAMES, NOW)
    assert control_ca.valid_ca(ca)
    assert not control_ca.valid_ca(control_ca.KeyPair(ca.cert_pem, other.key_pem))
    assert not control_ca.valid_ca(served)  # a serving certificate is no CA
    assert not control_ca.valid_ca(control_ca.KeyPair(b"garbage", b"garbage"))


def _handshake(server_pair: control_ca.KeyPair, tmp_path, trust_pem: bytes, name: str) -> None:
    """A TLS handshake between a server presenting `server_pair` and a client trusting
    `trust_pem` and checking `name`; raises what the client raises."""
    cert, key = tmp_path / "s.crt", tmp_path / "s.key"
    cert.write_bytes(server_pair.cert_pem)
    key.write_bytes(server_pair.key_pem)
    server_ctx = control_tls.server_context(str(cert), str(key))
    a, b = socket.socketpair()

    def serve() -> None:
        try:
            with server_ctx.wrap_socket(a, server_side=True):
                pass
        except (ssl.SSLError, OSError):
            pass
    t = threading.Thread(target=serve)
    t.start()
    try:
        with control_tls.client_context(trust_pem).wrap_socket(b, server_hostname=name):
            pass
    finally:
        b.close()
        t.join(5)


def test_a_client_trusting_the_ca_verifies_exactly_the_issued_names(ca, tmp_path):
    pair, _ = control_ca.issue(ca, NAMES, dt.datetime.now(dt.timezone.utc))
    for name in NAMES:
        _handshake(pair, tmp_path, ca.cert_pem, name)
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(pair, tmp_path, ca.cert_pem, control_tls.server_name("serving", "other"))
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(pair, tmp_path, control_ca.new_ca(NOW).cert_pem, NAMES[0])


def test_an_expired_certificate_does_not_verify(ca, tmp_path):
    long_ago = dt.datetime.now(dt.timezone.utc) - 2 * control_ca.CERT_LIFETIME
    pair, _ = control_ca.issue(ca, NAMES, long_ago)
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(pair, tmp_path, ca.cert_pem, NAMES[0])
