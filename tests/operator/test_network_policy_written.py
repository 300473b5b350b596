"""The operator writes each KVCachePolicy's sidecar NetworkPolicy (what it admits is
evaluated in tests/helm/test_network_policy.py)."""
from __future__ import annotations

import json

import pytest

from kvtier import policy
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


# A selector by expressions only: serving pods of `llm` that are not batch workers.
EXPRESSIONS = [{"key": "app", "operator": "In", "values": ["llm"]},
               {"key": "tier", "operator": "NotIn", "values": ["batch"]},
               {"key": "kvtier.example/serving", "operator": "Exists"}]


def test_a_selector_by_expressions_is_rendered_whole_in_the_pod_selector_and_the_peer_rule():
    selector = policy.LabelSelector.model_validate({"matchLabels": {"team": "a"}, "matchExpressions": EXPRESSIONS})
    body = netpol.sidecar_network_policy("tiny", "ns", selector, 8081, PEER,
                                         netpol.SidecarAccess("kvtier-system", {"app": "op"}))
    wanted = {"matchLabels": {"team": "a"}, "matchExpressions": EXPRESSIONS}
    assert body["spec"]["podSelector"] == wanted  # every selected pod is isolated
    # ... and its peer port admits only the pods the webhook injected for this policy
    # (a subset of those the expressions select), never the selector's labels alone.
    [peer_rule] = [r for r in body["spec"]["ingress"] if r["ports"] == [{"protocol": "TCP", "port": PEER}]]
    assert peer_rule["from"] == [{"podSelector": {"matchLabels": {names.INJECTED_LABEL: "tiny"}}}]


@pytest.mark.parametrize("operator", [dict(network_policies=True, operator_namespace="kvtier-system",
                                           operator_pod_labels="app.kubernetes.io/name=kvtier-operator")],
                         indirect=True)
def test_operator_writes_a_policys_expressions_into_its_network_policy(operator, kubectl):
    kubectl.apply(tiny_policy("exprs", "llm", selector={"matchExpressions": EXPRESSIONS}))
    name = netpol.policy_name("exprs")
    np = wait_for("the sidecar NetworkPolicy", lambda: (out := kubectl.run(
        "get", "networkpolicy", name, "-o", "json", check=False)).returncode == 0 and json.loads(out.stdout))
    assert np["spec"]["podSelector"] == {"matchExpressions": EXPRESSIONS}
    peer_rule = next(r for r in np["spec"]["ingress"] if r["ports"][0]["port"] == PEER)
    assert peer_rule["from"] == [{"podSelector": {"matchLabels": {names.INJECTED_LABEL: "exprs"}}}]


def test_the_rendered_policy_is_exactly_the_three_rules_and_leaves_nothing_out():
    access = netpol.SidecarAccess("kvtier-system", {"app": "op"}, monitoring_namespace="monitoring")
    selector = policy.LabelSelector.model_validate({"matchLabels": {"app": "llm"}})
    # Ports one apart: the open rule between them is a single port, without endPort.
    body = netpol.sidecar_network_policy("tiny", "ns", selector, 8081, 8083, access)
    ns = lambda name: {"matchLabels": {"kubernetes.io/metadata.name": name}}  # noqa: E731
    assert body == {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "tiny-kvtier-sidecar", "namespace": "ns",
                     "labels": {names.POLICY_LABEL: "tiny", names.COMPONENT_LABEL: "sidecar-network-policy"}},
        "spec": {"podSelector": {"matchLabels": {"app": "llm"}}, "policyTypes": ["Ingress"], "ingress": [
            {"ports": [{"protocol": "TCP", "port": 8083}],
             "from": [{"podSelector": {"matchLabels": {names.INJECTED_LABEL: "tiny"}}}]},
            {"ports": [{"protocol": "TCP", "port": 8081}],
             "from": [{"namespaceSelector": ns("kvtier-system"), "podSelector": {"matchLabels": {"app": "op"}}},
                      {"namespaceSelector": ns("monitoring")}]},
            {"ports": [{"protocol": "TCP", "port": 1, "endPort": 8080}, {"protocol": "TCP", "port": 8082},
                       {"protocol": "TCP", "port": 8084, "endPort": 65535}]},
        ]},
    }
    # Without a monitoring namespace only the operator reaches the HTTP port; with the
    # other ports closed there is no third rule.
    closed = netpol.sidecar_network_policy("tiny", "ns", selector, 8081, 8083,
                                           netpol.SidecarAccess("kvtier-system", {"app": "op"}, other_ports_open=False))
    assert [r["from"] for r in closed["spec"]["ingress"]] == [
        [{"podSelector": {"matchLabels": {names.INJECTED_LABEL: "tiny"}}}],
        [{"namespaceSelector": ns("kvtier-system"), "podSelector": {"matchLabels": {"app": "op"}}}]]
    assert netpol.SidecarAccess("x").other_ports_open is True


def test_other_port_ranges_keep_the_last_port_and_merge_nothing_across_a_closed_one():
    assert netpol.other_port_ranges([65534]) == [(1, 65533), (65535, 65535)]
    assert netpol.other_port_ranges([65535, 1]) == [(2, 65534)]
    assert netpol.other_port_ranges([]) == [(1, 65535)]


def test_sidecar_access_is_a_value_that_cannot_change_under_the_policy_rendered_from_it():
    access = netpol.SidecarAccess("kvtier-system")
    with pytest.raises(AttributeError):
        access.other_ports_open = False  # type: ignore[misc]
