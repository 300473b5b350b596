"""The operator against the real apiserver, run by KopfRunner with its least-privilege
ServiceAccount: config rendering, verdicts, sidecar injection (real sidecar run by the
node agent), membership epochs with warm-up before publication, and restarts."""
from __future__ import annotations

import contextlib
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
from kvtier import routing
from kvtier.affinity import AffinityTable
from kvtier_operator import names, sidecar_render
from kvtier_testenv import engine_io, epp
from kvtier_testenv.kubectl import Kubectl
from kvtier_testenv.ports import free_port
from operator_cases import EXAMPLES_DIR
from operator_harness import events, wait_for
from sidecar_fleet import BLOCK_BYTES, PodSidecar, serving_pod, tiny_policy



def status_of(kubectl: Kubectl, name: str) -> dict:
    return kubectl.get_json("kvcp", name).get("status") or {}


def affinity_table(kubectl: Kubectl, name: str) -> AffinityTable | None:
    cm = kubectl.run("get", "configmap", names.affinity_config_map(name), "-o", "json", check=False)
    if cm.returncode != 0:
        return None
    return AffinityTable.from_json(json.loads(cm.stdout)["data"][names.AFFINITY_KEY])


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


TENANTS = [f"tenant-{i:03d}" for i in range(40)]
HOMES = 2
PROMPTS = 2  # per tenant


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


def wait_table(kubectl: Kubectl, name: str, members: int, epoch: int | None = None,
               timeout_s: float = 60) -> AffinityTable:
    def probe():
        t = affinity_table(kubectl, name)
        ok = t is not None and len(t.members) == members and (epoch is None or t.epoch == epoch)
        return t if ok else None
    return wait_for(f"affinity table with {members} members (epoch {epoch})", probe, timeout_s=timeout_s)


def homes(table: AffinityTable, tenants: list[str] = TENANTS) -> dict[str, list[str]]:
    return {t: table.homes_for(t) for t in tenants}


def pending_journal(kubectl: Kubectl, name: str) -> dict | None:
    raw = (kubectl.get_json("kvcp", name)["metadata"].get("annotations") or {}).get(names.PENDING_EPOCH_ANNOTATION)
    return json.loads(raw) if raw else None


class Fleet:
    """Pods of one policy with their real injected sidecars, seeded with tenants."""

    def __init__(self, kubectl: Kubectl, agent, policy_name: str, app: str):
        self.kubectl, self.agent, self.policy, self.app = kubectl, agent, policy_name, app
        self.pokes = 0

    def add(self, *pods: str) -> None:
        for pod in pods:
            self.kubectl.apply(serving_pod(pod, self.app))

    def ready(self, count: int) -> None:
        try:
            self.agent.wait_ready(count, selector=f"app={self.app}", timeout_s=60)
        except TimeoutError as exc:
            logs = {p: self.agent.log(self.kubectl.namespace, p)[-2000:] for p in self.pods()}
            raise AssertionError(f"{exc}\nsidecar logs: {logs}") from None

    def pods(self) -> list[str]:
        items = self.kubectl.get_json("pods", "-l", f"app={self.app}")["items"]
        return sorted(p["metadata"]["name"] for p in items if not p["metadata"].get("deletionTimestamp"))

    def sidecar(self, pod: str) -> PodSidecar:
        return PodSidecar.of(self.agent, self.kubectl.namespace, pod)

    def seed_homes(self, table: AffinityTable, tenants: list[str]) -> None:
        by_pod = {m: self.sidecar(m) for m in table.members}
        for t in tenants:
            for home in table.homes_for(t):
                by_pod[home].seed(t, PROMPTS)

    def learn_tenants(self, count: int) -> AffinityTable:
        """Wake the operator (a pod event), wait until it knows `count` tenants and the
        table it then publishes (bounded loads may move some) has settled."""
        self.pokes += 1
        self.kubectl.run("annotate", "pod", self.pods()[0], f"kvtier.io/poke={self.pokes}", "--overwrite")
        wait_for(f"{count} known tenants", lambda: status_of(self.kubectl, self.policy).get("knownTenants") == count)

        def settled():
            table = affinity_table(self.kubectl, self.policy)
            quiet = pending_journal(self.kubectl, self.policy) is None
            return table if quiet and status_of(self.kubectl, self.policy).get("epoch") == table.epoch else None
        return wait_for("a settled table", settled)


def new_warm_jobs(sidecar: PodSidecar, since: float) -> list[dict]:
    return [j for j in sidecar.warm_jobs() if j["started_s"] >= since]


def redis_table(redis_url: str, namespace: str, name: str) -> tuple[AffinityTable, dict] | None:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        raw = client.get(names.REDIS_AFFINITY_KEY.format(namespace=namespace, name=name))
    finally:
        client.close()
    if raw is None:
        return None
    payload = json.loads(raw)
    return AffinityTable.model_validate(payload["table"]), payload["addresses"]


def assert_router_reads_the_same_table_from_redis(kubectl: Kubectl, redis_url: str, name: str) -> None:
    """A router reading Redis picks exactly what one reading the ConfigMap picks."""
    cm = json.loads(kubectl.run("get", "configmap", names.affinity_config_map(name), "-o", "json").stdout)
    from_cm = AffinityTable.from_json(cm["data"][names.AFFINITY_KEY])
    got = wait_for("the epoch in Redis", lambda: (r := redis_table(redis_url, kubectl.namespace, name))
                   and r[0].epoch == from_cm.epoch and r)
    from_redis, addresses = got
    assert from_redis == from_cm and addresses == json.loads(cm["data"][names.ADDRESSES_KEY])
    occupancy = {m: 0.5 for m in from_cm.members}
    assert all(routing.pick(t, from_redis, occupancy) == routing.pick(t, from_cm, occupancy) for t in TENANTS)


class FleetPicker:
    """kvtier's real Endpoint Picker (`kvtier-epp`, driven over ext_proc by the tests'
    gateway stand-in) over an InferencePool of a fleet's pods, reading the operator's
    table from Redis as the chart configures it; a stub of vLLM's /metrics at each pod's
    IP (no engine runs behind the node agent's pods), every pod equally cool."""

    def __init__(self, stack: contextlib.ExitStack, kubectl: Kubectl, app: str, redis_url: str, policy_name: str,
                 workdir: Path):
        self.stack, self.port = stack, free_port()
        self.stubs: dict[str, epp.EngineMetrics] = {}
        bins = epp.find()  # fails loudly (EppBinariesMissing: run scripts/setup.sh)
        crds = epp.install_pool_crds(kubectl)
        stack.callback(epp.remove_crds, kubectl, crds)  # the shared API server as it was
        epp.apply_pool(kubectl, app, {"app": app}, target_port=self.port)
        config = workdir / "epp.yaml"
        config.write_text(epp.picker_config(
            workdir / "no-table-file.json", redisUrl=redis_url, redisInterval="200ms",
            redisKey=names.REDIS_AFFINITY_KEY.format(namespace=kubectl.namespace, name=policy_name)))
        self.picker = stack.enter_context(epp.Picker(bins, kubectl.kubeconfig, kubectl.namespace, app, config,
                                                     workdir / "epp.log", target_port=self.port))

    def serve_metrics(self, ip: str) -> None:
        if ip not in self.stubs:
            self.stubs[ip] = stub = epp.EngineMetrics(ip, self.port, kv_usage=0.1)
            self.stack.callback(stub.stop)

    def wait_routes(self, tenants: list[str], home_ip: dict[str, str], timeout_s: float = 30.0) -> None:
        for t in tenants:
            try:
                self.picker.wait_lands(f"the EPP to route {t} to {home_ip[t]}", home_ip[t], f"x-tenant-id={t}",
                                       timeout_s=timeout_s)
            except BaseException:
                print(f"kvtier-epp's log:\n{self.picker.log_tail()}\nlast gateway error: {self.picker.last_error}")
                raise


def test_epochs(operator, kubectl, node_agent_factory, api_client, redis_url):
    """Join and leave with the real injected sidecars: one new epoch each; on a join
    about k/(n+1) of tenants gain the newcomer and nothing else moves; on a leave only
    the departed pod's tenants move; each moved tenant's warm-up on its new home
    finished (per that sidecar's own /cache/jobs) before the epoch was published, and
    the new home then serves the tenant's prefixes with the right KV; home load stays
    within balanceFactor x the mean; Redis carries the same table as the ConfigMap.
    kvtier's real EPP reads that table from Redis: before the join it routes each tenant
    to its first home, after it the tenants whose first home is the newcomer go there,
    where their first requests hit (the warm-up above)."""
    with contextlib.ExitStack() as stack:
        _epochs(stack, operator, kubectl, node_agent_factory, api_client, redis_url)


def _epochs(stack, operator, kubectl, node_agent_factory, api_client, redis_url):
    workdir = short_workdir()
    fleet = Fleet(kubectl, node_agent_factory(workdir=workdir), "fleet", "fleet")
    kubectl.apply(tiny_policy("fleet", "fleet", affinity={"homes": HOMES, "warmTimeout": "30s"},
                              redis={"url": redis_url}))
    wait_for("sidecar ConfigMap", lambda: kubectl.run(
        "get", "configmap", names.sidecar_config_map("fleet"), check=False).returncode == 0)
    fleet.add("f0", "f1", "f2")
    fleet.ready(3)
    router = FleetPicker(stack, kubectl, "fleet", redis_url, "fleet", workdir)  # starts beside the seeding
    for m in ("f0", "f1", "f2"):
        router.serve_metrics(fleet.sidecar(m).ip)
    fleet.seed_homes(wait_table(kubectl, "fleet", 3), TENANTS)
    t0 = fleet.learn_tenants(len(TENANTS))
    assert_router_reads_the_same_table_from_redis(kubectl, redis_url, "fleet")
    ip_of = {m: fleet.sidecar(m).ip for m in t0.members}
    first_home_ip = {t: ip_of[homes(t0)[t][0]] for t in TENANTS}
    router.wait_routes(TENANTS[:1], first_home_ip, timeout_s=epp.START_TIMEOUT_S)  # up, and reading Redis
    router.wait_routes(TENANTS, first_home_ip)
    watcher = EpochWatcher(api_client, kubectl.namespace, "fleet")
    try:
        # Join.
        joined_at = time.time()
        fleet.add("f3")
        fleet.ready(4)
        router.serve_metrics(fleet.sidecar("f3").ip)
        t1 = wait_table(kubectl, "fleet", 4, epoch=t0.epoch + 1)
        before, after = homes(t0), homes(t1)
        moved = {t for t in TENANTS if before[t] != after[t]}
        assert moved == {t for t in TENANTS if "f3" in after[t]}
        assert all(set(after[t]) - set(before[t]) == {"f3"} for t in moved)
        assert abs(len(moved) / len(TENANTS) - HOMES / 4) < 0.15, len(moved)
        status = wait_for("status of the join", lambda: (s := status_of(kubectl, "fleet")).get("epoch") == t1.epoch and s)
        assert status["movedTenants"] == len(moved) and status["knownTenants"] == len(TENANTS)
        f3 = fleet.sidecar("f3")
        warms = new_warm_jobs(f3, joined_at)
        assert sorted(j["tenant"] for j in warms) == sorted(moved)  # one each
        ips = {m: fleet.sidecar(m).ip for m in t0.members}
        assert all(j["from_peer"].rsplit(":", 1)[0] in {ips[m] for m in before[j["tenant"]]} for j in warms)
        assert all(j["state"] == "done" and j["bytes"] == PROMPTS * 4 * BLOCK_BYTES for j in warms)
        wait_for("epoch seen", lambda: t1.epoch in watcher.first_seen)
        assert max(j["finished_s"] for j in warms) < watcher.first_seen[t1.epoch]
        assert all(f3.holds(t, PROMPTS) for t in moved)
        # The EPP follows the published epoch: the tenants whose first home is now f3 go
        # there (and hit: f3 holds their prefixes, checked above); the others stay.
        first_on_f3 = [t for t in moved if after[t][0] == "f3"]
        assert first_on_f3, after
        router.wait_routes(first_on_f3, {t: f3.ip for t in first_on_f3})
        ip_of["f3"] = f3.ip
        router.wait_routes(TENANTS, {t: ip_of[after[t][0]] for t in TENANTS})
        loads = [sum(m in h for h in after.values()) for m in t1.members]
        assert max(loads) <= 1.25 * (len(TENANTS) * HOMES / len(t1.members)), loads
        assert_router_reads_the_same_table_from_redis(kubectl, redis_url, "fleet")

        # Leave.
        left_at = time.time()
        kubectl.delete("pod", "f1")
        t2 = wait_table(kubectl, "fleet", 3, epoch=t1.epoch + 1)
        after2 = homes(t2)
        moved2 = {t for t in TENANTS if after[t] != after2[t]}
        assert moved2 == {t for t in TENANTS if "f1" in after[t]}
        gained = {(t, m) for t in moved2 for m in set(after2[t]) - set(after[t])}
        # A surviving home promoted to first home is warmed too (from the leaver).
        gained |= {(t, after2[t][0]) for t in moved2 if after2[t][0] != after[t][0]}
        warms2 = [(j["tenant"], m, j) for m in t2.members for j in new_warm_jobs(fleet.sidecar(m), left_at)]
        assert sorted((t, m) for t, m, _ in warms2) == sorted(gained)
        wait_for("epoch seen", lambda: t2.epoch in watcher.first_seen)
        assert max(j["finished_s"] for _, _, j in warms2) < watcher.first_seen[t2.epoch]
        assert all(fleet.sidecar(m).holds(t, PROMPTS) for t, m in gained)
        assert_router_reads_the_same_table_from_redis(kubectl, redis_url, "fleet")
    finally:
        watcher.stop()
    posted = wait_for("the leave's Event", lambda: t2.epoch in epochs_in_events(kubectl, "fleet")
                      and events(kubectl, "fleet", "EpochChanged"))
    numbers = epochs_in_events(kubectl, "fleet")
    assert len(numbers) == len(set(numbers)) and {t1.epoch, t2.epoch} <= set(numbers)  # one Event per epoch
    assert any("joined f3" in e["message"] for e in posted) and any("left f1" in e["message"] for e in posted)


def epochs_in_events(kubectl: Kubectl, name: str) -> list[int]:
    return [int(re.match(r"epoch (\d+):", e["message"]).group(1)) for e in events(kubectl, name, "EpochChanged")
            for _ in range(e.get("count", 1))]


MANY_TENANTS = [f"tenant-{i:03d}" for i in range(60)]


@pytest.mark.parametrize("operator", [{"warms_per_target": 1}], indirect=True, ids=["one-warm-per-target"])
def test_restart_mid_warm_up(operator, kubectl, node_agent_factory, api_client, caplog):
    """Killed while a join's warm-ups run, the operator has published nothing; restarted,
    it asks no sidecar again for a warm-up its journal recorded, runs each moved
    tenant's warm-up exactly once in all, and publishes the epoch (one Event) only after
    the last one finished; restarted again with nothing changed, it writes nothing."""
    fleet = Fleet(kubectl, node_agent_factory(workdir=short_workdir()), "fleet", "fleet")
    kubectl.apply(tiny_policy("fleet", "fleet", affinity={"homes": HOMES, "warmTimeout": "60s"}))
    wait_for("sidecar ConfigMap", lambda: kubectl.run(
        "get", "configmap", names.sidecar_config_map("fleet"), check=False).returncode == 0)
    fleet.add("f0", "f1", "f2")
    fleet.ready(3)
    fleet.seed_homes(wait_table(kubectl, "fleet", 3), MANY_TENANTS)
    t0 = fleet.learn_tenants(len(MANY_TENANTS))
    watcher = EpochWatcher(api_client, kubectl.namespace, "fleet")
    try:
        joined_at = time.time()
        fleet.add("f3")
        fleet.ready(4)
        f3 = fleet.sidecar("f3")
        wait_for("a few finished warm-ups on f3",
                 lambda: sum(j["state"] == "done" for j in new_warm_jobs(f3, joined_at)) >= 3, timeout_s=30)
        operator.stop()
        journal = pending_journal(kubectl, "fleet")
        jobs_at_kill = new_warm_jobs(f3, joined_at)
        assert affinity_table(kubectl, "fleet").epoch == t0.epoch  # nothing published mid-warm-up
        assert journal is not None and journal["epoch"] == t0.epoch + 1
        journaled = {key.split("@")[0] for key in journal["done"]}
        assert journaled and journaled <= {j["tenant"] for j in jobs_at_kill if j["state"] == "done"}

        operator.start()
        t1 = wait_table(kubectl, "fleet", 4, epoch=t0.epoch + 1)
        t1_expected_moves = {t for t in MANY_TENANTS if t0.homes_for(t) != t1.homes_for(t)}
        assert len(jobs_at_kill) < len(t1_expected_moves)  # the kill did land mid-way
        warms = new_warm_jobs(f3, joined_at)
        assert sorted(j["tenant"] for j in warms) == sorted(t1_expected_moves)  # each exactly once
        assert all(j["asks"] == 1 for j in warms if j["tenant"] in journaled)  # journaled: never re-asked
        wait_for("epoch seen", lambda: t1.epoch in watcher.first_seen)
        assert all(j["state"] == "done" for j in warms)
        assert max(j["finished_s"] for j in warms) < watcher.first_seen[t1.epoch]
        assert pending_journal(kubectl, "fleet") is None
    finally:
        watcher.stop()
    wait_for("status epoch", lambda: status_of(kubectl, "fleet").get("epoch") == t1.epoch)
    wait_for("the Event of the epoch", lambda: t1.epoch in epochs_in_events(kubectl, "fleet"))
    numbers = epochs_in_events(kubectl, "fleet")
    assert len(numbers) == len(set(numbers))

    def versions() -> tuple:
        return tuple(kubectl.get_json(*what)["metadata"]["resourceVersion"] for what in (
            ("configmap", names.affinity_config_map("fleet")), ("configmap", names.sidecar_config_map("fleet")),
            ("kvcp", "fleet")))

    quiet = versions()
    asked = {j["tenant"]: j["asks"] for j in warms}
    operator.stop()
    caplog.set_level(logging.INFO, logger="kvtier.operator")
    caplog.clear()
    operator.start()
    wait_for("a resumed membership pass", lambda: any(
        "membership of" in r.getMessage() and "new epoch: False" in r.getMessage() for r in caplog.records))
    assert versions() == quiet
    assert affinity_table(kubectl, "fleet").epoch == t1.epoch
    assert epochs_in_events(kubectl, "fleet") == numbers
    assert {j["tenant"]: j["asks"] for j in new_warm_jobs(f3, joined_at)} == asked


def test_nvme_shadow_measurement_feeds_the_tier_verdict(operator, kubectl, node_agent_factory, tmp_path):
    """nvme.mode shadow: the injected sidecar measures the disk under spec.tiers.nvme.path
    (a hostPath) and reports it; the operator recomputes the NVMe verdict in status with
    the fleet's measured bandwidth, and its condition gives the measured numbers."""
    disk = tmp_path / "nvme"
    fleet = Fleet(kubectl, node_agent_factory(workdir=short_workdir()), "disk", "disk")
    kubectl.apply(tiny_policy("disk", "disk", tiers={"dram": {"capacity": "16Mi"},
                                                     "nvme": {"mode": "shadow", "path": str(disk)}}))
    wait_for("sidecar ConfigMap", lambda: kubectl.run(
        "get", "configmap", names.sidecar_config_map("disk"), check=False).returncode == 0)
    fleet.add("d0")
    fleet.ready(1)
    pod = kubectl.get_json("pod", "d0")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[names.NVME_VOLUME]["hostPath"]["path"] == str(disk)
    measured = wait_for("a measurement", lambda: (n := fleet.sidecar("d0").get("/cache/stats").get("nvme"))
                        and n["measured_gbps"], timeout_s=30)
    assert disk.is_dir() and list(disk.iterdir()) == []
    fleet.pokes += 1
    kubectl.run("annotate", "pod", "d0", "kvtier.io/poke=1", "--overwrite")
    nvme = wait_for("the measured verdict", lambda: next(
        (t for t in status_of(kubectl, "disk").get("tiers", []) if t["tier"] == "nvme" and t.get("measuredGbps")), None))
    latest = fleet.sidecar("d0").get("/cache/stats")["nvme"]["measured_gbps"]
    assert nvme["measuredGbps"] in (round(measured, 3), round(latest, 3))
    spec = policy.parse_policy(kubectl.get_json("kvcp", "disk")).spec
    report = breakeven.evaluate(presets.ModelShape(name="reference-tiny", layers=2, kv_heads=2, head_dim=16, params=1.0e6), tflops_per_gpu=10, tp=1,
                                kv_dtype=spec.model.kv_dtype, media={"dram": 64.0, "rdma": 25.0,
                                                                     "nvme": nvme["measuredGbps"]})
    assert nvme["bandwidthGbps"] == pytest.approx(nvme["measuredGbps"], abs=1e-3)
    assert nvme["ratio"] == pytest.approx(report.medium("nvme").ratio, abs=1e-3)
    assert nvme["verdict"] == "shadow"
    cond = {c["type"]: c for c in status_of(kubectl, "disk")["conditions"]}["NvmeTier"]
    assert f"NVMe {nvme['measuredGbps']:.2f} GB/s" in cond["message"]


# No membership resync during the test: only the hit-rate timer can write the rate.
NO_RESYNC = {"resync_interval_s": 3600.0}


@pytest.mark.parametrize("operator", [NO_RESYNC], indirect=True)
def test_fleet_hit_rate_follows_steady_traffic_without_membership_change(operator, kubectl, node_agent_factory):
    """Traffic through a member's real sidecar, with no pod event and no resync: the
    operator's hit-rate timer writes the fleet's rate (its engine's loaded tokens over its prompt tokens)
    into status, and `kubectl get kvcp -o wide` shows it in the HitRate column: the
    tokens the engine loaded over its prompts', not what the lookups offered."""
    fleet = Fleet(kubectl, node_agent_factory(workdir=short_workdir()), "steady", "steady")
    kubectl.apply(tiny_policy("steady", "steady"))
    wait_for("sidecar ConfigMap", lambda: kubectl.run(
        "get", "configmap", names.sidecar_config_map("steady"), check=False).returncode == 0)
    fleet.add("s0")
    fleet.ready(1)
    joined = wait_for("membership of s0", lambda: (s := status_of(kubectl, "steady")).get("memberCount") == 1 and s)
    assert joined.get("fleetHitRate") is None  # no lookups yet: no rate to show
    pod_version = kubectl.get_json("pod", "s0")["metadata"]["resourceVersion"]

    sidecar = fleet.sidecar("s0")
    sidecar.seed("tenant-a", PROMPTS)
    assert sidecar.holds("tenant-a", PROMPTS)
    # Lookups that hit but whose engine loads nothing (its own prefix cache held the
    # prompts): offered, never loaded. The rate shown must not count them.
    sidecar.offer_only("tenant-a", PROMPTS, rounds=3)
    stats = sidecar.get("/cache/stats")
    expected = engine_io.hit_rate([stats])
    assert expected > 0 and engine_io.offered_rate([stats]) > expected + 0.2

    status = wait_for("the fleet hit rate in status", lambda: (s := status_of(kubectl, "steady"))
                      .get("fleetHitRate") == expected and s)
    assert status["epoch"] == joined["epoch"] and status["memberCount"] == 1
    # The membership loop was never woken: the pod did not change after it joined.
    assert kubectl.get_json("pod", "s0")["metadata"]["resourceVersion"] == pod_version
    assert float(printed_column(kubectl.run("get", "kvcp", "steady", "-o", "wide").stdout, "HITRATE")) \
        == pytest.approx(expected, abs=1e-4)


def printed_column(table: str, header: str) -> str:
    """One column of kubectl's first row, cut at the header's position (an empty
    column prints nothing, so splitting on spaces would shift the columns)."""
    head, row = table.splitlines()[:2]
    start = head.index(header)
    nxt = re.search(r"\S", head[start + len(header):])
    stop = start + len(header) + nxt.start() if nxt else len(row)
    return row[start:stop].strip()
