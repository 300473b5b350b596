"""The Kubernetes side of the control API's TLS: the operator's CA Secret (read, or
made once) and each policy's certificate Secret (issued, renewed). The decisions are
`control_ca`'s pure functions; this module only reads and writes.

    <operator ns>/<ca secret>        ca.crt, ca.key      get by name; created when absent
    <operator ns>/<ca secret>        ConfigMap, ca.crt   public: what a scraper trusts
    <policy ns>/<policy>-kvtier-control-tls
                                     tls.crt, tls.key, ca.crt   (kubernetes.io/tls)
                                     written whole (create / update), never read
    policy annotation kvtier.io/control-cert   what was last issued: renewal is decided
                                     from it (`control_ca.needs_renewal`)
"""
from __future__ import annotations

import base64
import datetime as dt
import logging
from dataclasses import dataclass
from typing import Any

import kopf

from kvtier import control_tls

from kvtier_operator import control_ca, names
from kvtier_operator.kube import Kube

log = logging.getLogger("kvtier.operator.tls")

# How often each policy's certificate is checked for renewal: small against the
# eight hours between renew_at and expiry.
RENEW_CHECK_INTERVAL_S = 600.0


class ControlCaError(RuntimeError):
    """The CA Secret exists but does not hold a usable CA: the operator will not start
    on it (delete the Secret to have a new CA made)."""


def policy_names(namespace: str, policy_name: str) -> tuple[str, ...]:
    """The names a policy's certificate carries: its own, then the scrapers' shared one."""
    return (control_tls.server_name(namespace, policy_name), control_tls.SCRAPE_SERVER_NAME)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


async def ensure_ca(kube: Kube, namespace: str, secret_name: str) -> control_ca.KeyPair:
    """The operator's CA: the one in the Secret, or a new one written there (a second
    operator racing to create it loses the race and reads the winner's)."""
    for _ in range(2):
        data = await kube.read_secret_data(namespace, secret_name)
        if data is not None:
            pair = control_ca.KeyPair(data.get(control_ca.CA_CERT_KEY, b""), data.get(control_ca.CA_KEY_KEY, b""))
            if not control_ca.valid_ca(pair):
                raise ControlCaError(f"Secret {namespace}/{secret_name} does not hold a CA certificate and its key "
                                     f"({control_ca.CA_CERT_KEY}, {control_ca.CA_KEY_KEY}): delete it and restart "
                                     "the operator to have a new CA made")
            return pair
        pair = control_ca.new_ca(_now())
        body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": secret_name, "namespace": namespace,
                             "labels": {names.COMPONENT_LABEL: "control-ca"}},
                "data": {control_ca.CA_CERT_KEY: base64.b64encode(pair.cert_pem).decode(),
                         control_ca.CA_KEY_KEY: base64.b64encode(pair.key_pem).decode()}}
        if await kube.create_secret_if_absent(body):
            log.info("created the control CA in Secret %s/%s", namespace, secret_name)
            return pair
    raise ControlCaError(f"Secret {namespace}/{secret_name} neither readable nor creatable")


async def publish_ca(kube: Kube, namespace: str, name: str, ca: control_ca.KeyPair) -> None:
    """The CA certificate (never its key) in a ConfigMap of the same name, for scrapers."""
    await kube.apply_config_map({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": {names.COMPONENT_LABEL: "control-ca"}},
        "data": {control_ca.CA_CERT_KEY: ca.cert_pem.decode()},
    })


@dataclass(frozen=True, slots=True)
class PolicyCerts:
    """Issues policies' control certificates from the operator's CA (kept in memo)."""

    ca: control_ca.KeyPair

    async def ensure(self, kube: Kube, body: dict[str, Any], now: dt.datetime | None = None) -> bool:
        """Issue the policy's certificate when `control_ca.needs_renewal` says so; True
        when one was written. The Secret first, then the record: a crash between the
        two re-issues, never leaves a record of a certificate that was not written."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        now = now or _now()
        wanted = policy_names(namespace, name)
        issued = control_ca.Issued.from_record((meta.get("annotations") or {}).get(names.CONTROL_CERT_ANNOTATION))
        if not control_ca.needs_renewal(issued, now, self.ca.cert_pem, wanted):
            return False
        pair, record = control_ca.issue(self.ca, wanted, now)
        secret = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                  "metadata": {"name": names.control_tls_secret(name), "namespace": namespace,
                               "labels": {names.POLICY_LABEL: name, names.COMPONENT_LABEL: "control-tls"}},
                  "data": {control_ca.TLS_CERT_KEY: base64.b64encode(pair.cert_pem).decode(),
                           control_ca.TLS_KEY_KEY: base64.b64encode(pair.key_pem).decode(),
                           control_ca.CA_CERT_KEY: base64.b64encode(self.ca.cert_pem).decode()}}
        kopf.adopt(secret, owner=body)
        await kube.replace_secret(secret)
        await kube.patch_annotations(namespace, name, {names.CONTROL_CERT_ANNOTATION: record.record()})
        log.info("issued the control certificate of %s/%s, valid until %s", namespace, name,
                 record.not_after.isoformat())
        return True
