"""The operator's CA for the sidecars' control API, and the serving certificates it
issues (one per KVCachePolicy, `control_tls.server_name`). Pure: values in, PEM out;
the Secrets that hold them are written by `reconcile` and `handlers`.

Lifetimes and renewal:

    CA                 CA_LIFETIME (10 years), made once, kept in the Secret
                       <operator namespace>/<control CA secret>; a restarted operator
                       reuses it. Rotated by deleting that Secret and restarting the
                       operator (every policy's certificate is then re-issued).
    serving cert       CERT_LIFETIME (24 h): a stolen key is worth a day.
                       Renewed once RENEW_AFTER_FRACTION of its lifetime has passed
                       (8 h before it expires: an operator away for less than that
                       never lets a sidecar's certificate lapse), or at once when it was
                       issued by another CA or for other names (`needs_renewal`).
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_LIFETIME = dt.timedelta(days=3650)
CERT_LIFETIME = dt.timedelta(hours=24)
RENEW_AFTER_FRACTION = 2 / 3
# Clocks across a cluster disagree by seconds: a certificate is valid from a little before it is made.
CLOCK_SKEW = dt.timedelta(minutes=5)
CA_COMMON_NAME = "kvtier control CA"
SUBJECT_COMMON_NAME = "kvtier-sidecar"
# Keys of the CA Secret (and of each policy's TLS Secret: kubernetes.io/tls plus ca.crt).
CA_CERT_KEY, CA_KEY_KEY = "ca.crt", "ca.key"
TLS_CERT_KEY, TLS_KEY_KEY = "tls.crt", "tls.key"


@dataclass(frozen=True, slots=True)
class KeyPair:
    cert_pem: bytes
    key_pem: bytes


@dataclass(frozen=True, slots=True)
class Issued:
    """What the operator remembers of a certificate it issued (on the policy, as
    `record()`): enough to decide its renewal without reading the Secret back."""

    not_before: dt.datetime
    not_after: dt.datetime
    ca_digest: str
    names: tuple[str, ...]

    def record(self) -> str:
        return json.dumps({"notBefore": self.not_before.isoformat(), "notAfter": self.not_after.isoformat(),
                           "ca": self.ca_digest, "names": list(self.names)}, sort_keys=True)

    @classmethod
    def from_record(cls, raw: str | None) -> "Issued | None":
        """None for a missing or unreadable record: the certificate is then re-issued."""
        try:
            data = json.loads(raw or "")
            return cls(dt.datetime.fromisoformat(data["notBefore"]), dt.datetime.fromisoformat(data["notAfter"]),
                       str(data["ca"]), tuple(data["names"]))
        except (TypeError, ValueError, KeyError):
            return None


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def new_ca(now: dt.datetime) -> KeyPair:
    """A fresh self-signed CA (EC P-256) that may sign serving certificates only."""
    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_COMMON_NAME)])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + CA_LIFETIME)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def ca_digest(ca_cert_pem: bytes) -> str:
    return hashlib.sha256(ca_cert_pem).hexdigest()[:16]


def issue(ca: KeyPair, names: tuple[str, ...], now: dt.datetime,
          lifetime: dt.timedelta = CERT_LIFETIME) -> tuple[KeyPair, Issued]:
    """A serving certificate for DNS `names` (in its subjectAltName, which is what TLS
    clients check), signed by `ca`. The subject is a fixed short name: a common name
    holds 64 characters, a policy's full name may not fit."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    key = _key()
    not_before, not_after = now - CLOCK_SKEW, now + lifetime
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SUBJECT_COMMON_NAME)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before).not_valid_after(not_after)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pair = KeyPair(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))
    return pair, Issued(not_before, not_after, ca_digest(ca.cert_pem), tuple(names))


def renew_at(issued: Issued) -> dt.datetime:
    """When a certificate is due for renewal: RENEW_AFTER_FRACTION into its lifetime."""
    return issued.not_before + (issued.not_after - issued.not_before) * RENEW_AFTER_FRACTION


def needs_renewal(issued: Issued | None, now: dt.datetime, ca_cert_pem: bytes, names: tuple[str, ...]) -> bool:
    """Issue (again) when nothing was issued, it is due (`renew_at`), it came from
    another CA, or it covers other names."""
    if issued is None or issued.ca_digest != ca_digest(ca_cert_pem) or issued.names != tuple(names):
        return True
    return now >= renew_at(issued)


def valid_ca(pair: KeyPair) -> bool:
    """The pair parses, is a CA, and its key is the certificate's (the operator refuses
    to start on a CA Secret edited into anything else)."""
    try:
        cert = x509.load_pem_x509_certificate(pair.cert_pem)
        key = serialization.load_pem_private_key(pair.key_pem, password=None)
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except (ValueError, TypeError, x509.ExtensionNotFound):
        return False
    return is_ca and cert.public_key().public_numbers() == key.public_key().public_numbers()
