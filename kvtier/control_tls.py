"""TLS of the sidecar's HTTP control API: the names its certificates carry and the
`ssl` contexts both ends build. Standard library only (the sidecar serves, the
operator and the test environment call; `kvtier_operator.control_ca` issues).

Trust: the operator's CA (a Secret in its namespace) signs one serving certificate per
KVCachePolicy. The certificate names the policy, not a pod: the webhook injects before
a pod has an IP, so a client connects to the pod IP and verifies the policy's name
(`server_name`) with `server_hostname`. Every certificate also carries
`SCRAPE_SERVER_NAME`, the one name a Prometheus scrape job can verify for all sidecars.

    client  --TLS (CA = the operator's, SNI/verify = <policy>.<namespace>.kvtier-sidecar)-->  sidecar
             bearer token only after the handshake verified
"""
from __future__ import annotations

import ssl
from pathlib import Path

# The DNS-style name a policy's sidecars prove: policy and namespace are DNS labels
# (the CRD's name rule), so the name is a valid SAN. Not resolvable; never looked up.
SERVER_NAME_SUFFIX = "kvtier-sidecar"
# On every sidecar certificate: what a scraper verifies (it cannot name each policy).
SCRAPE_SERVER_NAME = SERVER_NAME_SUFFIX


def server_name(namespace: str, policy: str) -> str:
    """The name the sidecars of `policy` in `namespace` present and clients verify."""
    return f"{policy}.{namespace}.{SERVER_NAME_SUFFIX}"


class ControlTlsError(ValueError):
    """A control API certificate or key that cannot be used; the message says which
    file and what to fix."""


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """The sidecar's serving context (TLS 1.2+), loaded from PEM files."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    load_chain(ctx, cert_file, key_file)
    return ctx


def load_chain(ctx: ssl.SSLContext, cert_file: str, key_file: str) -> None:
    """(Re)load the serving certificate into `ctx`: handshakes from now on present it.
    ControlTlsError when a file is missing, unreadable, not PEM, or the key does not
    match the certificate; `ctx` then keeps what it had."""
    for what, path in (("cert_file", cert_file), ("key_file", key_file)):
        if not Path(path).is_file():
            raise ControlTlsError(f"control_tls.{what} {path} does not exist: mount the policy's control TLS "
                                  f"Secret there (the webhook does), or point {what} at a PEM file")
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        raise ControlTlsError(f"control_tls: cannot use cert_file {cert_file} with key_file {key_file} "
                              f"({exc.reason or exc}): both must be PEM, the key the certificate's own") from None
    except OSError as exc:
        raise ControlTlsError(f"control_tls: cannot read {exc.filename or cert_file}: {exc.strerror or exc}") from None


def client_context(ca_pem: bytes | str) -> ssl.SSLContext:
    """A client context that trusts only `ca_pem` (the operator's CA) and checks the
    server's name: a wrong CA or a wrong name fails the handshake, before any request
    (and so any token) is sent."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=ca_pem.decode() if isinstance(ca_pem, bytes)
                                     else ca_pem)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
