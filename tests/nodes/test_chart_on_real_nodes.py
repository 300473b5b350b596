"""charts/kvtier on real nodes (two: a kubelet and a containerd each): `helm install` with the chart's default image (built
from the Dockerfile by hack/image.sh and imported into the node's containerd), the
operator running as the chart's Deployment pod, the API server calling the webhook
through its Service, and a StatefulSet pod in a namespace that enforces PodSecurity
`restricted` getting the sidecar injected as a native sidecar (an init container with
restartPolicy Always, started before the engine): the engine container (the project image,
acting as an engine through the sidecar's client) reaches the sidecar over the shared
socket volume and maps its arena in the shared memory emptyDir. Two serving pods kept
apart by anti-affinity run on the two nodes, and one hits KV the other stored, fetched
over the peer path between the nodes. A scale-up's new pod, on the other node, is warmed
by the operator with its moved tenants' prefixes before the new affinity epoch. (The
weights-version rollouts on real nodes, gated on the chart's alarm in a Prometheus that
finds the real pods, with each new pod warmed through its engine before its readiness
gate opens and a bad version rolled back, are the cluster demo's: tests/helm/
test_demo_cluster.py runs it on its own two nodes.) vLLM's
OpenAI server (CPU build) runs as an engine container and loads KV from its sidecar.

Last in the module: the network rule held (its counters are 0) and nothing of the
cluster's ranges left the machine."""
from __future__ import annotations

import base64
import ipaddress
import json
import os
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvtier import control_api, control_tls
from kvtier.affinity import AffinityTable
from kvtier.policy import KVCachePolicySpec, kv_block_bytes
from kvtier_operator import names
from kvtier_testenv.control_client import ControlEndpoint
from kvtier_testenv.kubectl import Helm, Kubectl, KubectlError
from kvtier_testenv.nodes import (
    ENGINE_REPOSITORY, NODE_IP, POD_CIDR, NodeCluster, node_pod_cidr,
    RESTRICTED, RESTRICTED_POD, redis_service, wait_webhook_injects,
)
from kvtier_testenv.polling import WaitTimeout, wait_for
from kvtier_testenv.prometheus import Prometheus, grant_discovery, sidecar_scrape_config
from kvtier_testenv.redis_fixtures import RedisServer

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvtier"
RELEASE = "kvtier"
OPERATOR_NS = "kvtier-system"
# A cold operator pod (Python imports, kopf start-up, the first reconcile) on a loaded
# 2-core machine: tens of seconds; beyond this, fail with the pod's story.
POD_READY_TIMEOUT_S = 240.0
ENGINE_OK = "ENGINE-OK"
ENGINE_STATS = "ENGINE-STATS"
# The serving namespaces (one per test) and their pods' ServiceAccount.
SERVING_NAMESPACES = ("serving-inject", "serving-faults", "serving-peers", "serving-engine", "serving-noimage",
                      "serving-scale", "serving-vllm")
SERVING_SA = "engine"

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


# The serving engine of the fault and peer tests: requests over a fixed set of prompts, as
# a serving engine with a kvtier connector makes them - look up, copy a hit out of the
# arena, check it, release; on a miss "prefill" and offer the KV (unless the pod is the one
# KVTIER_TEST_READER names, which only looks up: its hits were fetched from a peer). Its
# prefill is deterministic (block i's bytes a pure function of the chained hash of blocks
# 0..i, like real KV of a prefix), so every hit is checked byte for byte against a
# recompute. A fault must cost misses (recompute), never a wrong hit or a failed request.
# After every round it prints its running totals (hits by the tier that served them).
CHECKED_ENGINE_SCRIPT = f"""
import json, os, sys, time
import numpy as np
from kvtier.identity import ModelIdentity
from kvtier.keys import block_hashes
from kvtier.sidecar_config import SidecarConfig
from kvtier_sidecar.client import SidecarClient, SidecarUnavailable

cfg = SidecarConfig(pod_name=os.environ["POD_NAME"], pod_namespace=os.environ["POD_NAMESPACE"])
stores = os.environ.get("KVTIER_TEST_READER") != os.environ["POD_NAME"]
model_id = json.loads(os.environ["KVTIER_KV_TRANSFER_CONFIG"])["kv_connector_extra_config"]["model_id"]
root = ModelIdentity(model_id=model_id, weights_version=os.environ["KVTIER_WEIGHTS_VERSION"]).root("tenant-a")
client = SidecarClient(cfg.engine_socket_path())
prompts = [np.arange(i * 10_000, i * 10_000 + 5 * cfg.block_size + 7, dtype=np.int64) for i in range(8)]
t = dict(rounds=0, requests=0, hits=0, hit_blocks=0, misses=0, stale=0, stores=0, wrong=0, errors=0, tiers={{}})

def prefill(tokens, block_bytes):
    return np.concatenate([np.random.Generator(np.random.PCG64(int.from_bytes(h, "little"))).integers(
        0, 256, size=block_bytes, dtype=np.uint8) for h in block_hashes(root, tokens, cfg.block_size)])

while True:
    for tokens in prompts:
        t["requests"] += 1
        try:
            got = client.lookup(root, tokens)
            if got:
                try:
                    bb = client.info["block_bytes"]
                    dst = np.zeros(len(got.blocks) * bb, np.uint8)
                    client.materialize(got, dst)
                    if np.array_equal(dst, prefill(tokens, bb)[: dst.size]):
                        t["hits"] += 1
                        t["hit_blocks"] += len(got.blocks)
                        t["tiers"][got.tier] = t["tiers"].get(got.tier, 0) + 1
                    else:
                        t["wrong"] += 1
                except SidecarUnavailable:
                    t["stale"] += 1  # the sidecar went away mid-hit: recompute
                finally:
                    client.release(got)
            else:
                t["misses"] += 1
                if stores and client.connect():
                    t["stores"] += bool(client.store(root, tokens, prefill(tokens, client.info["block_bytes"])))
        except Exception as e:
            t["errors"] += 1
            print("ERROR", repr(e), flush=True)
    t["rounds"] += 1
    print("{ENGINE_STATS}", json.dumps(t), flush=True)
    time.sleep(0.2)
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


def wait_pods_ready(kubectl: Kubectl, namespace: str, selector: str, count: int, cluster: NodeCluster,
                    timeout_s: float = POD_READY_TIMEOUT_S, crash_loop: str | None = None) -> list[dict[str, Any]]:
    """`count` pods of `selector` Running and Ready. With `crash_loop` (a container
    name), that container restarting twice fails at once, not at the deadline."""
    def ready() -> list[dict[str, Any]] | None:
        pods = kubectl.get_json("-n", namespace, "pods", "-l", selector)["items"]
        for p in pods if crash_loop else ():
            restarts = [c["restartCount"] for c in p["status"].get("containerStatuses", []) if c["name"] == crash_loop]
            assert not restarts or restarts[0] < 2, f"{crash_loop} crash-loops\n{pod_story(kubectl, namespace)}"
        ok = [p for p in pods if p["status"].get("phase") == "Running" and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]
        return ok if len(ok) >= count else None
    try:
        return wait_for(f"{count} pod(s) {selector} Ready in {namespace}", ready, timeout_s, 0.5)
    except WaitTimeout as e:
        raise AssertionError(f"{e}\n{pod_story(kubectl, namespace)}\n{cluster.describe_logs(20)}") from None


@pytest.fixture(scope="module")
def chart(node_cluster) -> dict[str, Any]:
    """The chart installed with its default image; the operator pod Ready on the node."""
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
    # The serving pods run as a ServiceAccount of their own, which the chart lets create
    # TokenReviews (their sidecars check the operator's control-API tokens with it).
    # Nothing is ever pulled (no registry is reachable, and a pull would leave the
    # machine): every image is on the node or the pod says so.
    helm.install(RELEASE, CHART, "--create-namespace", values={
        "image": {"pullPolicy": "Never"},
        "sidecar": {"native": "auto", "image": {"pullPolicy": "Never"}},
        "controlAuth": {"servingServiceAccounts": [{"namespace": ns, "name": SERVING_SA}
                                                   for ns in SERVING_NAMESPACES]}})
    # The operator pods are the ones the chart's Deployment selects.
    [deployment] = kubectl.get_json("-n", OPERATOR_NS, "deployments",
                                    "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
    selector = ",".join(f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items())
    [operator] = wait_pods_ready(kubectl, OPERATOR_NS, selector, 1, node_cluster)
    return {"kubectl": kubectl, "image": image, "operator": operator, "started": started}


def restricted_namespace(kubectl: Kubectl, ns: str) -> None:
    """Namespace `ns` enforcing PodSecurity `restricted`, with its serving ServiceAccount."""
    kubectl.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest"}}})
    kubectl.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": SERVING_SA, "namespace": ns}})


def apply_policy(kubectl: Kubectl, ns: str, app: str, dram: str = "64Mi", name: str | None = None,
                 **spec: Any) -> dict[str, Any]:
    """The minimal example policy in `ns` selecting `app=<app>` (DRAM tier `dram`, `spec`
    fields added), once the operator has rendered its sidecar ConfigMap."""
    policy = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
    policy["metadata"]["namespace"] = ns
    if name:
        policy["metadata"]["name"] = name
    policy["spec"]["selector"] = {"matchLabels": {"app": app}}
    policy["spec"].setdefault("tiers", {})["dram"] = {"capacity": dram}
    policy["spec"].update(spec)
    kubectl.apply(policy)
    # The operator renders the policy's sidecar ConfigMap before pods can be injected.
    config_map = names.sidecar_config_map(policy["metadata"]["name"])
    wait_for("the policy's sidecar ConfigMap", lambda: kubectl.run(
        "-n", ns, "get", "configmap", config_map, check=False).returncode == 0, 120, 0.5)
    return policy


def restricted_namespace_with_policy(kubectl: Kubectl, ns: str, app: str, **policy: Any) -> dict[str, Any]:
    restricted_namespace(kubectl, ns)
    return apply_policy(kubectl, ns, app, **policy)


def engine_statefulset(ns: str, app: str, image: str, script: str, policy: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": app, "namespace": ns},
        "spec": {
            "serviceName": app, "replicas": 1,
            "selector": {"matchLabels": {"app": app}},
            "template": {
                "metadata": {"labels": {"app": app}, "annotations": {
                    "kvtier.io/weights-version": policy["spec"]["model"]["weightsVersion"]}},
                "spec": {
                    "securityContext": RESTRICTED_POD,
                    "terminationGracePeriodSeconds": 5,
                    "serviceAccountName": SERVING_SA,
                    "containers": [{
                        "name": "engine", "image": image, "imagePullPolicy": "Never",
                        "command": ["python3", "-c", script],
                        "securityContext": RESTRICTED,
                        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"},
                                      "limits": {"memory": "512Mi"}},
                    }],
                },
            },
        },
    }


def policy_status(kubectl: Kubectl, ns: str, name: str) -> dict[str, Any]:
    """The KVCachePolicy's status as the operator last wrote it ({} before it has)."""
    return kubectl.get_json("-n", ns, "kvcp", name).get("status") or {}


def one_pod_per_node(sts: dict[str, Any]) -> dict[str, Any]:
    """Required anti-affinity on the hostname: the StatefulSet's pods land on different nodes."""
    sts["spec"]["template"]["spec"]["affinity"] = {"podAntiAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": sts["spec"]["selector"]["matchLabels"]},
            "topologyKey": "kubernetes.io/hostname"}]}}
    return sts


def test_helm_install_runs_the_operator_pod_whose_webhook_injects_a_restricted_statefulset(node_cluster, chart):
    kubectl, image, operator, started = chart["kubectl"], chart["image"], chart["operator"], chart["started"]
    assert operator["spec"]["nodeName"] in node_cluster.node_names
    [op_container] = operator["spec"]["containers"]
    assert op_container["image"] == image
    op_status = operator["status"]["containerStatuses"][0]
    assert op_status["ready"] and op_status["imageID"], op_status
    # A real container: the kubelet gave it the pod network's address.
    assert ipaddress.ip_address(operator["status"]["podIP"]) in ipaddress.ip_network(POD_CIDR)

    ns = SERVING_NAMESPACES[0]
    policy = restricted_namespace_with_policy(kubectl, ns, "engine")
    sts = engine_statefulset(ns, "engine", image, ENGINE_SCRIPT, policy)
    # The module's first pods: created once the webhook's Service leads to it (the chart's
    # failurePolicy Ignore would admit them uninjected).
    wait_webhook_injects(kubectl, ns, sts)
    kubectl.apply(sts)
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


def engine_stats(kubectl: Kubectl, ns: str, pod: str, previous: bool = False) -> dict[str, int] | None:
    """The checked engine's last printed totals (of its previous run with `previous`)."""
    out = kubectl.run("-n", ns, "logs", pod, "-c", "engine", "--tail=50", *(["--previous"] if previous else []),
                      check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith(ENGINE_STATS)]
    return json.loads(lines[-1].split(" ", 1)[1]) if lines else None


def container_status(kubectl: Kubectl, ns: str, pod: str, name: str) -> dict[str, Any]:
    status = kubectl.get_json("-n", ns, "pod", pod)["status"]
    [c] = [c for c in status.get("containerStatuses", []) + status.get("initContainerStatuses", [])
           if c["name"] == name]
    return c


def test_faults_on_the_real_node_degrade_to_recompute_never_wrong_kv(node_cluster, chart):
    """Real faults under a running engine, every hit checked against a recompute: the
    sidecar container SIGKILLed (kubelet restarts the native sidecar; the engine's
    lookups miss meanwhile, its requests never fail), the engine container SIGKILLed
    (the sidecar keeps the KV: the restarted engine hits at once), kubelet restarted
    (the pod runs on), the pod deleted (its StatefulSet makes a new one that refills).
    Wrong KV and failed requests stay 0 throughout."""
    kubectl, image = chart["kubectl"], chart["image"]
    ns = SERVING_NAMESPACES[1]
    policy = restricted_namespace_with_policy(kubectl, ns, "faulty")
    kubectl.apply(engine_statefulset(ns, "faulty", image, CHECKED_ENGINE_SCRIPT, policy))
    [pod] = wait_pods_ready(kubectl, ns, "app=faulty", 1, node_cluster)
    name = pod["metadata"]["name"]

    def story() -> str:
        return pod_story(kubectl, ns)

    def stats_when(what: str, cond, previous: bool = False) -> dict[str, int]:
        def check() -> dict[str, int] | None:
            st = engine_stats(kubectl, ns, name, previous)
            return st if st is not None and cond(st) else None
        try:
            return wait_for(what, check, 120, 0.5)
        except WaitTimeout as e:
            raise AssertionError(f"{e}; last stats {engine_stats(kubectl, ns, name, previous)}\n{story()}\n"
                                 f"{node_cluster.describe_logs(30)}") from None

    def until(what: str, cond, timeout_s: float = 120) -> Any:
        try:
            return wait_for(what, cond, timeout_s, 0.5)
        except WaitTimeout as e:
            raise AssertionError(f"{e}\n{story()}\n{node_cluster.describe_logs(30)}") from None

    def clean(st: dict[str, int]) -> None:
        assert st["wrong"] == 0 and st["errors"] == 0, f"{st}\n{story()}"

    warm = stats_when("the engine's hits from its own stores", lambda st: st["hits"] >= 8)
    clean(warm)

    # 1. The sidecar container dies (SIGKILL: no clean-up of its own).
    before = engine_stats(kubectl, ns, name)
    sidecar = container_status(kubectl, ns, name, names.SIDECAR_CONTAINER)
    node_cluster.kill_container(sidecar["containerID"])
    until("the native sidecar restarted by kubelet", lambda: (
        (c := container_status(kubectl, ns, name, names.SIDECAR_CONTAINER))["restartCount"] >= 1
        and c.get("ready")))
    # Its KV went with it: the engine misses, recomputes, stores again and hits again.
    after_sidecar = stats_when("hits again after the sidecar's restart", lambda st: (
        st["misses"] > before["misses"] and st["hits"] >= before["hits"] + 8))
    clean(after_sidecar)
    assert container_status(kubectl, ns, name, "engine")["restartCount"] == 0, "the engine must not fail with its sidecar"

    # 2. The engine container dies: the sidecar keeps its KV, the new engine hits at once.
    engine = container_status(kubectl, ns, name, "engine")
    node_cluster.kill_container(engine["containerID"])
    until("the engine restarted by kubelet", lambda: (
        container_status(kubectl, ns, name, "engine")["restartCount"] >= 1))
    clean(stats_when("the killed engine's last totals", lambda st: True, previous=True))
    fresh = stats_when("the restarted engine's first round", lambda st: st["rounds"] >= 1)
    clean(fresh)
    assert fresh["hits"] > 0 and fresh["misses"] == 0 and fresh["stores"] == 0, \
        f"the sidecar's KV should outlive the engine's crash: {fresh}"

    # 3. kubelet restarts: the pod and its containers run on.
    rounds = engine_stats(kubectl, ns, name)["rounds"]
    node_cluster.restart_kubelet(kubectl.get_json("-n", ns, "pod", name)["spec"]["nodeName"])
    clean(stats_when("rounds after kubelet's restart", lambda st: st["rounds"] >= rounds + 5))
    assert container_status(kubectl, ns, name, "engine")["restartCount"] == 1
    assert container_status(kubectl, ns, name, names.SIDECAR_CONTAINER)["restartCount"] == 1

    # 4. The pod is deleted: its StatefulSet makes a new one, which refills from recompute.
    uid = pod["metadata"]["uid"]
    kubectl.run("-n", ns, "delete", "pod", name, "--wait=false")
    until("the StatefulSet's new pod", lambda: (
        (p := kubectl.get_json("-n", ns, "pods", "-l", "app=faulty")["items"])
        and p[0]["metadata"]["uid"] != uid and p[0]["status"].get("phase") == "Running"), 180)
    refilled = stats_when("the new pod's hits", lambda st: st["hits"] >= 8)
    clean(refilled)
    assert refilled["misses"] >= 1 and refilled["stores"] >= 1, refilled


def control_ca_cert(kubectl: Kubectl, path: Path) -> Path:
    """The control CA the chart's operator made (the Secret its Deployment names), as a
    file a scrape job trusts."""
    [deployment] = kubectl.get_json("-n", OPERATOR_NS, "deployments",
                                    "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
    args = [a for c in deployment["spec"]["template"]["spec"]["containers"] for a in c.get("args", [])]
    [secret] = [a.split("=", 1)[1] for a in args if a.startswith("--control-ca-secret=")]
    path.write_bytes(base64.b64decode(kubectl.get_json("-n", OPERATOR_NS, "secret", secret)["data"]["ca.crt"]))
    return path


def test_two_nodes_a_reader_hits_kv_its_peer_on_the_other_node_stored(node_cluster, chart, tmp_path):
    """Two serving pods of one StatefulSet, kept apart by required anti-affinity, land on
    the cluster's two nodes (kubelets of their own, containerds of their own, addresses
    from each node's range). The policy's Redis (a redis-server on the host, on node 0's
    bridge address) is the global index, named as users name it: a Service (its
    EndpointSlice the host's address) whose name the sidecars resolve through the cluster
    DNS and reach through kube-proxy's rules. the writer's sidecar registers what its engine
    stored, and the reader's sidecar, on the other node, fetches those blocks from the
    writer's peer port - encrypted, authenticated with the policy's peer secret, each
    block's checksum verified - so the reader's engine hits KV it never prefilled.
    Every hit equals a recompute; nothing fails. A Prometheus on the host finds both
    sidecars through the API server (pod discovery, the chart's relabelling), scrapes
    them over TLS on their nodes' addresses, and sees the reader's peer hits."""
    kubectl, image = chart["kubectl"], chart["image"]
    ns = SERVING_NAMESPACES[2]
    redis = RedisServer(host=NODE_IP).start()
    try:
        restricted_namespace(kubectl, ns)
        policy = apply_policy(kubectl, ns, "peers", redis={"url": redis_service(kubectl, ns, redis.port)})
        sts = engine_statefulset(ns, "peers", image, CHECKED_ENGINE_SCRIPT, policy)
        [engine] = sts["spec"]["template"]["spec"]["containers"]
        engine["env"] = [{"name": "KVTIER_TEST_READER", "value": "peers-1"}]
        sts["spec"]["replicas"] = 2
        sts["spec"]["podManagementPolicy"] = "Parallel"
        one_pod_per_node(sts)
        kubectl.apply(sts)
        pods = {p["metadata"]["name"]: p for p in wait_pods_ready(kubectl, ns, "app=peers", 2, node_cluster)}
        writer, reader = pods["peers-0"], pods["peers-1"]
        # One pod per node, each addressed from its own node's range.
        assert {writer["spec"]["nodeName"], reader["spec"]["nodeName"]} == set(node_cluster.node_names), \
            [(p["metadata"]["name"], p["spec"]["nodeName"]) for p in pods.values()]
        for p in pods.values():
            index = node_cluster.node_names.index(p["spec"]["nodeName"])
            assert ipaddress.ip_address(p["status"]["podIP"]) in ipaddress.ip_network(node_pod_cidr(index)), p["status"]

        def stats(pod: str) -> dict[str, Any] | None:
            return engine_stats(kubectl, ns, pod)

        def fetched() -> dict[str, Any] | None:
            st = stats("peers-1")
            return st if st and st["tiers"].get("peer", 0) >= 1 else None
        try:
            got = wait_for("the reader's hits fetched from the writer on the other node", fetched, 180, 1.0)
        except WaitTimeout as e:
            raise AssertionError(f"{e}; reader {stats('peers-1')}, writer {stats('peers-0')}\n"
                                 f"{pod_story(kubectl, ns)}\n{node_cluster.describe_logs(20)}") from None
        wrote = stats("peers-0")
        for st in (got, wrote):
            assert st["wrong"] == 0 and st["errors"] == 0, (got, wrote)
        assert got["stores"] == 0 and wrote["stores"] >= 1, (got, wrote)
        print(json.dumps({"reader": got, "writer": wrote}))

        # Prometheus discovers and scrapes the real pods, one per node.
        discovery = grant_discovery(node_cluster.control_plane, kubectl)
        prom = Prometheus(tmp_path / "prometheus").configure(
            [sidecar_scrape_config(discovery, [ns], control_ca_cert(kubectl, tmp_path / "control-ca.crt"))])
        prom.start()
        try:
            def both_up() -> dict[str, dict[str, str]] | None:
                up = prom.up_targets("kvtier-sidecars")
                return up if {labels["pod"] for labels in up.values()} == {"peers-0", "peers-1"} else None
            try:
                up = wait_for("Prometheus scraping both sidecars", both_up, 120, 1.0)
            except WaitTimeout as e:
                raise AssertionError(f"{e}; targets {prom.targets()}\n{prom.log_tail()}") from None
            hosts = {labels["pod"]: urllib.parse.urlsplit(url).hostname for url, labels in up.items()}
            assert hosts == {name: p["status"]["podIP"] for name, p in pods.items()}, (hosts, up)

            def peer_hits() -> list[dict[str, Any]]:
                return prom.query('sum by (pod) (kvtier_hits_total{tier="peer"}) > 0')
            try:
                series = wait_for("the reader's peer hits in Prometheus", peer_hits, 60, 1.0)
            except WaitTimeout as e:
                raise AssertionError(f"{e}; {prom.query('kvtier_hits_total')}") from None
            assert [s["metric"]["pod"] for s in series] == ["peers-1"], series
            assert float(series[0]["value"][1]) >= got["tiers"]["peer"], (series, got)
        finally:
            prom.stop()
    finally:
        redis.stop()


def post_json(url: str, body: Any) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


FRONT_PORT = 8000


def front_statefulset(node_cluster: NodeCluster, ns: str, app: str, policy: dict[str, Any]) -> dict[str, Any]:
    """A StatefulSet of the reference engine's image (its OpenAI-compatible front as the
    entrypoint), Ready once the front answers /health."""
    [engine_image] = [ref for ref in node_cluster.images() if ref.startswith(ENGINE_REPOSITORY + ":")]
    spec = KVCachePolicySpec.model_validate(policy["spec"])
    sts = engine_statefulset(ns, app, engine_image, "", policy)
    [container] = sts["spec"]["template"]["spec"]["containers"]
    del container["command"]  # the image's entrypoint: the engine front
    container.update({
        "args": ["--port", str(FRONT_PORT), "--block-bytes", str(kv_block_bytes(spec))],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "http", "containerPort": FRONT_PORT}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": FRONT_PORT}, "periodSeconds": 1}})
    return sts


def completions_url(pod: dict[str, Any]) -> str:
    return f"http://{pod['status']['podIP']}:{FRONT_PORT}/v1/completions"


def test_the_reference_engine_image_serves_completions_from_its_pods_sidecar(node_cluster, chart):
    """The Dockerfile's test-only `reference-engine` target, a container image of the
    reference engine's OpenAI-compatible front, runs as a restricted pod's engine next to
    its injected sidecar. Completions sent from the host to the pod's address: the first
    sightings prefill and store, then the same prompt is served from the sidecar (its
    whole blocks as cached tokens), every hit checked by the engine against a recompute
    (a mismatch would be a 500); a malformed request is a 400 and the engine serves on."""
    kubectl = chart["kubectl"]
    ns = SERVING_NAMESPACES[3]
    policy = restricted_namespace_with_policy(kubectl, ns, "front")
    spec = KVCachePolicySpec.model_validate(policy["spec"])
    kubectl.apply(front_statefulset(node_cluster, ns, "front", policy))
    [pod] = wait_pods_ready(kubectl, ns, "app=front", 1, node_cluster)
    url = completions_url(pod)
    prompt = list(range(1_000, 1_000 + 6 * spec.block_size + 5))
    body = {"model": spec.model.id, "prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"}

    answers: list[dict[str, Any]] = []

    def served_from_cache() -> dict[str, Any] | None:
        status, answer = post_json(url, body)
        assert status == 200, (status, answer)
        answers.append(answer)
        return answer if answer["usage"]["cached_tokens"] > 0 else None
    try:
        hit = wait_for("a completion served from the sidecar", served_from_cache, 60, 0.5)
    except WaitTimeout as e:
        raise AssertionError(f"{e}; answers {[a['usage'] for a in answers]}\n{pod_story(kubectl, ns)}") from None
    assert answers[0]["usage"]["cached_tokens"] == 0, answers[0]
    assert hit["usage"]["cached_tokens"] == len(prompt) // spec.block_size * spec.block_size, hit["usage"]
    status, answer = post_json(url, {"model": spec.model.id, "prompt": "not token ids"})
    assert status == 400 and "prompt" in answer["error"]["message"], (status, answer)
    status, answer = post_json(url, body)
    assert status == 200 and answer["usage"]["cached_tokens"] == hit["usage"]["cached_tokens"], (status, answer)


def test_a_scale_up_warms_the_moved_tenants_on_the_new_pod_before_the_epoch(node_cluster, chart, tmp_path):
    """The scale-up the demo shows, on real nodes: a StatefulSet of reference-engine pods
    serves six tenants (each its own cache_salt) from one pod; `kubectl scale` adds a
    second, which required anti-affinity puts on the other node. The operator (the
    chart's pod) sees it Ready, plans the new epoch (every tenant gains the new pod as a
    home), has the new pod's sidecar pull each tenant's hottest prefixes from the old
    pod's over the encrypted peer path between the nodes, and only then publishes the
    epoch (ConfigMap, Redis) with an EpochChanged event. The new pod never served a
    request before the epoch, yet the first completion of every tenant there is served
    from its sidecar: whole blocks cached, each hit checked by the engine against a
    recompute (a mismatch would be a 500)."""
    kubectl = chart["kubectl"]
    ns = SERVING_NAMESPACES[5]
    redis = RedisServer(host=NODE_IP).start()
    try:
        restricted_namespace(kubectl, ns)
        policy = apply_policy(kubectl, ns, "scale", redis={"url": redis_service(kubectl, ns, redis.port)})
        name = policy["metadata"]["name"]
        spec = KVCachePolicySpec.model_validate(policy["spec"])
        sts = front_statefulset(node_cluster, ns, "scale", policy)
        one_pod_per_node(sts)
        kubectl.apply(sts)
        [first] = wait_pods_ready(kubectl, ns, "app=scale", 1, node_cluster)
        tenants = [f"tenant-{i}" for i in range(6)]
        prompts = {t: list(range(10_000 * i, 10_000 * i + 4 * spec.block_size + 3)) for i, t in enumerate(tenants)}
        cached = 4 * spec.block_size

        def complete(pod: dict[str, Any], tenant: str) -> dict[str, Any]:
            status, answer = post_json(completions_url(pod), {"model": spec.model.id, "prompt": prompts[tenant],
                                                              "max_tokens": 1, "cache_salt": tenant})
            assert status == 200, (pod["metadata"]["name"], tenant, status, answer)
            return answer["usage"]

        def status() -> dict[str, Any]:
            return policy_status(kubectl, ns, name)

        def until(what: str, cond, timeout_s: float = 180) -> Any:
            try:
                return wait_for(what, cond, timeout_s, 0.5)
            except WaitTimeout as e:
                raise AssertionError(f"{e}; status {status()}\n{pod_story(kubectl, ns)}\n"
                                     f"{node_cluster.describe_logs(20)}") from None

        # Each tenant's prompt is prefilled and stored on the first pod, then hit there.
        for t in tenants:
            complete(first, t)
        until("every tenant's prompt hit on the first pod", lambda: all(
            complete(first, t)["cached_tokens"] == cached for t in tenants))
        # The operator learns the tenants from the sidecar's stats and publishes one member.
        one = until("an epoch of one member that knows the six tenants", lambda: (
            st := status()).get("memberCount") == 1 and st.get("knownTenants", 0) >= len(tenants) and st)

        kubectl.run("-n", ns, "scale", "statefulset/scale", "--replicas=2")
        pods = {p["metadata"]["name"]: p for p in wait_pods_ready(kubectl, ns, "app=scale", 2, node_cluster)}
        new = pods["scale-1"]
        assert new["spec"]["nodeName"] != pods["scale-0"]["spec"]["nodeName"], "anti-affinity: one pod per node"
        two = until("the operator's epoch with the new member", lambda: (
            st := status()).get("memberCount") == 2 and st.get("epoch", 0) > one["epoch"] and st)
        assert two["movedTenants"] >= len(tenants), two
        table = AffinityTable.from_json(
            kubectl.get_json("-n", ns, "configmap", names.affinity_config_map(name))["data"][names.AFFINITY_KEY])
        assert table.epoch == two["epoch"] and set(table.members) == {"scale-0", "scale-1"}, table
        assert all("scale-1" in table.homes_for(t) for t in tenants), {t: table.homes_for(t) for t in tenants}
        events = [e for e in kubectl.get_json("-n", ns, "events")["items"] if e["reason"] == "EpochChanged"]
        assert any(f"epoch {two['epoch']}:" in e["message"] and "joined scale-1" in e["message"] for e in events), \
            [e["message"] for e in events]

        # The warm-up's bytes are on the new pod's sidecar before any request reached it
        # (its /metrics, over TLS verified with the operator's control CA).
        metrics = sidecar_metrics(kubectl, new, control_ca_cert(kubectl, tmp_path / "control-ca.crt"))
        warmed = metrics("kvtier_warmed_bytes_total")
        assert warmed >= len(tenants) * cached // spec.block_size * kv_block_bytes(spec), warmed
        assert metrics("kvtier_lookups_total") == 0, "the new pod served nothing before the epoch"

        # The new pod's first request of every tenant: served from what the warm-up put
        # there, out of its own DRAM (not fetched from the peer at lookup time).
        first_hits = {t: complete(new, t)["cached_tokens"] for t in tenants}
        assert first_hits == {t: cached for t in tenants}, first_hits
        assert metrics("kvtier_hits_total", tier="dram") == len(tenants), metrics("kvtier_hits_total")
        assert metrics("kvtier_hits_total", tier="peer") == 0
        print(json.dumps({"epochs": [one["epoch"], two["epoch"]], "moved": two["movedTenants"],
                          "warmed_bytes": warmed, "first_request_cached_tokens_on_the_new_pod": first_hits}))
    finally:
        redis.stop()


def test_a_vllm_pod_on_a_real_node_loads_kv_from_its_injected_sidecar(node_cluster, chart, tmp_path):
    """vLLM's OpenAI server (the CPU build) as the engine container of a StatefulSet pod
    on a real node, next to the sidecar the webhook injected (`kvtier_testenv.vllm_pod`:
    the engine's command line names kvtier only as `--kv-transfer-config
    $(KVTIER_KV_TRANSFER_CONFIG)`; its ~6 GB of Python is the cached venv mounted from the
    host, so this pod's namespace is at `privileged`, a test-only arrangement). vLLM's own
    prefix cache is off: the second completion of a prompt loads its whole blocks from the
    sidecar (vLLM reports them as cached prompt tokens, the sidecar as DRAM hits), and its
    tokens equal the first answer's and a recompute under another salt."""
    from kvtier_testenv import vllm_pod
    from kvtier_testenv.tiny_llama import TinyLlama, write_model

    kubectl = chart["kubectl"]
    ns = SERVING_NAMESPACES[6]
    shape = TinyLlama()
    model = write_model(tmp_path / "model", seed=7)
    engine, volumes = vllm_pod.engine_pod_spec(chart["image"], model, FRONT_PORT)
    kubectl.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": {
        "pod-security.kubernetes.io/enforce": vllm_pod.POD_SECURITY}}})
    kubectl.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": SERVING_SA, "namespace": ns}})
    weights = "sha256:" + "d7" * 32
    apply_policy(kubectl, ns, "vllm", blockSize=32, admission={"minSightings": 1},
                          model={"id": "tiny-llama", "weightsVersion": weights, "kvDtype": "fp32",
                                 "ropeConfigHash": "rope-tiny", "attnImpl": "cpu-attn",
                                 "shape": {"layers": shape.layers, "kvHeads": shape.kv_heads,
                                           "headDim": shape.head_dim, "params": 1e7}})
    kubectl.apply({
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "vllm", "namespace": ns},
        "spec": {"serviceName": "vllm", "replicas": 1, "selector": {"matchLabels": {"app": "vllm"}},
                 "template": {
                     "metadata": {"labels": {"app": "vllm"},
                                  "annotations": {"kvtier.io/weights-version": weights}},
                     "spec": {"serviceAccountName": SERVING_SA, "terminationGracePeriodSeconds": 5,
                              # the host's memory: node 1 keeps a small allocatable
                              "nodeSelector": {"kubernetes.io/hostname": node_cluster.node_names[0]},
                              "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                              "containers": [engine], "volumes": volumes}}}})
    # a crash loop fails now, not at the start-up deadline
    [pod] = wait_pods_ready(kubectl, ns, "app=vllm", 1, node_cluster, vllm_pod.READY_TIMEOUT_S,
                             crash_loop="engine")
    containers = pod["spec"].get("initContainers", []) + pod["spec"]["containers"]
    assert names.SIDECAR_CONTAINER in [c["name"] for c in containers], [c["name"] for c in containers]
    url = completions_url(pod)
    prompt = [(13 * i + 5) % shape.vocab for i in range(3 * 32 + 9)]

    def complete(salt: str) -> tuple[list[int], int]:
        status, answer = post_json(url, {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
                                         "cache_salt": salt, "return_token_ids": True})
        assert status == 200, (status, answer)
        details = answer["usage"].get("prompt_tokens_details") or {}
        return answer["choices"][0]["token_ids"], int(details.get("cached_tokens") or 0)

    first, cached_first = complete("tenant-a")
    assert cached_first == 0, cached_first
    metrics = sidecar_metrics(kubectl, pod, control_ca_cert(kubectl, tmp_path / "control-ca.crt"))
    # vLLM saves a request's blocks to the sidecar once it finishes: poll for the store.
    try:
        wait_for("the first request's blocks stored in the sidecar", lambda: metrics(
            "kvtier_stores_total", outcome="accepted") >= 1, 60, 0.5)
    except WaitTimeout as e:
        raise AssertionError(f"{e}; {pod_story(kubectl, ns)}") from None
    second, cached_second = complete("tenant-a")
    recomputed, cached_other = complete("another-tenant")
    assert cached_second == len(prompt) // 32 * 32, cached_second
    assert cached_other == 0, "another salt is another key: a miss"
    assert second == first == recomputed, (first, second, recomputed)
    assert metrics("kvtier_hits_total", tier="dram") >= 1, metrics("kvtier_hits_total")
    print(json.dumps({"cached_tokens": [cached_first, cached_second, cached_other], "tokens": first}))


def sidecar_metrics(kubectl: Kubectl, pod: dict[str, Any], ca: Path):
    """metric(name, **labels) -> the sum of `name`'s samples with those labels, read from
    the pod's sidecar's /metrics as a scrape job reads it (TLS, the control CA, the
    scrape server name; no token)."""
    containers = pod["spec"].get("initContainers", []) + pod["spec"]["containers"]
    [sidecar] = [c for c in containers if c["name"] == names.SIDECAR_CONTAINER]
    [port] = [p["containerPort"] for p in sidecar["ports"] if p["name"] == "kvtier-http"]
    endpoint = ControlEndpoint(pod["status"]["podIP"], port, control_tls.SCRAPE_SERVER_NAME, ca.read_bytes())

    def metric(name: str, **labels: str) -> float:
        status, body = endpoint.get(control_api.METRICS.path)
        assert status == 200, (status, body[:300])
        total = 0.0
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total
    return metric


def memory_bytes(quantity: str) -> int:
    """A memory quantity as kubelet reports it (plain bytes or a binary suffix)."""
    for suffix, shift in (("Ki", 10), ("Mi", 20), ("Gi", 30)):
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) << shift
    return int(quantity)


def test_dram_fit_is_judged_on_each_real_nodes_allocatable_memory(node_cluster, chart):
    """The nodes differ in size (node 1 keeps SMALL_NODE_MEMORY allocatable, node 0 the
    host's). A policy whose sidecar needs more than node 1 has, for pods that can only go
    to node 1: the scheduler leaves the pod Pending, and the policy's DramFits names node 1
    with the allocatable memory its kubelet reports, while a policy that fits says so."""
    kubectl, image = chart["kubectl"], chart["image"]
    small = node_cluster.node_names[1]
    allocatable = kubectl.get_json("node", small)["status"]["allocatable"]["memory"]
    ns = "serving-big"
    # More than node 1's allocatable, less than the host's (node 0).
    policy = restricted_namespace_with_policy(kubectl, ns, "big", dram="5Gi", name="big")
    sts = engine_statefulset(ns, "big", image, ENGINE_SCRIPT, policy)
    sts["spec"]["template"]["spec"]["nodeSelector"] = {"kubernetes.io/hostname": small}
    kubectl.apply(sts)

    def dram_fits() -> dict[str, Any] | None:
        status = kubectl.get_json("-n", ns, "kvcp", "big").get("status") or {}
        cond = next((c for c in status.get("conditions", []) if c["type"] == "DramFits"), None)
        return cond if cond and cond["status"] == "False" else None
    try:
        cond = wait_for("DramFits=False naming the small node", dram_fits, 120, 0.5)
    except WaitTimeout as e:
        raise AssertionError(f"{e}\n{pod_story(kubectl, ns)}") from None
    assert cond["reason"] == "NodeTooSmall", cond
    assert f"big-0 (none of {small} ({memory_bytes(allocatable)} bytes)" in cond["message"], (allocatable, cond)
    [pod] = kubectl.get_json("-n", ns, "pods", "-l", "app=big")["items"]
    assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName"), pod["status"]
    # The policies whose pods run fit where they run.
    fits = kubectl.get_json("-n", SERVING_NAMESPACES[2], "kvcp", "minimal")["status"]["conditions"]
    assert any(c["type"] == "DramFits" and c["status"] == "True" for c in fits), fits


def test_a_sidecar_image_missing_from_the_node_is_named_in_the_policys_status(node_cluster, chart):
    """Runs after the tests that need the image: it deletes the chart's image from the
    node's containerd. A new serving pod's sidecar then cannot start; kubelet says why in
    the pod's events, and the policy's status says it too (SidecarsRunning=False with
    kubelet's reason, a SidecarNotRunning Event) instead of a silent Pending pod."""
    kubectl, image = chart["kubectl"], chart["image"]
    ns = SERVING_NAMESPACES[4]
    policy = restricted_namespace_with_policy(kubectl, ns, "noimage")
    name = policy["metadata"]["name"]
    node_cluster.remove_image(image)
    assert not any(ref == image for ref in node_cluster.images())
    kubectl.apply(engine_statefulset(ns, "noimage", image, ENGINE_SCRIPT, policy))

    def stuck() -> dict[str, Any] | None:
        status = policy_status(kubectl, ns, name)
        cond = next((c for c in status.get("conditions", []) if c["type"] == "SidecarsRunning"), None)
        return cond if cond and cond["status"] == "False" else None
    try:
        cond = wait_for("SidecarsRunning=False in the policy's status", stuck, 120, 0.5)
    except WaitTimeout as e:
        raise AssertionError(f"{e}\n{pod_story(kubectl, ns)}") from None
    assert cond["reason"] == "SidecarNotRunning"
    assert "noimage-0: ErrImageNeverPull" in cond["message"] and image in cond["message"], cond
    events = kubectl.get_json("-n", ns, "events")["items"]
    assert any(e["reason"] == "SidecarNotRunning" and e["involvedObject"]["kind"] == "KVCachePolicy"
               for e in events), [e["reason"] for e in events]
    assert any(e["reason"] in ("ErrImageNeverPull", "Failed") and e["involvedObject"]["name"] == "noimage-0"
               and image in e.get("message", "") for e in events), [(e["reason"], e.get("message")) for e in events]


def test_zz_the_network_rule_held(node_cluster):
    """Runs last in the module: no packet for the cluster's ranges tried to leave through
    any link but the cluster's bridge and loopback."""
    drops = node_cluster.guard_drops()
    assert len(drops) == 2, drops  # the destination and the source rule
    assert all(v == 0 for v in drops.values()), drops
