"""charts/kvtier on a real node: `helm install` with the chart's default image (built
from the Dockerfile by hack/image.sh and imported into the node's containerd), the
operator running as the chart's Deployment pod, the API server calling the webhook
through its Service, and a StatefulSet pod in a namespace that enforces PodSecurity
`restricted` getting the sidecar injected as a native sidecar (an init container with
restartPolicy Always, started before the engine): the engine container (the project image,
acting as an engine through the sidecar's client) reaches the sidecar over the shared
socket volume and maps its arena in the shared memory emptyDir.

Last in the module: the network rule held (its counters are 0) and nothing of the
cluster's ranges left the machine."""
from __future__ import annotations

import ipaddress
import json
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from kvtier_testenv.kubectl import Helm, Kubectl, KubectlError
from kvtier_operator import names
from kvtier_testenv.nodes import POD_CIDR, NodeCluster
from kvtier_testenv.polling import WaitTimeout, wait_for

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvtier"
RELEASE = "kvtier"
OPERATOR_NS = "kvtier-system"
# A cold operator pod (Python imports, kopf start-up, the first reconcile) on a loaded
# 2-core machine: tens of seconds; beyond this, fail with the pod's story.
POD_READY_TIMEOUT_S = 240.0
ENGINE_OK = "ENGINE-OK"

# The engine container: the project's image running a stand-in engine that does what a
# serving engine's connector does at start: find the sidecar's socket from the pod
# identity the webhook's env gives it, say HELLO and map the arena the sidecar created
# in the shared memory volume.
ENGINE_SCRIPT = f"""
import os, sys, time
from kvtier.sidecar_config import SidecarConfig
from kvtier_sidecar.client import SidecarClient
cfg = SidecarConfig(pod_name=os.environ["POD_NAME"], pod_namespace=os.environ["POD_NAMESPACE"])
path = cfg.engine_socket_path()
deadline = time.monotonic() + 120
client = SidecarClient(path)
while not (os.path.exists(path) and client.connect()):
    if time.monotonic() > deadline:
        sys.exit(f"no sidecar at {{path}}")
    time.sleep(0.2)
name = client.info["shm_name"]
size = os.stat(f"/dev/shm/{{name}}").st_size
print("{ENGINE_OK}", path, name, size, client.info["arena_bytes"], flush=True)
while True:
    time.sleep(3600)
"""


def pod_story(kubectl: Kubectl, namespace: str) -> str:
    """The namespace's pods and events, and every container's last log lines (the
    previous run's too: a crash-looping container's cause)."""
    out = kubectl.run("-n", namespace, "get", "pods,events", "-o", "wide", check=False)
    story = out.stdout + out.stderr
    for previous in ("--previous", ""):
        logs = kubectl.run("-n", namespace, "logs", "--all-containers", "--prefix", "--tail=30",
                           "-l", "app.kubernetes.io/name", *( [previous] if previous else []), check=False)
        logs2 = kubectl.run("-n", namespace, "logs", "--all-containers", "--prefix", "--tail=30",
                            "-l", "app", *([previous] if previous else []), check=False)
        story += f"\n--- logs {previous or '(current)'} ---\n{logs.stdout}{logs.stderr}{logs2.stdout}{logs2.stderr}"
    return story


def wait_pods_ready(kubectl: Kubectl, namespace: str, selector: str, count: int,
                    cluster: NodeCluster) -> list[dict[str, Any]]:
    def ready() -> list[dict[str, Any]] | None:
        pods = kubectl.get_json("-n", namespace, "pods", "-l", selector)["items"]
        ok = [p for p in pods if p["status"].get("phase") == "Running" and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]
        return ok if len(ok) >= count else None
    try:
        return wait_for(f"{count} pod(s) {selector} Ready in {namespace}", ready, POD_READY_TIMEOUT_S, 0.5)
    except WaitTimeout as e:
        raise AssertionError(f"{e}\n{pod_story(kubectl, namespace)}\n{cluster.describe_logs(20)}") from None


def test_helm_install_runs_the_operator_pod_whose_webhook_injects_a_restricted_statefulset(node_cluster):
    started = time.monotonic()
    kubectl = Kubectl(node_cluster.kubeconfig)
    helm = Helm(node_cluster.kubeconfig, OPERATOR_NS)
    # The chart's default image, no override: the node has exactly that name:tag.
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    image = f"{values['image']['repository']}:{app_version}"
    assert any(ref == image or ref.endswith(f"/{image}") for ref in node_cluster.images()), \
        f"{image} is not in the node's containerd: {node_cluster.images()}"

    # The image stays the chart's default; the sidecar is a native one on this 1.33 API server.
    helm.install(RELEASE, CHART, "--create-namespace", values={"sidecar": {"native": "auto"}})
    # The operator pods are the ones the chart's Deployment selects.
    [deployment] = kubectl.get_json("-n", OPERATOR_NS, "deployments",
                                    "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
    selector = ",".join(f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items())
    [operator] = wait_pods_ready(kubectl, OPERATOR_NS, selector, 1, node_cluster)
    assert operator["spec"]["nodeName"] == node_cluster.node_name
    [op_container] = operator["spec"]["containers"]
    assert op_container["image"] == image
    op_status = operator["status"]["containerStatuses"][0]
    assert op_status["ready"] and op_status["imageID"], op_status
    # A real container: the kubelet gave it the pod network's address.
    assert ipaddress.ip_address(operator["status"]["podIP"]) in ipaddress.ip_network(POD_CIDR)

    ns = f"serving-{uuid.uuid4().hex[:6]}"
    kubectl.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest"}}})
    policy = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
    policy["metadata"]["namespace"] = ns
    policy["spec"]["selector"] = {"matchLabels": {"app": "engine"}}
    policy["spec"].setdefault("tiers", {})["dram"] = {"capacity": "64Mi"}
    kubectl.apply(policy)
    # The operator renders the policy's sidecar ConfigMap before pods can be injected.
    config_map = names.sidecar_config_map(policy["metadata"]["name"])
    wait_for("the policy's sidecar ConfigMap", lambda: kubectl.run(
        "-n", ns, "get", "configmap", config_map, check=False).returncode == 0, 120, 0.5)

    restricted = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                  "readOnlyRootFilesystem": True, "runAsNonRoot": True}
    kubectl.apply({
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": "engine", "namespace": ns},
        "spec": {
            "serviceName": "engine", "replicas": 1,
            "selector": {"matchLabels": {"app": "engine"}},
            "template": {
                "metadata": {"labels": {"app": "engine"}, "annotations": {
                    "kvtier.io/weights-version": policy["spec"]["model"]["weightsVersion"]}},
                "spec": {
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{
                        "name": "engine", "image": image, "imagePullPolicy": "IfNotPresent",
                        "command": ["python3", "-c", ENGINE_SCRIPT],
                        "securityContext": restricted,
                        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"},
                                      "limits": {"memory": "512Mi"}},
                    }],
                },
            },
        },
    })
    [pod] = wait_pods_ready(kubectl, ns, "app=engine", 1, node_cluster)
    init = {c["name"]: c for c in pod["spec"].get("initContainers", [])}
    assert names.SIDECAR_CONTAINER in init, \
        f"no native sidecar: {pod['spec']['containers']}; {pod['metadata'].get('annotations')}"
    assert init[names.SIDECAR_CONTAINER]["restartPolicy"] == "Always"
    assert [c["name"] for c in pod["spec"]["containers"]] == ["engine"]
    assert pod["metadata"]["annotations"].get("kvtier.io/injected-by") == policy["metadata"]["name"]
    statuses = {c["name"]: c for c in pod["status"].get("containerStatuses", []) +
                pod["status"].get("initContainerStatuses", [])}
    assert statuses[names.SIDECAR_CONTAINER]["ready"] and statuses["engine"]["ready"], statuses
    # kubelet started the sidecar before the engine (its startupProbe gates the engine)
    assert (statuses[names.SIDECAR_CONTAINER]["state"]["running"]["startedAt"]
            <= statuses["engine"]["state"]["running"]["startedAt"])
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["kvtier-shm"]["emptyDir"]["medium"] == "Memory"

    def engine_log() -> str | None:
        out = kubectl.run("-n", ns, "logs", pod["metadata"]["name"], "-c", "engine", check=False)
        return out.stdout if ENGINE_OK in out.stdout else None
    try:
        line = wait_for("the engine's HELLO through the socket volume", engine_log, 120, 0.5)
    except WaitTimeout as e:
        raise AssertionError(f"{e}\n{pod_story(kubectl, ns)}") from None
    sock, _shm_name, size, arena_bytes = line.split(ENGINE_OK, 1)[1].split()[:4]
    assert sock.startswith("/var/run/kvtier/")
    assert int(size) >= int(arena_bytes) > 0, "the engine sees the sidecar's whole arena in the shared emptyDir"
    # The admission the namespace enforces is the real one: a privileged pod is refused.
    try:
        kubectl.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "privileged", "namespace": ns},
                       "spec": {"containers": [{"name": "c", "image": image,
                                                "securityContext": {"privileged": True}}]}})
        raise AssertionError("a privileged pod was admitted into a restricted namespace")
    except KubectlError as e:
        assert "violates PodSecurity" in e.stderr, e.stderr
    print(json.dumps({"helm_install_to_injected_pod_ready_s": round(time.monotonic() - started, 1),
                      **{k: round(v, 1) for k, v in node_cluster.timings.items()}}))


def test_zz_the_network_rule_held(node_cluster):
    """Runs last in the module: no packet for the cluster's ranges tried to leave through
    any link but the cluster's bridge and loopback."""
    drops = node_cluster.guard_drops()
    assert len(drops) == 2, drops  # the destination and the source rule
    assert all(v == 0 for v in drops.values()), drops
