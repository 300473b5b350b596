"""NetworkPolicies on the real apiserver: the chart's (operator pod) and the one the
operator writes per KVCachePolicy (sidecar ports). There is no CNI here to enforce
them, so the tests read the applied objects back and evaluate their podSelector /
namespaceSelector / ports against labelled pods in Python, the way the NetworkPolicy
API defines it: a pod no policy selects takes anything; a selected pod takes what
some rule of some selecting policy allows (rules add up)."""
from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import yaml

from kvtier import policy
from helm_chart import CHART, flags, helm, operator_container
from kvtier_operator import names, netpol
from kvtier_operator.options import OperatorOptions
from kvtier_testenv.kubectl import Kubectl
HTTP, PEER, ENGINE, WEBHOOK, HEALTH, OPERATOR_METRICS = 8081, 8082, 8000, 9443, 8080, 8090

pytestmark = pytest.mark.k8s


def selector_matches(sel: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A Kubernetes LabelSelector; {} selects everything."""
    sel = sel or {}
    return policy.LabelSelector.model_validate(
        {"matchLabels": sel.get("matchLabels", {}), "matchExpressions": sel.get("matchExpressions", [])}
    ).matches(labels) if sel else True


def peer_matches(peer: dict[str, Any], src: dict, src_ns_labels: dict, policy_ns: str) -> bool:
    if "ipBlock" in peer:
        return False  # pod traffic here is named by labels, not addresses
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], src_ns_labels):
            return False
    elif src["metadata"]["namespace"] != policy_ns:
        return False
    return selector_matches(peer.get("podSelector"), src["metadata"].get("labels") or {})


def port_matches(rule_ports: list[dict] | None, port: int) -> bool:
    if not rule_ports:
        return True
    return any(p["port"] <= port <= p.get("endPort", p["port"]) for p in rule_ports)


def allowed(policies: list[dict], ns_labels: dict[str, dict], src: dict, dst: dict, port: int) -> bool:
    dst_ns = dst["metadata"]["namespace"]
    selecting = [p for p in policies if p["metadata"]["namespace"] == dst_ns
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and selector_matches(p["spec"]["podSelector"], dst["metadata"].get("labels") or {})]
    if not selecting:
        return True
    src_ns_labels = ns_labels[src["metadata"]["namespace"]]
    for p in selecting:
        for rule in p["spec"].get("ingress") or []:
            if not port_matches(rule.get("ports"), port):
                continue
            peers = rule.get("from")
            if not peers or any(peer_matches(peer, src, src_ns_labels, dst_ns) for peer in peers):
                return True
    return False


def pod(name: str, labels: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "example.com/x:1"}]}}


def test_sidecar_and_operator_policies_admit_exactly_the_intended_peers(control_plane, kubectl, namespace):
    admin = Kubectl(control_plane.kubeconfig)
    suffix = uuid.uuid4().hex[:6]
    op_ns, mon_ns, other_ns = f"kvt-sys-{suffix}", f"mon-{suffix}", f"other-{suffix}"
    for ns in (op_ns, mon_ns, other_ns):
        admin.run("create", "namespace", ns)
    try:
        # The chart's objects for a release in op_ns; the operator's flags as the chart sets them.
        rendered = helm("template", "kvtier", str(CHART), "--namespace", op_ns,
                        values={"networkPolicy": {"monitoringNamespace": mon_ns}}).stdout
        objects = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(rendered) if d}
        f = flags(operator_container(objects))
        options = OperatorOptions(network_policies=True, operator_namespace=f["operator-namespace"],
                                  operator_pod_labels=f["operator-pod-labels"],
                                  monitoring_namespace=f["monitoring-namespace"])
        selector = policy.LabelSelector.model_validate({"matchLabels": {"app": "llm"}})
        sidecar_policy = netpol.sidecar_network_policy("tiny", namespace, selector, HTTP, PEER,
                                                       options.sidecar_access())
        admin.run("apply", "-f", "-", input=json.dumps(objects[("NetworkPolicy", "kvtier-operator")]))
        admin.run("apply", "-f", "-", input=json.dumps(sidecar_policy))
        operator_labels = objects[("Deployment", "kvtier-operator")]["spec"]["template"]["metadata"]["labels"]
        injected = {"app": "llm", names.INJECTED_LABEL: names.injected_label_value("tiny")}
        pods = {
            "llm-0": (namespace, injected), "llm-1": (namespace, injected),
            # the policy's selector labels put on a pod by hand: selected, never a peer
            "forged": (namespace, {"app": "llm"}),
            "web-0": (namespace, {"app": "web"}), "operator": (op_ns, operator_labels),
            "prometheus": (mon_ns, {"app": "prometheus"}), "intruder": (other_ns, {"app": "llm"}),
        }
        for name, (ns, labels) in pods.items():
            admin.run("-n", ns, "apply", "-f", "-", input=json.dumps(pod(name, labels)))

        # Everything as the API server stored it.
        live = {name: admin.get_json("pod", name, "-n", ns) for name, (ns, _) in pods.items()}
        policies = [admin.get_json("networkpolicy", p["metadata"]["name"], "-n", p["metadata"]["namespace"])
                    for p in (objects[("NetworkPolicy", "kvtier-operator")], sidecar_policy)]
        ns_labels = {ns: admin.get_json("namespace", ns)["metadata"]["labels"]
                     for ns in {ns for ns, _ in pods.values()}}

        def selected_by(p: dict) -> set[str]:
            return {n for n, obj in live.items() if obj["metadata"]["namespace"] == p["metadata"]["namespace"]
                    and selector_matches(p["spec"]["podSelector"], obj["metadata"]["labels"])}

        assert selected_by(policies[0]) == {"operator"}
        assert selected_by(policies[1]) == {"llm-0", "llm-1", "forged"}

        def who_reaches(dst: str, port: int) -> set[str]:
            return {s for s in live if s != dst and allowed(policies, ns_labels, live[s], live[dst], port)}

        everyone_else = lambda dst: set(live) - {dst}  # noqa: E731
        assert who_reaches("llm-0", PEER) == {"llm-1"}  # the pods running the policy's sidecar only
        assert who_reaches("llm-0", HTTP) == {"operator", "prometheus"}
        assert who_reaches("llm-0", ENGINE) == everyone_else("llm-0")  # serving traffic untouched
        assert who_reaches("web-0", PEER) == everyone_else("web-0")  # not selected: not isolated
        assert who_reaches("operator", WEBHOOK) == everyone_else("operator")  # the API server's address varies
        assert who_reaches("operator", HEALTH) == everyone_else("operator")
        assert who_reaches("operator", OPERATOR_METRICS) == {"prometheus"}
        assert who_reaches("operator", HTTP) == set()  # nothing else listens there
    finally:
        for ns in (op_ns, mon_ns, other_ns):
            admin.delete("namespace", ns, wait=False)


def test_other_port_ranges_cover_every_port_but_the_sidecars():
    ranges = netpol.other_port_ranges([HTTP, PEER])
    assert ranges == [(1, HTTP - 1), (PEER + 1, netpol.MAX_PORT)]
    covered = {p for a, b in ranges for p in range(a, b + 1)}
    assert covered == set(range(1, netpol.MAX_PORT + 1)) - {HTTP, PEER}


def test_a_policy_selecting_by_expressions_opens_the_peer_port_to_exactly_the_pods_it_selects(
        control_plane, namespace):
    """Pods that carry the policy's matchLabels but fail one of its expressions are
    neither isolated by the policy nor admitted to its peer port."""
    admin = Kubectl(control_plane.kubeconfig)
    selector = policy.LabelSelector.model_validate({"matchLabels": {"app": "llm"}, "matchExpressions": [
        {"key": "tier", "operator": "NotIn", "values": ["batch"]}, {"key": "serving", "operator": "Exists"}]})
    access = netpol.SidecarAccess(operator_namespace="kvtier-system", operator_labels={"app": "op"})
    admin.run("apply", "-f", "-", input=json.dumps(netpol.sidecar_network_policy("exprs", namespace, selector,
                                                                                 HTTP, PEER, access)))
    # The webhook labels the pods it injects (the ones the selector matches).
    injected = {names.INJECTED_LABEL: names.injected_label_value("exprs")}
    pods = {"llm-0": {"app": "llm", "serving": "yes", **injected},
            "llm-1": {"app": "llm", "serving": "yes", "tier": "online", **injected},
            "batch-0": {"app": "llm", "serving": "yes", "tier": "batch"}, "bare-0": {"app": "llm"},
            "web-0": {"app": "web", "serving": "yes"}}
    for name, labels in pods.items():
        admin.run("-n", namespace, "apply", "-f", "-", input=json.dumps(pod(name, labels)))
    live = {name: admin.get_json("pod", name, "-n", namespace) for name in pods}
    stored = admin.get_json("networkpolicy", netpol.policy_name("exprs"), "-n", namespace)
    ns_labels = {namespace: admin.get_json("namespace", namespace)["metadata"]["labels"]}

    selected = {n for n, obj in live.items() if selector_matches(stored["spec"]["podSelector"], obj["metadata"]["labels"])}
    assert selected == {"llm-0", "llm-1"}

    def who_reaches(dst: str, port: int) -> set[str]:
        return {s for s in live if s != dst and allowed([stored], ns_labels, live[s], live[dst], port)}

    assert who_reaches("llm-0", PEER) == {"llm-1"}
    assert who_reaches("llm-1", PEER) == {"llm-0"}
    assert who_reaches("batch-0", PEER) == set(live) - {"batch-0"}  # not selected: not isolated
    assert who_reaches("llm-0", ENGINE) == set(live) - {"llm-0"}


def test_the_http_port_never_opens_to_a_whole_namespace():
    selector = policy.LabelSelector.model_validate({"matchLabels": {"app": "llm"}})
    with pytest.raises(ValueError, match="operator's pod labels"):
        netpol.sidecar_network_policy("tiny", "ns", selector, HTTP, PEER, netpol.SidecarAccess("kvtier-system"))
    # The operator's defaults (flags or environment left out) name the chart's operator pods.
    defaults = OperatorOptions(network_policies=True, operator_namespace="kvtier-system")
    env = {k: v for k, v in defaults.to_env().items() if k != "KVTIER_OPERATOR_OPERATOR_POD_LABELS"}
    for options in (defaults, OperatorOptions.from_env(env)):
        body = netpol.sidecar_network_policy("tiny", "ns", selector, HTTP, PEER, options.sidecar_access())
        http_rule = next(r for r in body["spec"]["ingress"] if r["ports"][0]["port"] == HTTP)
        assert [p["podSelector"] for p in http_rule["from"]] == [
            {"matchLabels": {"app.kubernetes.io/name": "kvtier-operator"}}]


def egress_allowed(policies: list[dict], ns_labels: dict[str, dict], src: dict, dst: dict, port: int) -> bool:
    """`allowed` for the source's side: the Egress rules of the policies selecting `src`."""
    src_ns = src["metadata"]["namespace"]
    selecting = [p for p in policies if p["metadata"]["namespace"] == src_ns
                 and "Egress" in p["spec"].get("policyTypes", [])
                 and selector_matches(p["spec"]["podSelector"], src["metadata"].get("labels") or {})]
    if not selecting:
        return True
    dst_ns_labels = ns_labels[dst["metadata"]["namespace"]]
    for p in selecting:
        for rule in p["spec"].get("egress") or []:
            if not port_matches(rule.get("ports"), port):
                continue
            peers = rule.get("to")
            if not peers or any(peer_matches(peer, dst, dst_ns_labels, src_ns) for peer in peers):
                return True
    return False


def test_endpoint_picker_policy_admits_the_gateway_and_reaches_only_its_pool(control_plane, namespace):
    """The kvtier EPP's NetworkPolicy (endpointPicker.*), applied and read back: ext_proc
    from the gateway's namespace only, metrics from the monitoring namespace only; out,
    the serving pods' engine port (metrics scrape) but not their sidecar ports."""
    admin = Kubectl(control_plane.kubeconfig)
    suffix = uuid.uuid4().hex[:6]
    gw_ns, mon_ns, other_ns = f"gw-{suffix}", f"mon-{suffix}", f"other-{suffix}"
    for ns in (gw_ns, mon_ns, other_ns):
        admin.run("create", "namespace", ns)
    try:
        values = {"networkPolicy": {"monitoringNamespace": mon_ns}, "endpointPicker": {
            "enabled": True, "gatewayFrom": [{"namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": gw_ns}}}],
            "pools": [{"name": "llama", "namespace": namespace, "policy": "tiny", "selector": {"app": "llm"},
                       "targetPort": ENGINE, "redisUrl": "redis://redis:6390"}]}}
        rendered = helm("template", "kvtier", str(CHART), "--namespace", "kvtier-system", values=values).stdout
        objects = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(rendered) if d}
        admin.run("apply", "-f", "-", input=json.dumps(objects[("NetworkPolicy", "llama-epp")]))
        epp_labels = objects[("Deployment", "llama-epp")]["spec"]["template"]["metadata"]["labels"]
        pods = {"epp": (namespace, epp_labels), "llm-0": (namespace, {"app": "llm"}),
                "redis": (namespace, {"app": "redis"}), "envoy": (gw_ns, {"app": "envoy"}),
                "prometheus": (mon_ns, {"app": "prometheus"}), "intruder": (other_ns, {"app": "llm"})}
        for name, (ns, labels) in pods.items():
            admin.run("-n", ns, "apply", "-f", "-", input=json.dumps(pod(name, labels)))
        live = {name: admin.get_json("pod", name, "-n", ns) for name, (ns, _) in pods.items()}
        stored = [admin.get_json("networkpolicy", "llama-epp", "-n", namespace)]
        ns_labels = {ns: admin.get_json("namespace", ns)["metadata"]["labels"]
                     for ns in {ns for ns, _ in pods.values()}}

        def who_reaches(dst: str, port: int) -> set[str]:
            return {s for s in live if s != dst and allowed(stored, ns_labels, live[s], live[dst], port)}

        def reached_from_epp(port: int) -> set[str]:
            return {d for d in live if d != "epp" and egress_allowed(stored, ns_labels, live["epp"], live[d], port)}

        assert who_reaches("epp", 9002) == {"envoy"}
        assert who_reaches("epp", 9090) == {"prometheus"}
        assert who_reaches("epp", 8080) == set()
        assert reached_from_epp(ENGINE) == {"llm-0"}  # its pool's pods, not another namespace's
        assert reached_from_epp(HTTP) == set() and reached_from_epp(PEER) == set()
        assert reached_from_epp(6390) == set(live) - {"epp"}  # Redis's port, wherever Redis runs
        assert reached_from_epp(53) == set(live) - {"epp"}
        assert who_reaches("llm-0", ENGINE) == set(live) - {"llm-0"}  # the serving pods are not isolated by it
    finally:
        for ns in (gw_ns, mon_ns, other_ns):
            admin.delete("namespace", ns, wait=False)
