"""The operator pod and the kvtier Endpoint Picker's (endpointPicker.enabled) the chart
renders pass the real API server's PodSecurity admission at the `restricted` level (a
server-side dry run of each Deployment's pod template in a namespace that enforces it);
the same pod stripped of its securityContext does not, so the check is real."""
from __future__ import annotations

import copy
import json
import uuid

import pytest

from helm_chart import render
from kvtier_testenv.kubectl import Kubectl

pytestmark = pytest.mark.k8s


EPP = {"endpointPicker": {"enabled": True, "replicas": 2,
                          "pools": [{"name": "llama", "policy": "llama-70b", "selector": {"app": "vllm"}}]}}


def chart_pod(namespace: str, deployment: str = "kvtier-operator") -> dict:
    template = render(EPP, namespace=namespace)[("Deployment", deployment)]["spec"]["template"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{deployment}-check", "namespace": namespace,
                         "labels": template["metadata"]["labels"]},
            "spec": template["spec"]}


@pytest.mark.parametrize("deployment", ["kvtier-operator", "llama-epp"])
def test_chart_pod_is_admitted_under_the_restricted_standard(control_plane, deployment):
    admin = Kubectl(control_plane.kubeconfig)
    ns = f"restricted-{uuid.uuid4().hex[:6]}"
    admin.run("create", "namespace", ns)
    try:
        admin.run("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted",
                  "pod-security.kubernetes.io/enforce-version=latest")
        pod = chart_pod(ns, deployment)
        ok = admin.run("apply", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)
        assert ok.returncode == 0, ok.stderr
        bare = copy.deepcopy(pod)
        bare["spec"].pop("securityContext")
        for c in bare["spec"]["containers"]:
            c.pop("securityContext")
        refused = admin.run("apply", "--dry-run=server", "-f", "-", input=json.dumps(bare), check=False)
        assert refused.returncode != 0 and 'violates PodSecurity "restricted' in refused.stderr
    finally:
        admin.delete("namespace", ns, wait=False)
