"""The cluster demo's story (`python -m kvtier_testenv.demo --mode cluster --nodes agent`):
the whole product on an embedded Kubernetes whose pods the node agent runs. `./scripts/demo.sh`
runs the same story on two real nodes (`demo_nodes.NodesDemo`, a subclass of `ClusterDemo`).

    control plane (kube-apiserver + etcd + controller-manager, kvtier_testenv)
      + Redis (the global block index)
      + `helm install charts/kvtier`    CRD, RBAC, operator Deployment, webhook
      + node agent (stands in for kubelet: runs the operator pod and every
        injected sidecar as a local process, with in-cluster credentials)
      -> KVCachePolicy for the reference model
      -> StatefulSet of 3 serving pods; the webhook injects the sidecar
      -> reference-engine clients replay a multi-tenant workload, each request
         routed by the published affinity table (kvtier.routing.pick)
      -> scale to 4: the operator warms the moved tenants on their new home,
         then publishes a new epoch; the replay goes on under it
      -> two homes per tenant for the rollouts (the old version's pods then hold every
         tenant's hot prefixes while one of its homes restarts), tenant traffic routed
         to its homes among the Ready pods
      -> roll out weights version v2, gated on the KVTierHitRateDrop alarm in a real
         Prometheus (which discovers the sidecars and the operator through the
         apiserver and evaluates the chart's rules): canary -> its hit rate recovers
         -> 50% -> 100% -> complete. Warm-before-ready: each new pod is held out of
         traffic (readiness gate kvtier.io/warm) until the operator has replayed its
         tenants' hottest prefixes through the pod's engine (the reference engine's
         OpenAI-compatible front, kvtier_testenv.engine_front); per step, the new pods'
         first-minute hit rate next to the old version's (target >= 0.8x), with the
         prefill the warm-up spent
      -> roll out v3, whose prompts share no prefix: its hit rate stays at 0, the
         alarm fires in Prometheus, and the operator rolls it back by itself
      -> `kubectl get kvcp`, per-tier hit rates, the epoch, the moved tenants, and
         the rollouts' Events with their numbers

Every hit is checked against a full recompute by the reference engine: any wrong KV,
request-path error, or a step that does not happen (no injection, no new epoch) exits
non-zero. Everything is torn down at the end, including on failure.

The webhook runs in the chart's URL mode (https://127.0.0.1:PORT): the apiserver here
cannot route Services to pods, whose loopback addresses EndpointSlices reject.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier import control_api
from kvtier import names
from kvtier.control_api import pod_audience
from kvtier.names import WEIGHTS_VERSION_ANNOTATION
from kvtier.policy import API_VERSION, ModelSpec
from kvtier.sidecar_config import ServedModel
from kvtier_testenv import engine_io, polling
from kvtier_testenv.binaries import REPO_ROOT

CHART = REPO_ROOT / "charts" / "kvtier"
RELEASE = "kvtier"
SYSTEM_NAMESPACE = "kvtier-system"
NAMESPACE = "kvtier-demo"
# The serving pods' ServiceAccount: the chart lets it create TokenReviews, nothing else.
SERVING_SERVICE_ACCOUNT = "default"
POLICY = "demo"
WORKLOAD = "llm"
APP_LABEL = "kvtier-demo-llm"
INITIAL_REPLICAS = 3
SCALED_REPLICAS = 4
# One home per tenant reads clearest at 3 -> 4 replicas: about a quarter of the tenants
# move, each to exactly one new home (k=3 would make every pod a home of most tenants).
HOMES = 1
TENANTS = 12
TEMPLATES = 3
# Tokens per template prompt: long enough that a hit saves most of a prefill.
TEMPLATE_TOKENS = (96, 192)
DRAM_CAPACITY = "64Mi"
SIDECAR_HTTP_PORT = 8081  # the injected sidecar's default (kvtier.sidecar_config)
# The rollouts: v2 is a good version, v3 a bad one (digests stand for new weights).
GOOD_VERSION = "sha256:" + "2" * 64
BAD_VERSION = "sha256:" + "3" * 64
# The chart's alert rules, with windows that suit a demo of a few minutes: a version
# must stay below 0.8 x the best version's hit rate for 10 s to fire. `for` equals the
# rate window, as in the chart's defaults: a new pod's warm-up prefill misses by design,
# but the sidecar counts it apart (kvtier_warmup_*), so it no longer drags the version's
# windowed hit rate down (before, that burst alone fired the alarm on the good version
# unless `for` outlasted the window).
DEMO_RULES = {"window": "10s", "for": "10s", "minLookupsPerSecond": 0.5, "rolloutStalledAfterSeconds": 600}
# Warm-before-ready on the rollouts (issue #24): each new pod prefills up to this many
# prompt tokens of its tenants' hottest prefixes (within the capacity estimate and the
# deadline) before its readiness gate lets traffic in. Enough for every prefix the
# rollout traffic sends a pod's tenants (~3-6 tenants x ~2.4k tokens, plus templates).
WARMUP_MAX_TOKENS = 32768
WARMUP_TIMEOUT = "60s"
# The new pods' "first minute" of traffic, shortened for a demo of a few minutes (the
# operator's default is 60 s): the chart's operator.extraEnv sets its env variable.
FIRST_MINUTE_S = 20
FIRST_MINUTE_ENV = "KVTIER_OPERATOR_FIRST_MINUTE_S"
# Issue #24's target: a warmed new pod's first-minute hit rate >= 0.8x the old version's.
FIRST_MINUTE_TARGET = 0.8
# Homes per tenant for the rollouts. With one home, the pod a step restarts is the only
# one holding its tenants' hot prefixes, so its warm-up finds them nowhere (only what
# other pods saw of those tenants while it restarted); with two, the other home holds them.
ROLLOUT_HOMES = 2
# Old-version traffic before the first rollout, so each tenant's prompts are hot on both homes.
PRE_ROLLOUT_TRAFFIC_S = 12.0
# The rollout traffic: per tenant, this many prompts (whole blocks + 1 token: 65..129
# tokens), picked with Zipf-like popularity. A cold pod misses each one it has not seen.
TRAFFIC_PROMPTS = 24
TRAFFIC_BLOCKS = (4, 8)
# Rollouts take minutes: each step restarts pods and waits for the alarm to stay quiet.
ROLLOUT_TIMEOUT_S = 300.0
# Generous ceilings for a cold 2-core machine; each step normally takes seconds.
STEP_TIMEOUT_S = 90.0
POLL_S = 0.2


class DemoFailed(RuntimeError):
    """A step of the demo did not happen as it must (the message says which)."""


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float = STEP_TIMEOUT_S) -> Any:
    try:
        return polling.wait_for(what, probe, timeout_s, POLL_S)
    except polling.WaitTimeout as exc:
        raise DemoFailed(str(exc)) from None


@dataclass(slots=True)
class Phase:
    """One replay under one affinity epoch."""

    epoch: int
    members: list[str]
    report: dict[str, Any]
    per_member_requests: dict[str, int] = field(default_factory=dict)


def policy_manifest(oracle: Any, redis_url: str, prometheus_url: str, engine_port: int | None = None,
                    workload_kind: str = "StatefulSet") -> dict[str, Any]:
    """A KVCachePolicy whose model identity is the reference engine's own, so the
    sidecars' key roots are exactly the ones the engine clients compute; rollouts of
    the workload (a StatefulSet, or a Deployment) are gated on the chart's hit-rate
    alarm in Prometheus, and warm each new pod through its engine on `engine_port`
    before it takes traffic."""
    s = oracle.shape
    model = oracle.model
    return {
        "apiVersion": API_VERSION, "kind": "KVCachePolicy",
        "metadata": {"name": POLICY, "namespace": NAMESPACE},
        "spec": {
            "selector": {"matchLabels": {"app": APP_LABEL}},
            "model": {**ModelSpec.identity_wire(ServedModel.model_validate(s)),
                      "shape": {"layers": s["layers"], "kvHeads": s["kv_heads"], "headDim": s["head_dim"],
                                "params": float(model.matmul_params)}},
            "hardware": {"denseTflopsPerGpu": 10},
            "tiers": {"dram": {"capacity": DRAM_CAPACITY}},
            "affinity": {"homes": HOMES},
            "redis": {"url": redis_url},
            "workloadRef": {"kind": workload_kind, "name": WORKLOAD},
            "rollout": {"canaryPods": 1, "steps": [50, 100], "recovery": {
                "source": "alarm", "alarm": {"url": prometheus_url, "api": "prometheus"},
                "window": "2m", "interval": "2s", "count": 3, "minLookups": 20, "inconclusiveLimit": 1000},
                **({"warmup": {"maxTokens": WARMUP_MAX_TOKENS, "timeout": WARMUP_TIMEOUT, "enginePort": engine_port}}
                   if engine_port else {})},
        },
    }


def engine_container(oracle: Any, port: int) -> dict[str, Any]:
    """The serving engine: the reference engine's OpenAI-compatible front
    (`kvtier_testenv.engine_front`), whose prefill goes through the pod's own sidecar;
    the rollout's warm-up calls its `POST /v1/completions` with each tenant's cache_salt."""
    s = oracle.shape
    return {"name": "engine", "image": "example.com/llm-engine:1",
            "command": [sys.executable, "-m", "kvtier_testenv.engine_front", "--port", str(port),
                        "--block-bytes", str(oracle.block_bytes), "--kv-dtype", s["kv_dtype"],
                        "--rope-config-hash", s["rope_config_hash"], "--attn-impl-id", s["attn_impl_id"]],
            "env": [names.field_env(names.POD_IP_ENV, names.POD_IP_FIELD)],
            "readinessProbe": {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 1}}


def statefulset_manifest(replicas: int, version: str, engine: dict[str, Any] | None = None) -> dict[str, Any]:
    labels = {"app": APP_LABEL}
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": WORKLOAD, "namespace": NAMESPACE},
        "spec": {
            "replicas": replicas, "serviceName": WORKLOAD, "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels,
                                      "annotations": {WEIGHTS_VERSION_ANNOTATION: version}}, "spec": {
                "terminationGracePeriodSeconds": 5,
                "serviceAccountName": SERVING_SERVICE_ACCOUNT,
                # Without `engine`, an image the node agent only reports running.
                "containers": [engine or {"name": "engine", "image": "example.com/llm-engine:1"}]}},
        },
    }


def deployment_manifest(replicas: int, version: str, engine: dict[str, Any]) -> dict[str, Any]:
    """The same serving pods as a Deployment: its rollouts run as the operator's
    stable/canary pair, whose new pods serve beside the old ones until they are warm."""
    sts = statefulset_manifest(replicas, version, engine)
    for key in ("serviceName", "podManagementPolicy"):
        del sts["spec"][key]
    return {**sts, "kind": "Deployment"}


class ClusterDemo:
    """The steps of the demo over one embedded cluster; `close()` tears it all down."""

    # The serving workload's kind (the policy's workloadRef; `kubectl scale` names it).
    workload_kind = "StatefulSet"

    # Serving-pod containers the node agent runs as processes: the engine (the
    # reference engine's HTTP front, which the rollout's warm-up calls; the replays'
    # reference-engine clients talk to the sidecars directly; `--engine vllm` runs real
    # vLLM servers).
    engine_containers: tuple[str, ...] = ("engine",)
    # Where the pods run, as the demo's title says it.
    where = "node agent (the operator and sidecars as local processes), reference engines as clients"

    def __init__(self, workdir: Path, log: Callable[[str], None]) -> None:
        self.workdir = workdir
        self.log = log
        self.stack = contextlib.ExitStack()
        self.t0 = time.monotonic()

    # -- set-up --

    def start(self) -> None:
        from kvtier_testenv.workload import make_oracle
        from kvtier_testenv.controlplane import ControlPlane
        from kvtier_testenv.ports import free_port
        from kvtier_testenv.kubectl import Helm, Kubectl
        from kvtier_testenv.nodeagent import NodeAgent
        from kvtier_testenv import control_ca
        from kvtier_testenv.prometheus import (
            Alertmanager, Prometheus, chart_rules, grant_discovery, operator_pod_scrape_config, sidecar_scrape_config,
        )
        from kvtier_testenv.redis_fixtures import RedisServer

        self.oracle = make_oracle("reference")
        self.step("starting kube-apiserver, etcd and kube-controller-manager")
        self.cp = ControlPlane(controller_manager=True, log_dir=self.workdir / "controlplane-logs")
        self.stack.callback(self.cp.stop)
        self.cp.start()
        self.redis = self.stack.enter_context(RedisServer())
        self.kubectl = Kubectl(self.cp.kubeconfig, namespace=NAMESPACE)
        self.kubectl.run("create", "namespace", NAMESPACE)

        self.step("Prometheus (finds pods through the apiserver, loads the chart's alert rules) and Alertmanager")
        self.alertmanager = Alertmanager(self.workdir / "alertmanager").start()
        self.stack.callback(self.alertmanager.stop)
        discovery = grant_discovery(self.cp, Kubectl(self.cp.kubeconfig))
        # The operator's control CA, brought ahead of it as a platform team would: the
        # operator reuses it, Prometheus and the demo verify the sidecars against it.
        self.control_ca_file = control_ca.provision_file(Kubectl(self.cp.kubeconfig), SYSTEM_NAMESPACE,
                                                         self.workdir / "control-ca.crt", f"{RELEASE}-control-ca")
        self.prom = Prometheus(self.workdir / "prometheus").configure(
            [sidecar_scrape_config(discovery, [NAMESPACE], self.control_ca_file),
             operator_pod_scrape_config(discovery, [SYSTEM_NAMESPACE])],
            chart_rules(DEMO_RULES), self.alertmanager.address)
        self.stack.callback(self.prom.stop)
        self.prom.start()

        self.step("helm install kvtier (CRD, RBAC, operator, webhook in URL mode)")
        self.helm = Helm(self.cp.kubeconfig, namespace=SYSTEM_NAMESPACE, home=self.workdir / "helm")
        webhook_port = free_port()
        self.engine_port = free_port()
        values = {
            # The first-minute window shortened for the demo (FIRST_MINUTE_S).
            "operator": {"watchNamespaces": [NAMESPACE], "healthPort": free_port(),
                         "extraEnv": [{"name": FIRST_MINUTE_ENV, "value": str(FIRST_MINUTE_S)}]},
            "webhook": {"url": f"https://127.0.0.1:{webhook_port}/inject-sidecar", "port": webhook_port},
            # The serving pods' sidecars may check the operator's token (TokenReview).
            "controlAuth": {"servingServiceAccounts": [{"namespace": NAMESPACE, "name": SERVING_SERVICE_ACCOUNT}]},
        }
        self.helm.install(RELEASE, CHART, "--create-namespace", values=values)
        # The demo reads sidecar stats as the operator does: with a token of the operator's
        # ServiceAccount minted for each sidecar's own audience (the demo is the cluster admin).
        self.control_tokens: dict[str, str] = {}
        self.stack.callback(self._uninstall)

        self.step("node agent: runs the operator pod and the injected sidecars as local processes")
        self.agent = NodeAgent(self.cp.kubeconfig, namespaces=[SYSTEM_NAMESPACE, NAMESPACE],
                               containers=("operator", "kvtier-sidecar", *self.engine_containers),
                               service_account_tokens=True,
                               workdir=Path(tempfile.mkdtemp(prefix="kvn-")))
        self.stack.callback(self.agent.stop)
        self.agent.start()
        try:
            [op] = self.agent.wait_ready(1, SYSTEM_NAMESPACE, f"app.kubernetes.io/instance={RELEASE}",
                                         timeout_s=STEP_TIMEOUT_S)
        except TimeoutError as exc:
            raise DemoFailed(f"the operator pod never became Ready: {exc}\n{self.operator_log()}") from None
        self.operator_pod = op["metadata"]["name"]

    def operator_log(self, lines: int = 30) -> str:
        """The tail of the operator process's log (for a failure message)."""
        pods = self.kubectl.in_namespace(SYSTEM_NAMESPACE).get_json(
            "pods", "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
        for pod in pods:
            with contextlib.suppress(KeyError, OSError):
                text = self.agent.log(SYSTEM_NAMESPACE, pod["metadata"]["name"], "operator")
                return f"operator log ({pod['metadata']['name']}):\n" + "\n".join(text.splitlines()[-lines:])
        return "(no operator log)"

    def _uninstall(self) -> None:
        with contextlib.suppress(Exception):
            self.helm.run("uninstall", RELEASE, "--wait", "--timeout", "60s")

    def step(self, text: str) -> None:
        self.log(f"[{time.monotonic() - self.t0:6.1f}s] {text}")

    # -- the policy and the serving pods --

    def apply_policy(self) -> None:
        self.step(f"kubectl apply KVCachePolicy {POLICY} (the reference engine's model identity)")
        self.kubectl.apply(policy_manifest(self.oracle, self.redis.url, self.prom.url, self.engine_port))
        wait_for("tier verdicts in the policy's status", lambda: self.status().get("tiers"))

    def status(self) -> dict[str, Any]:
        return self.kubectl.get_json("kvcp", POLICY).get("status") or {}

    def serve(self, replicas: int) -> dict[str, Any]:
        """Scale the StatefulSet; wait until the policy's members and the published
        table both say `replicas`. Returns the status then."""
        if replicas == INITIAL_REPLICAS:
            sts = self.workload_manifest(replicas)
            self.wait_injecting(sts)
            self.step(f"{self.workload_kind} {WORKLOAD} with {replicas} pods; the webhook injects the sidecar")
            self.kubectl.apply(sts)
        else:
            self.step(f"kubectl scale {self.workload_kind.lower()}/{WORKLOAD} --replicas={replicas}")
            self.kubectl.scale(f"{self.workload_kind.lower()}/{WORKLOAD}", replicas)
        pods = self.wait_serving(replicas)
        for pod in pods:
            names = [c["name"] for c in self.sidecar_containers(pod)]
            if "kvtier-sidecar" not in names:
                raise DemoFailed(f"pod {pod['metadata']['name']} was not injected: containers {names}")

        def published() -> dict[str, Any] | None:
            st = self.status()
            table = self.table()
            if st.get("memberCount") == replicas and table and len(table[0].members) == replicas \
                    and table[0].epoch == st.get("epoch"):
                return st
            return None
        return wait_for(f"the operator to publish an epoch with {replicas} members", published)

    def workload_manifest(self, replicas: int) -> dict[str, Any]:
        """The serving StatefulSet the demo creates."""
        return statefulset_manifest(replicas, self.oracle.shape["weights_version"],
                                    engine_container(self.oracle, self.engine_port))

    def wait_injecting(self, sts: dict[str, Any]) -> None:
        """Until the webhook would inject `sts`'s pods (the node agent calls it by URL:
        it serves once the operator process does, which start() waited for)."""

    @staticmethod
    def sidecar_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
        """Where an injected sidecar may be: a native one is an init container
        (restartPolicy Always), else a container."""
        return pod["spec"].get("initContainers", []) + pod["spec"]["containers"]

    def placement(self) -> dict[str, dict[str, Any]]:
        """Pod -> the node kubelet runs it on and its readiness gates ({} on the node
        agent, which is no node)."""
        return {}

    def wait_serving(self, replicas: int) -> list[dict[str, Any]]:
        """The workload's `replicas` pods Running and Ready."""
        return self.agent.wait_ready(replicas, NAMESPACE, f"app={APP_LABEL}", timeout_s=STEP_TIMEOUT_S)

    def table(self):
        from kvtier.affinity import AffinityTable

        try:
            cm = self.kubectl.get_json("configmap", f"{POLICY}-kvtier-affinity")
        except Exception:
            return None
        data = cm.get("data") or {}
        return AffinityTable.from_json(data["table.json"]), json.loads(data.get("addresses.json", "{}"))

    # -- traffic --

    def sockets(self, members: list[str]) -> dict[str, str]:
        """Member pod -> its sidecar's engine socket (inside the pod's kvtier-run volume)."""
        from kvtier.sidecar_config import SidecarConfig

        out = {}
        for name in members:
            proc = self.agent.process(NAMESPACE, name, "kvtier-sidecar")
            out[name] = SidecarConfig(pod_name=name, pod_namespace=NAMESPACE).engine_socket_path(proc.env)
        return out

    def replay(self, requests: list[Any]) -> Phase:
        from kvtier import routing
        from kvtier_testenv.fleet import fleet_report, run_engines
        from kvtier_testenv.workload import ReplayStats

        table, addresses = self.table()
        members = sorted(table.members)
        routed: dict[str, list[Any]] = {m: [] for m in members}
        for req in requests:
            routed[routing.pick(req.tenant, table, {}).member].append(req)
        sockets = self.sockets(members)
        self.step(f"replaying {len(requests)} requests under epoch {table.epoch} "
                  f"({', '.join(f'{m}: {len(r)}' for m, r in routed.items())})")
        t0 = time.monotonic()
        results = run_engines([(sockets[m], reqs) for m, reqs in routed.items() if reqs], "reference",
                              self.oracle.block_size)
        elapsed = time.monotonic() - t0
        total = ReplayStats()
        for r in results:
            total.merge(r)
        stats = [self.sidecar_stats(m, addresses[m]["ip"]) for m in members]
        return Phase(table.epoch, members, fleet_report(total, stats, self.oracle.block_bytes, elapsed),
                     {m: len(r) for m, r in routed.items()})

    def wait_fleet_hit_rate(self) -> float:
        """Wait until the operator's periodic refresh put the members' hit rate (prompt
        tokens their engines loaded over those they looked up) into status, so
        `kubectl get kvcp` shows it."""
        _, addresses = self.table()

        seen: dict[str, Any] = {}

        def shown() -> float | None:
            stats = [self.sidecar_stats(m, a["ip"]) for m, a in addresses.items()]
            expected = engine_io.hit_rate(stats)
            rate = self.status().get("fleetHitRate")
            seen.update(expected=expected, status=rate)
            return (rate,) if expected is not None and rate == expected else None  # 0.0 is shown too
        try:
            return wait_for("the fleet hit rate in the policy's status", shown)[0]
        except DemoFailed as exc:
            raise DemoFailed(f"{exc} (sidecars' hit rate {seen.get('expected')}, status "
                             f"{seen.get('status')})\n{self.operator_log(60)}") from None

    def control_token(self, pod: str) -> str:
        if pod not in self.control_tokens:
            self.control_tokens[pod] = self.kubectl.in_namespace(SYSTEM_NAMESPACE).run(
                "create", "token", f"{RELEASE}-operator", f"--audience={pod_audience(NAMESPACE, pod)}").stdout.strip()
        return self.control_tokens[pod]

    def sidecar_control(self, ip: str):
        """A sidecar's control API as the operator calls it: HTTPS to the pod IP, the
        policy's certificate verified against the operator's CA."""
        from kvtier import control_tls
        from kvtier_testenv.control_client import ControlEndpoint

        return ControlEndpoint(ip, SIDECAR_HTTP_PORT, control_tls.server_name(NAMESPACE, POLICY),
                               self.control_ca_file.read_bytes())

    def sidecar_stats(self, pod: str, ip: str, tenant: str | None = None) -> dict[str, Any]:
        path = control_api.STATS.url(tenant=tenant or None)
        return self.sidecar_control(ip).get_json(path, headers={"Authorization": f"Bearer {self.control_token(pod)}"})

    # -- rollouts --

    def root_of(self, version: str, tenant: str = "demo-tenant"):
        return ServedModel.model_validate({**self.oracle.shape, "weights_version": version}).root(tenant)

    def set_homes(self, homes: int) -> dict[str, Any]:
        """`spec.affinity.homes` patched; waits for the epoch that publishes it."""
        self.step(f"kubectl patch kvcp {POLICY}: spec.affinity.homes = {homes} (each tenant on {homes} pods, "
                  "so a restarting home's tenants stay hot on another)")
        self.kubectl.run("patch", "kvcp", POLICY, "--type=merge", "-p",
                         json.dumps({"spec": {"affinity": {"homes": homes}}}))

        def published() -> dict[str, Any] | None:
            st, table = self.status(), self.table()
            return st if table and table[0].homes == homes and table[0].epoch == st.get("epoch") else None
        return wait_for(f"an epoch with {homes} homes per tenant", published)

    def start_traffic(self, tenants: list[str]):
        """Steady engine traffic: each tenant's requests to its homes among the Ready
        pods, under the version the pod serves; v3's prompts never repeat (a version
        whose prompts share no prefix)."""
        modes = {self.oracle.shape["weights_version"]: "hits", GOOD_VERSION: "hits", BAD_VERSION: "misses"}
        self.traffic = TenantTraffic(self, tenants, modes).start()
        self.stack.callback(self.traffic.stop)

    def wait_first_minutes(self, version: str, steps: int) -> list[dict[str, Any]]:
        """The rollout's per-step first-minute figures (status.rollout.firstMinutes),
        once every step's pods have had their window."""
        def done() -> list[dict[str, Any]] | None:
            r = self.status().get("rollout") or {}
            figs = {f["step"]: f for f in r.get("firstMinutes") or []} if r.get("targetVersion") == version else {}
            return [figs[i] for i in range(1, steps + 1)] if all(i in figs for i in range(1, steps + 1)) else None
        try:
            return polling.wait_for(f"the first-minute figures of {version[:15]}...'s {steps} steps", done,
                                    FIRST_MINUTE_S + STEP_TIMEOUT_S, POLL_S)
        except polling.WaitTimeout as exc:
            raise DemoFailed(f"{exc}: {(self.status().get('rollout') or {}).get('firstMinutes')}\n"
                             f"{self.operator_log()}") from None

    def roll_out(self, version: str, label: str) -> None:
        self.step(f"kubectl patch kvcp {POLICY}: spec.model.weightsVersion = {label}")
        self.kubectl.run("patch", "kvcp", POLICY, "--type=merge", "-p",
                         json.dumps({"spec": {"model": {"weightsVersion": version}}}))

    def wait_rollout(self, version: str, phase: str) -> dict[str, Any]:
        def settled() -> dict[str, Any] | None:
            st = self.status()
            r = st.get("rollout") or {}
            if r.get("targetVersion") == version and st.get("phase") == phase and \
                    (phase != "Ready" or st.get("version") == version):
                return st
            return None
        try:
            return polling.wait_for(f"the rollout of {version[:15]}... to reach {phase}", settled, ROLLOUT_TIMEOUT_S,
                                    POLL_S)
        except polling.WaitTimeout as exc:
            raise DemoFailed(f"{exc}\n{self.operator_log()}") from None

    def fired(self, version: str) -> dict[str, Any] | None:
        """KVTierHitRateDrop for `version` as Prometheus recorded it: when it went off and
        the hit rate it saw (it may have resolved since: the rollback removed the pods)."""
        labels = {"namespace": NAMESPACE, "policy": POLICY, "version": version}
        if not self.prom.fired("KVTierHitRateDrop", labels):
            return None
        since = self.prom.query(f'min_over_time(ALERTS_FOR_STATE{{alertname="KVTierHitRateDrop", '
                                f'version="{version}"}}[15m])')
        rate = self.prom.query(f'min_over_time(kvtier:hit_rate:ratio{{version="{version}"}}[15m])')
        return {"labels": {"alertname": "KVTierHitRateDrop", **labels}, "state": "firing",
                "activeAt": float(since[0]["value"][1]) if since else None,
                "value": float(rate[0]["value"][1]) if rate else None}

    def events(self) -> list[str]:
        items = self.kubectl.get_json("events", "--field-selector", f"involvedObject.name={POLICY}")["items"]
        items.sort(key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
        return [f"{e['type']:<8} {e['reason']:<17} {e['message']}" for e in items
                if e["reason"].startswith(("Rollout", "RolledBack"))]

    def close(self) -> None:
        self.step("tearing down (helm uninstall, pods, control plane, Redis)")
        self.stack.close()


class TenantTraffic:
    """The rollouts' traffic (a `kvtier_testenv.traffic.Traffic` per tenant): round
    after round, each Ready pod gets requests of the tenants it is a home of (the
    published table's homes among the Ready pods; a tenant with no Ready home goes to
    the first Ready pod of its rendezvous order, as the EPP spills), each a prompt of
    the tenant's `TRAFFIC_PROMPTS` picked by Zipf-like popularity, under the pod's
    weights version and the tenant's key root. Every hit is checked against the KV the
    version computes."""

    def __init__(self, demo: ClusterDemo, tenants: list[str], modes: dict[str, str]) -> None:
        import random

        from kvtier_testenv.traffic import Traffic

        self.demo, self.tenants = demo, list(tenants)
        self._base = Traffic(demo.kubectl, demo.agent, f"app={APP_LABEL}", modes, demo.root_of,
                             demo.oracle.block_size, demo.oracle.block_bytes)
        # The same loop, pod list and checks; rounds of tenant requests.
        self._base._round = self._round
        pods = self._base._pods
        self._ready: list[str] = []

        def ready_pods() -> list[tuple[str, str]]:
            out = pods()
            self._ready = [p for p, _ in out]
            return out
        self._base._pods = ready_pods
        self._rng = random.Random(24)
        self._weights = [1.0 / (i + 1) ** 0.8 for i in range(TRAFFIC_PROMPTS)]
        self._prompts: dict[tuple[str, int], Any] = {}
        self._table: tuple[float, Any] = (0.0, None)

    # the Traffic's counters
    lookups = property(lambda self: self._base.lookups)
    hits = property(lambda self: self._base.hits)
    wrong_kv = property(lambda self: self._base.wrong_kv)
    # Requests an engine answered with an error other than a caught wrong hit (the node
    # agent's clients talk to the sidecars directly: they have no such answer).
    failed = 0
    failures: tuple[str, ...] = ()

    def start(self) -> "TenantTraffic":
        self._base.start()
        return self

    def stop(self) -> None:
        self._base.stop()

    def prompt(self, tenant: str, i: int):
        import numpy as np

        key = (tenant, i)
        if key not in self._prompts:
            rng = np.random.default_rng([self.tenants.index(tenant), i, 24])
            blocks = int(rng.integers(TRAFFIC_BLOCKS[0], TRAFFIC_BLOCKS[1] + 1))
            self._prompts[key] = rng.integers(0, self.demo.oracle.vocab, blocks * self.demo.oracle.block_size + 1
                                              ).astype(np.uint32)
        return self._prompts[key]

    def tenants_of(self, pod: str, ready: list[str]) -> list[str]:
        now = time.monotonic()
        if now - self._table[0] > 2.0 or self._table[1] is None:
            self._table = (now, self.demo.table()[0])
        table = self._table[1]
        out = []
        for t in self.tenants:
            homes = [m for m in table.homes_for(t) if m in ready]
            if not homes:
                homes = [m for m in table.order_for(t) if m in ready][:1] or sorted(ready)[:1]
            if pod in homes:
                out.append((t, len(homes)))
        return out

    def _round(self, pod: str, version: str, mode: str) -> None:
        import numpy as np

        from kvtier_sidecar.client import SidecarClient
        from kvtier_testenv.traffic import LOOKUPS_PER_ROUND, engine_socket

        base = self._base
        mine = self.tenants_of(pod, self._ready)
        if not mine:
            return
        # A tenant with two Ready homes sends each half of its requests.
        weights = [1.0 / n for _, n in mine]
        client = SidecarClient(engine_socket(self.demo.agent, NAMESPACE, pod))
        try:
            for _ in range(LOOKUPS_PER_ROUND):
                tenant = self._rng.choices([t for t, _ in mine], weights)[0]
                root = self.demo.root_of(version, tenant)
                if mode == "hits":
                    t = self.prompt(tenant, self._rng.choices(range(TRAFFIC_PROMPTS), self._weights)[0])
                else:
                    t = np.random.default_rng(next(base._fresh)).integers(
                        0, self.demo.oracle.vocab, TRAFFIC_BLOCKS[0] * self.demo.oracle.block_size + 1
                    ).astype(np.uint32)
                base.serve(client, version, root, t, offer=mode == "hits")
        finally:
            client.close()


def moved_tenants(before, after, tenants: list[str]) -> dict[str, tuple[str, str]]:
    """Tenants whose first home changed between two tables: tenant -> (old, new)."""
    out = {}
    for t in tenants:
        old, new = before.homes_for(t)[0], after.homes_for(t)[0]
        if old != new:
            out[t] = (old, new)
    return out


def render_phase(title: str, r: dict[str, Any]) -> list[str]:
    lines = [f"{title} (epoch {r['epoch']}, members {', '.join(r['members'])})",
             f"  requests            {r['requests']}",
             f"  hit rate            {r['hit_rate']:.1%} of requests, {r['token_hit_rate']:.1%} of prompt tokens"]
    for tier, t in r["tiers"].items():
        lines.append(f"    {tier:<17} {t['hit_rate']:.1%} of requests ({t['hits']} hits), "
                     f"{t['token_hit_rate']:.1%} of tokens")
    lines += [f"  bytes from peers    {r['bytes_from_peers']:,}",
              f"  wrong KV            {r['wrong_kv']} (every hit checked against a full recompute)",
              f"  request-path errors {r['errors']}"]
    return lines


def run(requests: int, seed: int, log: Callable[[str], None], demo_class: type["ClusterDemo"] | None = None
        ) -> dict[str, Any]:
    """The demo: everything it measured and checked, as a JSON-able dict. `demo_class`:
    where the pods run (the node agent's `ClusterDemo` by default; `demo_nodes.NodesDemo`
    on real nodes)."""
    from kvtier_testenv.workload import make_workload

    workdir = Path(tempfile.mkdtemp(prefix="kvtier-cluster-demo-"))
    demo = (demo_class or ClusterDemo)(workdir, log)
    finished = False
    try:
        demo.start()
        demo.apply_policy()
        first = demo.serve(INITIAL_REPLICAS)
        work = make_workload(TENANTS, TEMPLATES, 2 * requests, seed=seed, vocab=demo.oracle.vocab,
                             template_tokens=TEMPLATE_TOKENS)
        tenants = sorted({r.tenant for r in work})
        table_before, _ = demo.table()
        phase1 = demo.replay(work[:requests])

        second = demo.serve(SCALED_REPLICAS)
        table_after, addresses = demo.table()
        if table_after.epoch <= table_before.epoch:
            raise DemoFailed(f"scaling to {SCALED_REPLICAS} did not publish a new epoch ({table_after.epoch})")
        moves = moved_tenants(table_before, table_after, tenants)
        held = {m: demo.sidecar_stats(m, addresses[m]["ip"]).get("tenants", {}) for m in {n for _, n in moves.values()}}
        warmed = {t: held[new].get(t, {}).get("warmed_bytes", 0) for t, (_, new) in moves.items()}
        if moves and not any(warmed.values()):
            raise DemoFailed(f"tenants {sorted(moves)} moved but none was warmed on its new home before the epoch")
        phase2 = demo.replay(work[requests:])
        demo.wait_fleet_hit_rate()
        kvcp = demo.kubectl.run("get", "kvcp", "-o", "wide").stdout.rstrip()
        status = demo.status()

        demo.set_homes(ROLLOUT_HOMES)
        demo.start_traffic(tenants)
        demo.step(f"tenant traffic on the old version for {PRE_ROLLOUT_TRAFFIC_S:g} s (each tenant's prompts hot "
                  "on both its homes)")
        time.sleep(PRE_ROLLOUT_TRAFFIC_S)
        demo.roll_out(GOOD_VERSION, "v2")
        good = demo.wait_rollout(GOOD_VERSION, "Ready")
        demo.step(f"waiting for the last step's pods' first {FIRST_MINUTE_S} s of traffic")
        steps = [h for h in good["rollout"]["history"] if h["version"] == GOOD_VERSION
                 and h["outcome"] in ("recovered", "completed")]
        first_minutes = demo.wait_first_minutes(GOOD_VERSION, len(steps))
        demo.step("first-minute figures: " + "; ".join(
            f"step {f['step']} {f.get('hitRate')} vs {f.get('baselineHitRate')}" for f in first_minutes))
        good = demo.status()
        kvcp_good = demo.kubectl.run("get", "kvcp", "-o", "wide").stdout.rstrip()
        demo.roll_out(BAD_VERSION, "v3 (its prompts share no prefix)")
        bad = demo.wait_rollout(BAD_VERSION, "RolledBack")
        alarm = demo.fired(BAD_VERSION)
        if not alarm:
            raise DemoFailed("v3 was rolled back but KVTierHitRateDrop never fired for it in Prometheus")
        demo.wait_serving(SCALED_REPLICAS)
        kvcp_bad = demo.kubectl.run("get", "kvcp", "-o", "wide").stdout.rstrip()
        placement = demo.placement()
        rollout_events = demo.events()
        traffic = {"lookups": dict(demo.traffic.lookups), "hits": dict(demo.traffic.hits),
                   "wrong_kv": demo.traffic.wrong_kv, "failed": demo.traffic.failed,
                   "failures": list(demo.traffic.failures)}
        finished = True
    finally:
        demo.close()
        if finished:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            log(f"the demo's logs are kept in {workdir}")
    phases = {"before": phase1, "after": phase2}
    return {
        "where": demo.where,
        "placement": placement,
        "ok": all(p.report["wrong_kv"] == 0 and p.report["errors"] == 0 for p in phases.values())
        and traffic["wrong_kv"] == 0 and traffic["failed"] == 0,
        "kubectl_get_kvcp": kvcp,
        "rollouts": {
            "good": {"version": GOOD_VERSION, "history": good["rollout"]["history"],
                     "baseline_hit_rate": good["rollout"].get("baselineHitRate"), "kubectl_get_kvcp": kvcp_good,
                     "warmups": [w for w in good["rollout"].get("warmups") or [] if w["version"] == GOOD_VERSION],
                     "first_minutes": first_minutes,
                     "first_minute": first_minute_summary(first_minutes),
                     "warmup_budget": {"maxTokens": WARMUP_MAX_TOKENS, "timeout": WARMUP_TIMEOUT}},
            "bad": {"version": BAD_VERSION, "history": bad["rollout"]["history"], "serving": bad.get("version"),
                    "alert": alarm,
                    "kubectl_get_kvcp": kvcp_bad},
            "events": rollout_events,
            "traffic": traffic,
        },
        "phases": {k: {"epoch": p.epoch, "members": p.members, "requests_per_member": p.per_member_requests,
                       **p.report} for k, p in phases.items()},
        "epochs": [first.get("epoch"), second.get("epoch")],
        "moved_tenants": {t: {"from": old, "to": new, "warmed_bytes": warmed[t]} for t, (old, new) in moves.items()},
        "status": {k: status.get(k) for k in ("phase", "memberCount", "epoch", "movedTenants", "knownTenants",
                                               "fleetHitRate", "tiers")},
    }


def first_minute_summary(figures: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue #24's figure over the good rollout's steps: each step's new pods'
    first-window hit rate over the old version's, and whether every step met the target."""
    ratios = []
    for f in figures:
        rate, base = f.get("hitRate"), f.get("baselineHitRate")
        ratios.append(round(rate / base, 3) if rate is not None and base else None)
    return {"window_s": sorted({f["windowS"] for f in figures}), "target_ratio": FIRST_MINUTE_TARGET,
            "ratios": ratios,
            "met": bool(ratios) and all(r is not None and r >= FIRST_MINUTE_TARGET for r in ratios)}


def render_first_minutes(good: dict[str, Any]) -> list[str]:
    """Per step: the new pods' first-window hit rate vs the old version's, the ratio,
    warm/cold pods, the warm-up's prefill (spent and budgeted)."""
    warm = {w["pod"]: w for w in good["warmups"]}
    where = {"oldPods": "its pods then", "rolloutStart": "at the rollout's start"}
    s = good["first_minute"]
    windows = sorted({f["windowS"] for f in good["first_minutes"]})
    window = "/".join(f"{w:g}" for w in windows)
    shortened = "shortened for the demo to " if windows and max(windows) < 60 else ""
    lines = [f"  first minute ({shortened}each new pod's first {window} s of traffic, after its warm-up; "
             f"target >= {s['target_ratio']}x the old version's hit rate):"]
    for f, ratio in zip(good["first_minutes"], s["ratios"]):
        ws = [warm[p] for p in f.get("podNames") or [] if p in warm]
        spent, budget = sum(w.get("tokens", 0) for w in ws), sum(w.get("budgetTokens", 0) for w in ws)
        rate = "n/a" if f.get("hitRate") is None else f"{f['hitRate']:.3f}"
        base = "n/a" if f.get("baselineHitRate") is None else f"{f['baselineHitRate']:.3f}"
        lines.append(f"    step {f['step']}: {f['pods']} new pods ({f['warmPods']} warm, {f['coldPods']} cold) "
                     f"hit {rate} of prompt tokens vs v1's {base} ({where.get(f.get('baselineSource'), '?')}) -> "
                     f"{'n/a' if ratio is None else f'{ratio:.2f}x'} over {f['lookups']} lookups; warm-up "
                     f"prefilled {spent:,} of {budget:,} budgeted tokens "
                     f"({sum(w.get('prompts', 0) for w in ws)} prompts, {sum(w.get('tenants', 0) for w in ws)} "
                     f"tenant warm-ups)")
    lines.append(f"  target >= {s['target_ratio']}x the old version: " + (
        "met at every step" if s["met"] else f"NOT met at every step (ratios {s['ratios']})"))
    return lines


def short(text: str) -> str:
    """Weights digests cut to their first 8 hex digits, so messages fit a terminal line."""
    return re.sub(r"sha256:([0-9a-f]{8})[0-9a-f]{56}", r"sha256:\1..", text)


def render(result: dict[str, Any]) -> str:
    lines = [f"kvtier cluster demo: helm-installed operator, {INITIAL_REPLICAS} -> {SCALED_REPLICAS} serving pods, "
             f"injected sidecars; {result['where']}", "", "$ kubectl get kvcp -o wide",
             result["kubectl_get_kvcp"], ""]
    for title, key in (("before scaling", "before"), ("after scaling", "after")):
        lines += render_phase(title, result["phases"][key]) + [""]
    status = result["status"]
    lines.append(f"affinity epoch      {result['epochs'][0]} -> {result['epochs'][1]} "
                 f"(status.movedTenants {status['movedTenants']}, knownTenants {status['knownTenants']})")
    for t, m in sorted(result["moved_tenants"].items()):
        lines.append(f"  moved {t:<10} {m['from']} -> {m['to']}: {m['warmed_bytes']:,} bytes warmed "
                     f"on {m['to']} before the epoch was published")
    if not result["moved_tenants"]:
        lines.append("  no tenant's first home changed")
    lines.append("tier verdicts       " + ", ".join(f"{v['tier']} {v['verdict']}" for v in status["tiers"] or []))
    r = result["rollouts"]
    lines += ["", f"rollout of v2 ({GOOD_VERSION[:15]}...), gated on KVTierHitRateDrop in Prometheus:"]
    lines += [f"  step {h['step']} {h['outcome']:<10} hit rate {h.get('hitRate')}" for h in r["good"]["history"]
              if h["version"] == GOOD_VERSION]
    lines += render_first_minutes(r["good"])
    lines += ["$ kubectl get kvcp -o wide", r["good"]["kubectl_get_kvcp"], "",
              f"rollout of v3 ({BAD_VERSION[:15]}...), whose prompts share no prefix:",
              f"  alert {r['bad']['alert']['labels']['alertname']} fired in Prometheus (active since unix time "
              f"{r['bad']['alert']['activeAt']}; v3's hit rate as low as {r['bad']['alert']['value']})"]
    lines += [f"  step {h['step']} {h['outcome']:<10} {short(h.get('message', ''))}" for h in r["bad"]["history"]
              if h["version"] == BAD_VERSION]
    lines += ["$ kubectl get kvcp -o wide", r["bad"]["kubectl_get_kvcp"], "", "$ kubectl get events (rollouts)"]
    lines += [f"  {short(e)}" for e in r["events"]]
    lines.append(f"rollout traffic     {sum(r['traffic']['lookups'].values())} lookups, "
                 f"{sum(r['traffic']['hits'].values())} hits checked, wrong KV {r['traffic']['wrong_kv']}, "
                 f"failed answers {r['traffic']['failed']}")
    samples = result["phases"]["before"]["error_samples"] + result["phases"]["after"]["error_samples"]
    if samples:
        lines.append(f"errors (samples)    {samples[:3]}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """`--mode cluster` of the checkout's demo (registered in kvtier_testenv.demo.MODES)."""
    t0 = time.perf_counter()
    log = (lambda s: None) if args.quiet or args.json else (lambda s: print(s, file=sys.stderr, flush=True))
    demo_class = None
    if getattr(args, "nodes", "real") == "real":
        # kubelet, containerd, the project's images
        from kvtier_testenv.demo_nodes import DeploymentNodesDemo, NodesDemo

        demo_class = DeploymentNodesDemo if getattr(args, "workload", "statefulset") == "deployment" else NodesDemo
    try:
        result = run(requests=args.requests * 4, seed=args.seed, log=log, demo_class=demo_class)
    except (DemoFailed, TimeoutError) as exc:
        print(f"demo --mode cluster: FAILED: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"mode": "cluster", **result, "wall_s": time.perf_counter() - t0}, indent=2))
    else:
        print(render(result))
        print(f"\n(done in {time.perf_counter() - t0:.1f} s)")
    return 0 if result["ok"] else 1
