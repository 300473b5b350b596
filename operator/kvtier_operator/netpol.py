"""The NetworkPolicy guarding one KVCachePolicy's sidecar ports. Pure: the handler
applies the body (owned by the policy, so it goes when the policy goes).

    peer port (block transfers)   from the pods running this policy's sidecar only: by the
                                  label the injection webhook sets (`names.INJECTED_LABEL`),
                                  not the selector's labels, which anyone may put on a pod
    HTTP port (control, metrics)  from the operator's pods and, when configured, from
                                  the monitoring namespace (Prometheus scrapes /metrics;
                                  the control endpoints there still need the
                                  operator's token)
    every other port              unchanged in effect: open to any source, unless
                                  `other_ports_open` is off (then the pod's other
                                  ports are closed unless another policy opens them)

A NetworkPolicy isolates whole pods, not ports, and policies add up: a rule can only
allow. Keeping the serving ports open is what lets this policy select serving pods
without cutting off their inference traffic; a cluster that restricts those ports
with policies of its own turns `other_ports_open` off, or this policy's open rule
would widen them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier import policy

from kvtier_operator import names

# The highest TCP port.
MAX_PORT = 65535


@dataclass(frozen=True, slots=True)
class SidecarAccess:
    """Who, besides the policy's own pods, may reach the sidecars (operator flags)."""

    operator_namespace: str
    operator_labels: dict[str, str] = field(default_factory=dict)
    monitoring_namespace: str | None = None
    other_ports_open: bool = True


def policy_name(policy_name_: str) -> str:
    return f"{policy_name_}-kvtier-sidecar"


def selector_wire(selector: policy.LabelSelector) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if selector.match_labels:
        out["matchLabels"] = dict(selector.match_labels)
    if selector.match_expressions:
        out["matchExpressions"] = [
            {"key": t.key, "operator": t.operator, **({"values": list(t.values)} if t.values else {})}
            for t in selector.match_expressions
        ]
    return out


def _namespace(name: str) -> dict[str, Any]:
    return {"matchLabels": {"kubernetes.io/metadata.name": name}}


def other_port_ranges(closed: list[int]) -> list[tuple[int, int]]:
    """Inclusive TCP port ranges covering 1..65535 except `closed`."""
    ranges, start = [], 1
    for port in sorted(set(closed)):
        if port > start:
            ranges.append((start, port - 1))
        start = port + 1
    if start <= MAX_PORT:
        ranges.append((start, MAX_PORT))
    return ranges


def _port(first: int, last: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"protocol": "TCP", "port": first}
    if last is not None and last > first:
        out["endPort"] = last
    return out


def sidecar_network_policy(name: str, namespace: str, selector: policy.LabelSelector, http_port: int,
                           peer_port: int, access: SidecarAccess) -> dict[str, Any]:
    if not access.operator_labels:  # {} would select every pod of the operator's namespace
        raise ValueError("the operator's pod labels are needed to admit it (and only it) to the sidecars' HTTP port")
    own_pods = {"podSelector": {"matchLabels": {names.INJECTED_LABEL: names.injected_label_value(name)}}}
    operator = {"namespaceSelector": _namespace(access.operator_namespace),
                "podSelector": {"matchLabels": dict(access.operator_labels)}}
    http_from = [operator] + ([{"namespaceSelector": _namespace(access.monitoring_namespace)}]
                              if access.monitoring_namespace else [])
    ingress: list[dict[str, Any]] = [
        {"ports": [_port(peer_port)], "from": [own_pods]},
        {"ports": [_port(http_port)], "from": http_from},
    ]
    if access.other_ports_open:
        ingress.append({"ports": [_port(a, b) for a, b in other_port_ranges([http_port, peer_port])]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": policy_name(name), "namespace": namespace,
                     "labels": {names.POLICY_LABEL: name, names.COMPONENT_LABEL: "sidecar-network-policy"}},
        "spec": {"podSelector": selector_wire(selector), "policyTypes": ["Ingress"], "ingress": ingress},
    }
