"""The operator writes each KVCachePolicy's sidecar NetworkPolicy (what it admits is
evaluated in tests/helm/test_network_policy.py)."""
from __future__ import annotations

import json

import pytest

from kvtier_operator import names, netpol
from operator_harness import wait_for
from sidecar_fleet import tiny_policy

PEER = 8082

pytestmark = pytest.mark.k8s


@pytest.mark.parametrize("operator", [dict(network_policies=True, operator_namespace="kvtier-system",
                                           operator_pod_labels="app.kubernetes.io/name=kvtier-operator",
                                           monitoring_namespace="monitoring")], indirect=True)
def test_operator_writes_the_policys_network_policy_owned_by_the_policy(operator, kubectl):
    kubectl.apply(tiny_policy("tiny", "llm"))
    name = netpol.policy_name("tiny")
    np = wait_for("the sidecar NetworkPolicy", lambda: (out := kubectl.run(
        "get", "networkpolicy", name, "-o", "json", check=False)).returncode == 0 and json.loads(out.stdout))
    assert np["spec"]["podSelector"] == {"matchLabels": {"app": "llm"}}
    assert np["metadata"]["ownerReferences"][0]["kind"] == "KVCachePolicy"
    assert np["metadata"]["labels"][names.POLICY_LABEL] == "tiny"
    peer_rule = next(r for r in np["spec"]["ingress"] if r["ports"][0]["port"] == PEER)
    # The peer port admits the pods the webhook injected for this policy, by the label it sets.
    assert peer_rule["from"] == [{"podSelector": {"matchLabels": {names.INJECTED_LABEL: "tiny"}}}]
