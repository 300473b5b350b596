"""The operator against the real apiserver, run by KopfRunner with its least-privilege
ServiceAccount: config rendering, verdicts, sidecar injection (real sidecar run by the
node agent), membership epochs with warm-up before publication, and restarts."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import yaml

from kvtier import breakeven, policy, presets
from kvtier.affinity import AffinityTable
from kvtier_operator import names, sidecar_render
from kvtier_testenv.kubectl import Kubectl
from operator_cases import EXAMPLES_DIR
from operator_harness import (
    RunningOperator, events, free_port, operator_options, read_records, register_webhook, wait_for,
)

DIGEST = "sha256:" + "1" * 64
TINY_SHAPE = {"layers": 2, "kvHeads": 2, "headDim": 16, "params": 1.0e6}


def tiny_policy(name: str, app: str, **spec: object) -> dict:
    body = {
        "apiVersion": "kvtier.io/v1alpha1", "kind": "KVCachePolicy", "metadata": {"name": name},
        "spec": {"selector": {"matchLabels": {"app": app}},
                 "model": {"id": "reference-tiny", "weightsVersion": DIGEST, "shape": TINY_SHAPE},
                 "hardware": {"denseTflopsPerGpu": 10}, "tiers": {"dram": {"capacity": "16Mi"}}},
    }
    body["spec"].update(spec)
    return body


def status_of(kubectl: Kubectl, name: str) -> dict:
    return kubectl.get_json("kvcp", name).get("status") or {}


def affinity_table(kubectl: Kubectl, name: str) -> AffinityTable | None:
    cm = kubectl.run("get", "configmap", names.affinity_config_map(name), "-o", "json", check=False)
    if cm.returncode != 0:
        return None
    return AffinityTable.from_json(json.loads(cm.stdout)["data"][names.AFFINITY_KEY])


@pytest.fixture
def operator(namespace, operator_kubeconfig, control_plane, tmp_path, monkeypatch):
    port = free_port()
    options = operator_options(tmp_path, port)
    hook = register_webhook(Kubectl(control_plane.kubeconfig), namespace, open(options.webhook_cert, "rb").read(), port)
    op = RunningOperator(namespace, operator_kubeconfig, options, monkeypatch).start()
    yield op
    if op.runner is not None:
        op.stop()
    Kubectl(control_plane.kubeconfig).delete("mutatingwebhookconfiguration", hook)


def short_workdir() -> Path:
    """The node agent maps /var/run/kvtier under its workdir; the engine socket's path
    must stay within AF_UNIX's 108 bytes, so the workdir (and test name) stay short."""
    return Path(tempfile.mkdtemp(prefix="n", dir="/tmp"))


def test_inject(operator, kubectl, node_agent_factory):
    """ConfigMap rendered, verdicts match the calculator, the sidecar injected into a
    selected pod only, and the real injected sidecar (run by the node agent) joins."""
    node_agent = node_agent_factory(workdir=short_workdir())
    kubectl.apply(tiny_policy("tiny", "llm"))
    chat = yaml.safe_load((EXAMPLES_DIR / "llama-70b-interactive.yaml").read_text())
    chat["spec"]["redis"] = {"url": "redis://127.0.0.1:1/0"}  # unreachable: publishing degrades, never fails
    kubectl.apply(chat)

    # 1. The sidecar ConfigMap is exactly the rendering of the spec.
    cm = wait_for("sidecar ConfigMap", lambda: kubectl.run(
        "get", "configmap", names.sidecar_config_map("tiny"), "-o", "json", check=False).stdout)
    spec = policy.parse_policy(kubectl.get_json("kvcp", "tiny")).spec
    assert json.loads(cm)["data"][names.CONFIG_KEY] == sidecar_render.render(spec).text

    # 2. Verdicts in status match the calculator, and NVMe for interactive 70B is refused with numbers.
    tiers = wait_for("chat verdicts", lambda: status_of(kubectl, chat["metadata"]["name"]).get("tiers"))
    report = breakeven.evaluate(presets.model_preset("llama-3-70b"), tflops_per_gpu=989.5, tp=4,
                                media={"dram": 64.0, "rdma": 25.0, "nvme": 7.0})
    by_tier = {t["tier"]: t for t in tiers}
    assert by_tier["dram"]["breakEvenGbps"] == pytest.approx(report.break_even_gbps, abs=1e-3) == pytest.approx(9.264, abs=1e-3)
    assert by_tier["dram"]["ratio"] == pytest.approx(report.medium("dram").ratio, abs=1e-3)
    assert by_tier["peer"]["ratio"] == pytest.approx(report.medium("rdma").ratio, abs=1e-3)
    assert by_tier["nvme"]["verdict"] == "shadow" and by_tier["nvme"]["ratio"] == pytest.approx(0.756, abs=1e-3)
    conds = {c["type"]: c for c in status_of(kubectl, chat["metadata"]["name"])["conditions"]}
    assert conds["NvmeTier"]["status"] == "False" and conds["NvmeTier"]["reason"] == "SlowerThanRecompute"
    assert "7.00 GB/s vs break-even 9.26 GB/s" in conds["NvmeTier"]["message"]
    assert events(kubectl, chat["metadata"]["name"], "TierVerdict")

    # 3. A selected pod gets the sidecar; an unselected one is untouched.
    engine = {"name": "engine", "image": "engine:1", "command": ["sleep", "infinity"]}
    kubectl.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "llm-0", "labels": {"app": "llm"}},
                   "spec": {"containers": [engine]}})
    kubectl.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-0", "labels": {"app": "web"}},
                   "spec": {"containers": [engine]}})
    pod = kubectl.get_json("pod", "llm-0")
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    assert set(containers) == {"engine", "kvtier-sidecar"}
    assert pod["metadata"]["annotations"][names.INJECTED_ANNOTATION] == "tiny"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[names.CONFIG_VOLUME]["configMap"]["name"] == names.sidecar_config_map("tiny")
    assert volumes[names.SHM_VOLUME]["emptyDir"]["medium"] == "Memory"
    assert {e["name"] for e in containers["kvtier-sidecar"]["env"]} >= {"POD_NAME", "POD_NAMESPACE", "POD_IP"}
    assert {m["mountPath"] for m in containers["engine"]["volumeMounts"]} >= {"/dev/shm", "/var/run/kvtier"}
    web = kubectl.get_json("pod", "web-0")
    assert [c["name"] for c in web["spec"]["containers"]] == ["engine"] and "volumes" not in web["spec"] or all(
        v["name"] not in volumes for v in web["spec"].get("volumes", []) if v["name"].startswith("kvtier"))

    # 4. The node agent runs the real injected sidecar; once Ready, the pod is a member.
    try:
        node_agent.wait_ready(1, selector="app=llm", timeout_s=60)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\nsidecar log:\n{node_agent.log(kubectl.namespace, 'llm-0')}") from None
    status = wait_for("membership of llm-0", lambda: (s := status_of(kubectl, "tiny")).get("memberCount") == 1 and s)
    assert status["epoch"] >= 1 and status["phase"] == "Ready"
    assert list(affinity_table(kubectl, "tiny").members) == ["llm-0"]
