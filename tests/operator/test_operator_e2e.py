"""The operator against the real apiserver, run by KopfRunner with its least-privilege
ServiceAccount: config rendering, verdicts, sidecar injection (real sidecar run by the
node agent), membership epochs with warm-up before publication, and restarts."""
from __future__ import annotations

import json
import logging
import re
import threading
import time
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


STANDIN = Path(__file__).resolve().parent / "recording_sidecar.py"
TENANTS = [f"tenant-{i:04d}" for i in range(200)]
HOMES = 2


def standin_pod(name: str, record_dir: Path, warm_s: float = 0.3) -> dict:
    """A pod whose `kvtier-sidecar` is the recording stand-in (so the webhook leaves it be)."""
    field = lambda path: {"valueFrom": {"fieldRef": {"fieldPath": path}}}  # noqa: E731
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "standin"}},
        "spec": {"containers": [{
            "name": "kvtier-sidecar", "image": "standin:1",
            "command": ["python", str(STANDIN), "--tenants", str(len(TENANTS)),
                        "--record-dir", str(record_dir), "--warm-s", str(warm_s)],
            "env": [{"name": "POD_NAME", **field("metadata.name")}, {"name": "POD_IP", **field("status.podIP")}],
            "readinessProbe": {"httpGet": {"path": "/readyz", "port": 8081}, "periodSeconds": 1},
        }]},
    }


class EpochWatcher:
    """Records when each published epoch is first seen (polling the ConfigMap)."""

    def __init__(self, api_client, namespace: str, name: str):
        from kubernetes import client

        self.core, self.namespace, self.name, self.first_seen = client.CoreV1Api(api_client), namespace, name, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            cm = self.core.read_namespaced_config_map(names.affinity_config_map(self.name), self.namespace)
            epoch = AffinityTable.from_json(cm.data[names.AFFINITY_KEY]).epoch
            self.first_seen.setdefault(epoch, time.time())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def wait_table(kubectl: Kubectl, name: str, members: int, epoch: int | None = None) -> AffinityTable:
    def probe():
        t = affinity_table(kubectl, name)
        ok = t is not None and len(t.members) == members and (epoch is None or t.epoch == epoch)
        return t if ok else None
    return wait_for(f"affinity table with {members} members (epoch {epoch})", probe, timeout_s=60)


def homes(table: AffinityTable) -> dict[str, list[str]]:
    return {t: table.homes_for(t) for t in TENANTS}


def ip_of(kubectl: Kubectl, pod: str) -> str:
    return kubectl.get_json("pod", pod)["status"]["podIP"]


def test_epochs(operator, kubectl, node_agent_factory, tmp_path, api_client):
    """Join and leave through the node agent: one new epoch each; on a join about
    k/(n+1) of tenants gain the newcomer and nothing else moves; on a leave only the
    departed pod's tenants move; warm-ups finish on the new homes before the epoch is
    published; home load stays within balanceFactor x the mean."""
    agent = node_agent_factory(workdir=short_workdir())
    records = tmp_path / "records"
    records.mkdir()
    kubectl.apply(tiny_policy("fleet", "standin", affinity={"homes": HOMES, "warmTimeout": "20s"}))
    for i in range(3):
        kubectl.apply(standin_pod(f"s{i}", records))
    agent.wait_ready(3, selector="app=standin")
    t0 = wait_table(kubectl, "fleet", 3)
    watcher = EpochWatcher(api_client, kubectl.namespace, "fleet")
    try:
        # Join.
        joined_at = time.time()
        kubectl.apply(standin_pod("s3", records))
        agent.wait_ready(4, selector="app=standin")
        t1 = wait_table(kubectl, "fleet", 4, epoch=t0.epoch + 1)
        before, after = homes(t0), homes(t1)
        moved = {t for t in TENANTS if before[t] != after[t]}
        assert moved == {t for t in TENANTS if "s3" in after[t]}
        assert all(set(after[t]) - set(before[t]) == {"s3"} for t in moved)
        assert abs(len(moved) / len(TENANTS) - HOMES / 4) < 0.12, len(moved)
        status = wait_for("status of epoch 1", lambda: (s := status_of(kubectl, "fleet")).get("epoch") == t1.epoch and s)
        assert status["movedTenants"] == len(moved) and status["knownTenants"] == len(TENANTS)
        warms = [r for r in read_records(records) if r["arrived"] >= joined_at]
        assert {r["tenant"] for r in warms} == moved and {r["pod"] for r in warms} == {"s3"}
        old_home_ips = {t: {ip_of(kubectl, m) for m in before[t]} for t in moved}
        assert all(r["from_peer"].rsplit(":", 1)[0] in old_home_ips[r["tenant"]] for r in warms)
        wait_for("epoch seen", lambda: t1.epoch in watcher.first_seen)
        assert max(r["done"] for r in warms) < watcher.first_seen[t1.epoch]
        loads = [sum(m in h for h in after.values()) for m in t1.members]
        assert max(loads) <= 1.25 * (len(TENANTS) * HOMES / len(t1.members)), loads

        # Leave.
        left_at = time.time()
        kubectl.delete("pod", "s1")
        t2 = wait_table(kubectl, "fleet", 3, epoch=t1.epoch + 1)
        after2 = homes(t2)
        moved2 = {t for t in TENANTS if after[t] != after2[t]}
        assert moved2 == {t for t in TENANTS if "s1" in after[t]}
        warms2 = [r for r in read_records(records) if r["arrived"] >= left_at]
        assert {(r["tenant"], r["pod"]) for r in warms2} == {
            (t, m) for t in moved2 for m in set(after2[t]) - set(after[t])}
        wait_for("epoch seen", lambda: t2.epoch in watcher.first_seen)
        assert max(r["done"] for r in warms2) < watcher.first_seen[t2.epoch]
    finally:
        watcher.stop()
    posted = wait_for("the leave's Event", lambda: t2.epoch in epochs_in_events(kubectl, "fleet")
                      and events(kubectl, "fleet", "EpochChanged"))
    numbers = epochs_in_events(kubectl, "fleet")
    assert len(numbers) == len(set(numbers)) and {t1.epoch, t2.epoch} <= set(numbers)  # one Event per epoch
    assert any("joined s3" in e["message"] for e in posted) and any("left s1" in e["message"] for e in posted)


def epochs_in_events(kubectl: Kubectl, name: str) -> list[int]:
    return [int(re.match(r"epoch (\d+):", e["message"]).group(1)) for e in events(kubectl, name, "EpochChanged")
            for _ in range(e.get("count", 1))]


def test_restart(operator, kubectl, node_agent_factory, tmp_path, caplog):
    """Killed, the operator misses a join; restarted, it publishes exactly one epoch,
    one Event and one warm-up per moved tenant; restarted again with nothing changed,
    it writes nothing at all."""
    caplog.set_level(logging.INFO, logger="kvtier.operator")
    agent = node_agent_factory(workdir=short_workdir())
    records = tmp_path / "records"
    records.mkdir()
    kubectl.apply(tiny_policy("fleet", "standin", affinity={"homes": HOMES}))
    for i in range(3):
        kubectl.apply(standin_pod(f"s{i}", records))
    agent.wait_ready(3, selector="app=standin")
    t0 = wait_table(kubectl, "fleet", 3)
    wait_for("status epoch", lambda: status_of(kubectl, "fleet").get("epoch") == t0.epoch)

    operator.stop()
    kubectl.apply(standin_pod("s3", records))
    agent.wait_ready(4, selector="app=standin")
    joined_at = time.time()
    operator.start()
    t1 = wait_table(kubectl, "fleet", 4, epoch=t0.epoch + 1)
    wait_for("status epoch", lambda: status_of(kubectl, "fleet").get("epoch") == t1.epoch)
    moved = {t for t in TENANTS if t0.homes_for(t) != t1.homes_for(t)}
    warms = [r for r in read_records(records) if r["arrived"] >= joined_at]
    assert sorted(r["tenant"] for r in warms) == sorted(moved)  # each exactly once
    wait_for("the Event of the missed join", lambda: t1.epoch in epochs_in_events(kubectl, "fleet"))
    numbers = epochs_in_events(kubectl, "fleet")
    assert len(numbers) == len(set(numbers))
    n_events = len(numbers)

    def versions() -> tuple:
        return tuple(kubectl.get_json(*what)["metadata"]["resourceVersion"] for what in (
            ("configmap", names.affinity_config_map("fleet")), ("configmap", names.sidecar_config_map("fleet")),
            ("kvcp", "fleet")))

    quiet = versions()
    operator.stop()
    caplog.clear()
    operator.start()
    wait_for("a resumed membership pass", lambda: any(
        "membership of" in r.getMessage() and "new epoch: False" in r.getMessage() for r in caplog.records))
    assert versions() == quiet
    assert affinity_table(kubectl, "fleet").epoch == t1.epoch
    assert len(epochs_in_events(kubectl, "fleet")) == n_events
    assert [r for r in read_records(records) if r["arrived"] >= joined_at] == warms
