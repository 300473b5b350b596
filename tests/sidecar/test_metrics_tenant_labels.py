"""/metrics lists no tenant names to anyone who may not read them: while it answers
without a token (the control API wanting one), tenant labels are digests keyed by the
policy's peer secret — the same on every sidecar sharing it, different under another
secret — and behind `protect_metrics` the operator's token reads the names."""
from __future__ import annotations

import re

import pytest

from kvtier_sidecar.client import SidecarClient

from .test_control_auth import call, identities  # noqa: F401  (the fixture)
from .test_sidecar_process import prompt, seed_cache

pytestmark = pytest.mark.k8s

TENANT = "acme-secret-project"


def tenant_labels(text: str) -> set[str]:
    return set(re.findall(r'kvtier_lookups_total\{tenant="([^"]*)"', text))


def reviewed_sidecar(spawn, control_plane, identities, name: str, ip: str, secret: str, **auth):  # noqa: F811
    sc = spawn(name, ip, None, secret, control_auth={
        "mode": "tokenreview", "api_server": control_plane.url, "ca_file": str(control_plane.ca_cert),
        "token_file": identities["serving_token_file"], "allowed_users": [identities["operator_user"]], **auth})
    return sc


def test_open_metrics_carry_keyed_digests_of_tenants_and_protected_ones_the_names(
        spawn, oracle, control_plane, identities, tmp_path):  # noqa: F811
    fleet_secret, other_secret = tmp_path / "fleet", tmp_path / "other"
    fleet_secret.write_text("f" * 64)
    other_secret.write_text("0" * 64)
    open_a = reviewed_sidecar(spawn, control_plane, identities, "a", "127.0.0.2", str(fleet_secret))
    open_b = reviewed_sidecar(spawn, control_plane, identities, "b", "127.0.0.3", str(fleet_secret))
    elsewhere = reviewed_sidecar(spawn, control_plane, identities, "c", "127.0.0.4", str(other_secret))
    protected = reviewed_sidecar(spawn, control_plane, identities, "d", "127.0.0.5", str(fleet_secret),
                                 protect_metrics=True)
    tokens = prompt(64, seed=5)
    for sc in (open_a, open_b, elsewhere, protected):
        seed_cache(SidecarClient(sc.socket), oracle, TENANT, tokens)

    open_labels = [tenant_labels(call(sc, "GET", "/metrics")[1]) for sc in (open_a, open_b, elsewhere)]
    for labels, sc in zip(open_labels, (open_a, open_b, elsewhere)):
        status, text = call(sc, "GET", "/metrics")
        assert status == 200 and TENANT not in text
        assert len(labels) == 1 and next(iter(labels)).startswith("h-")
    assert open_labels[0] == open_labels[1]  # one fleet, one secret: the series add up
    assert open_labels[0] != open_labels[2]  # another secret: nothing to compare against

    assert call(protected, "GET", "/metrics")[0] == 401
    status, text = call(protected, "GET", "/metrics", identities["operator"])
    assert status == 200 and tenant_labels(text) == {TENANT}
    # The operator still learns the names where it is meant to: its stats.
    assert TENANT in call(open_a, "GET", "/cache/stats", identities["operator"])[1]["tenants"]
