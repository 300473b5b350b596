"""The injected sidecar needs no privilege: in a namespace that enforces the
`restricted` Pod Security Standard (the real apiserver's built-in PodSecurity
admission), a compliant serving pod selected by a policy is admitted with the sidecar
injected, and runs."""
from __future__ import annotations

import json


from kvtier_operator import names
from kvtier_testenv.kubectl import Kubectl
from sidecar_fleet import tiny_policy
from test_operator_e2e import short_workdir, status_of
from operator_harness import wait_for

RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}
RESTRICTED_POD = {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}}


def restricted_serving_pod(name: str, app: str) -> dict:
    engine = {"name": "engine", "image": "engine:1", "command": ["sleep", "infinity"],
              "securityContext": RESTRICTED_CONTAINER}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": app}},
            "spec": {"securityContext": RESTRICTED_POD, "containers": [engine]}}


def test_restricted_namespace_admits_a_selected_pod_with_the_sidecar_and_it_runs(
        operator, kubectl, control_plane, node_agent_factory):
    admin = Kubectl(control_plane.kubeconfig)
    admin.run("label", "namespace", kubectl.namespace, "pod-security.kubernetes.io/enforce=restricted",
              "pod-security.kubernetes.io/enforce-version=latest")
    # The namespace really enforces: a pod that is not restricted-compliant is refused.
    bare = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bare", "labels": {"app": "other"}},
            "spec": {"containers": [{"name": "c", "image": "engine:1"}]}}
    refused = kubectl.run("apply", "-f", "-", input=json.dumps(bare), check=False)
    assert refused.returncode != 0 and "violates PodSecurity \"restricted" in refused.stderr

    node_agent = node_agent_factory(workdir=short_workdir())
    kubectl.apply(tiny_policy("tiny", "llm"))
    wait_for("sidecar ConfigMap", lambda: kubectl.run(
        "get", "configmap", names.sidecar_config_map("tiny"), "-o", "json", check=False).returncode == 0)
    created = kubectl.run("apply", "-f", "-", input=json.dumps(restricted_serving_pod("llm-0", "llm")), check=False)
    assert created.returncode == 0, created.stderr
    pod = kubectl.get_json("pod", "llm-0")
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    assert set(containers) == {"engine", names.SIDECAR_CONTAINER}
    ctx = containers[names.SIDECAR_CONTAINER]["securityContext"]
    assert ctx["readOnlyRootFilesystem"] and ctx["capabilities"]["drop"] == ["ALL"]
    assert not any("hostPath" in v for v in pod["spec"]["volumes"])
    try:
        node_agent.wait_ready(1, selector="app=llm", timeout_s=60)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\nsidecar log:\n{node_agent.log(kubectl.namespace, 'llm-0')}") from None
    wait_for("membership of llm-0", lambda: status_of(kubectl, "tiny").get("memberCount") == 1)
