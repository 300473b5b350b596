"""The cluster demo on real nodes (`./scripts/demo.sh`, `--mode cluster`, the default): the
same story as `demo_cluster` — a scale-up whose moved tenants are warmed before the new
epoch, a good rollout whose new pods are warmed before they are Ready, a bad one that
Prometheus' alarm rolls back — with every pod run by a real kubelet:

    kube-apiserver + etcd + controller-manager + scheduler, two nodes (kubelet,
    containerd + runc, bridge CNI), kube-proxy, CoreDNS (`kvtier_testenv.nodes`)
      + `helm install charts/kvtier` with its default image, built from the Dockerfile
        (`hack/image.sh`) and imported into each node's containerd: the operator runs as
        the chart's Deployment pod, the API server calls the webhook through its Service
      + Redis and Prometheus on the host, on node 0's bridge address: the policy names
        Redis by a Service the cluster DNS resolves; Prometheus finds the real pods
        through the API server and scrapes their sidecars over TLS
      -> a StatefulSet in a namespace enforcing PodSecurity `restricted`, whose pods run
         the reference engine's image (its OpenAI-compatible front, `engine_front`) next
         to the injected native sidecar: the engine's prefill looks its prompt up in the
         sidecar, loads the hit, checks it byte for byte against a recompute (a mismatch
         is answered 500 and never used) and stores what it computed
      -> traffic enters from outside the pods: the demo, on the host, sends each
         tenant's completions to the pod the published affinity table picks for it
         (`kvtier.routing.pick`), with the tenant as `cache_salt`.

Every packet for the cluster's ranges stays on this machine: the node cluster's guard
rule drops anything that would leave by another interface, and the demo fails if its
counters are not 0 at the end. Everything is torn down at the end, including on failure.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvtier_testenv import demo_cluster as dc
from kvtier_testenv.nodes import RESTRICTED, RESTRICTED_POD, redis_service
from kvtier_testenv.demo_cluster import (
    APP_LABEL, CHART, FIRST_MINUTE_ENV, FIRST_MINUTE_S, NAMESPACE, RELEASE, SERVING_SERVICE_ACCOUNT, STEP_TIMEOUT_S,
    SYSTEM_NAMESPACE, TRAFFIC_BLOCKS, TRAFFIC_PROMPTS, DemoFailed, wait_for,
)

# The engine front's port in the pods (the rollout's warm-up calls it there).
ENGINE_PORT = 8000
COMPLETIONS = "/v1/completions"
# Pods of the reference engine's image start in seconds; a cold node (first use of the
# image's layers) on a busy 2-core machine takes longer.
POD_READY_TIMEOUT_S = 240.0
# One completion's ceiling (a pod's engine answers in milliseconds; a restarting one refuses).
REQUEST_TIMEOUT_S = 30.0


class Answer:
    """One completion's outcome as the engine front answered it."""

    __slots__ = ("status", "prompt_tokens", "cached_tokens", "tier", "error")

    def __init__(self, status: int, body: dict[str, Any], error: str = "") -> None:
        self.status, self.error = status, error
        usage = body.get("usage") or {}
        self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        self.cached_tokens = int(usage.get("cached_tokens") or 0)
        self.tier = (body.get("kvtier") or {}).get("tier")
        if status != 200 and not error:
            self.error = str((body.get("error") or {}).get("message") or body)[:200]

    @property
    def wrong_kv(self) -> bool:
        """The engine caught a hit whose bytes were not the prefill (engine_front's 500)."""
        return self.status == 500 and "differ from their prefill" in self.error


def complete(ip: str, model: str, tokens, tenant: str) -> Answer:
    """POST one completion (token ids, the tenant as cache_salt) to a pod's engine front."""
    body = {"model": model, "prompt": [int(t) for t in tokens], "max_tokens": 1, "cache_salt": tenant}
    req = urllib.request.Request(f"http://{ip}:{ENGINE_PORT}{COMPLETIONS}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
            return Answer(resp.status, json.loads(resp.read()))
    except urllib.error.HTTPError as e:
        try:
            answer = json.loads(e.read() or b"{}")
        except ValueError:
            answer = {}
        return Answer(e.code, answer)
    except OSError as e:  # refused or reset: the pod is going away
        return Answer(0, {}, error=f"{type(e).__name__}: {e}")


class NodesDemo(dc.ClusterDemo):
    """`ClusterDemo`'s steps with the pods on real nodes (see the module doc)."""

    where = ("two real nodes (kubelet, containerd), the project's images, "
             "traffic from the host to the engines in the pods")
    # The serving namespace's PodSecurity level (enforced by the real apiserver).
    pod_security = "restricted"

    def start(self) -> None:
        from kvtier_testenv import control_ca
        from kvtier_testenv.kubectl import Helm, Kubectl
        from kvtier_testenv.nodes import NODE_IP, NodeCluster
        from kvtier_testenv.prometheus import (
            Alertmanager, Prometheus, chart_rules, grant_discovery, operator_pod_scrape_config, sidecar_scrape_config,
        )
        from kvtier_testenv.redis_fixtures import RedisServer
        from kvtier_testenv.workload import make_oracle

        self.oracle = make_oracle("reference")
        self.engine_port = ENGINE_PORT
        self.agent = None  # kubelet runs the pods
        self.step("starting two real nodes: kube-apiserver, etcd, controller-manager, scheduler, kubelet + "
                  "containerd x2, kube-proxy, CoreDNS; the project's images imported into each containerd")
        self.cluster = NodeCluster(log_dir=self.workdir / "node-logs")
        self.stack.callback(self._stop_cluster)
        self.cluster.start()
        admin = Kubectl(self.cluster.kubeconfig)
        self.kubectl = Kubectl(self.cluster.kubeconfig, namespace=NAMESPACE)
        admin.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE, "labels": {
            "pod-security.kubernetes.io/enforce": self.pod_security,
            "pod-security.kubernetes.io/enforce-version": "latest"}}})

        self.step(f"Redis on the host ({NODE_IP}), named in the cluster by a Service")
        self.redis = RedisServer(host=NODE_IP).start()
        self.stack.callback(self.redis.stop)
        self.redis_url = redis_service(self.kubectl, NAMESPACE, self.redis.port)

        self.step("Prometheus (finds the real pods through the apiserver, loads the chart's alert rules) "
                  "and Alertmanager")
        self.alertmanager = Alertmanager(self.workdir / "alertmanager").start()
        self.stack.callback(self.alertmanager.stop)
        discovery = grant_discovery(self.cluster.control_plane, admin)
        self.control_ca_file = control_ca.provision_file(admin, SYSTEM_NAMESPACE, self.workdir / "control-ca.crt",
                                                         f"{RELEASE}-control-ca")
        self.prom = Prometheus(self.workdir / "prometheus", host=NODE_IP).configure(
            [sidecar_scrape_config(discovery, [NAMESPACE], self.control_ca_file),
             operator_pod_scrape_config(discovery, [SYSTEM_NAMESPACE])],
            chart_rules(dc.DEMO_RULES), self.alertmanager.address)
        self.stack.callback(self.prom.stop)
        self.prom.start()

        self.step("helm install kvtier with its default images (operator Deployment, webhook Service, "
                  "native sidecars)")
        self.helm = Helm(self.cluster.kubeconfig, namespace=SYSTEM_NAMESPACE, home=self.workdir / "helm")
        self.helm.install(RELEASE, CHART, "--create-namespace", values={
            # Every image is on the nodes already: nothing is pulled (no registry is reachable).
            "image": {"pullPolicy": "Never"},
            "sidecar": {"native": "auto", "image": {"pullPolicy": "Never"}},
            # The first-minute window shortened for the demo (FIRST_MINUTE_S).
            "operator": {"watchNamespaces": [NAMESPACE],
                         "extraEnv": [{"name": FIRST_MINUTE_ENV, "value": str(FIRST_MINUTE_S)}]},
            "controlAuth": {"servingServiceAccounts": [{"namespace": NAMESPACE, "name": SERVING_SERVICE_ACCOUNT}]},
        })
        self.control_tokens: dict[str, str] = {}
        self.stack.callback(self._uninstall)
        [op] = self._wait_pods(SYSTEM_NAMESPACE, f"app.kubernetes.io/instance={RELEASE}", 1)
        self.operator_pod = op["metadata"]["name"]
        self.step(f"operator pod {self.operator_pod} Ready on {op['spec']['nodeName']}")

    def _stop_cluster(self) -> None:
        drops = self.cluster.guard_drops()
        self.cluster.stop()
        if any(drops.values()):
            raise DemoFailed(f"the network rule dropped packets for the cluster's ranges: {drops}")

    def operator_log(self, lines: int = 30) -> str:
        """A failure's context (every wait of the demo names it): the pods' story, then the
        operator pod's last log lines."""
        out = self.kubectl.in_namespace(SYSTEM_NAMESPACE).run(
            "logs", "-l", f"app.kubernetes.io/instance={RELEASE}", f"--tail={min(lines, 15)}", check=False)
        return f"{self.story()}\noperator log:\n{out.stdout}{out.stderr}"

    def story(self) -> str:
        """A failure's context: the demo namespace's pods, each restarted container's last
        termination and its previous run's last log lines, the namespace's warnings."""
        lines = []
        pods = self.kubectl.get_json("pods")["items"]
        for p in pods:
            name, st = p["metadata"]["name"], p["status"]
            lines.append(f"pod {name} on {p['spec'].get('nodeName')}: {st.get('phase')}, "
                         f"{[(c['type'], c['status']) for c in st.get('conditions', [])]}")
            for c in st.get("initContainerStatuses", []) + st.get("containerStatuses", []):
                last = (c.get("lastState") or {}).get("terminated")
                if c.get("restartCount") or last:
                    lines.append(f"  {c['name']}: {c.get('restartCount')} restarts, last {last}")
                    out = self.kubectl.run("logs", name, "-c", c["name"], "--previous", "--tail=15", check=False)
                    lines += [f"    | {line}" for line in (out.stdout + out.stderr).splitlines()]
        events = self.kubectl.run("get", "events", "--field-selector", "type=Warning", check=False)
        return "\n".join(lines) + f"\n{events.stdout}{events.stderr}"

    def _wait_pods(self, namespace: str, selector: str, count: int, timeout_s: float = POD_READY_TIMEOUT_S,
                   crash_loop: str | None = None) -> list[dict[str, Any]]:
        """`count` pods of `selector` Running and Ready. With `crash_loop` (a container
        name), that container restarting twice fails at once, not at the deadline."""
        kubectl = self.kubectl.in_namespace(namespace)

        def ready() -> list[dict[str, Any]] | None:
            pods = [p for p in kubectl.get_json("pods", "-l", selector)["items"]
                    if not p["metadata"].get("deletionTimestamp")]
            for p in pods if crash_loop else ():
                if any(c["name"] == crash_loop and c["restartCount"] >= 2
                       for c in p["status"].get("containerStatuses", [])):
                    raise DemoFailed(f"{crash_loop} of {p['metadata']['name']} crash-loops\n{self.story()}")
            ok = [p for p in pods if p["status"].get("phase") == "Running" and any(
                c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]
            return ok if len(ok) == count == len(pods) else None
        try:
            return wait_for(f"{count} pod(s) {selector} Ready in {namespace}", ready, timeout_s)
        except DemoFailed as exc:
            raise DemoFailed(f"{exc}\n{self.operator_log()}") from None

    def apply_policy(self) -> None:
        self.step(f"kubectl apply KVCachePolicy {dc.POLICY} (the reference engine's model identity)")
        self.kubectl.apply(dc.policy_manifest(self.oracle, self.redis_url, self.prom.url, self.engine_port,
                                              self.workload_kind))
        wait_for("tier verdicts in the policy's status", lambda: self.status().get("tiers"))

    def engine_container(self) -> dict[str, Any]:
        """The reference engine's image: its entrypoint is the engine front; its key root is
        the oracle's model identity (the policy's), its weights version the pod's."""
        from kvtier_testenv.nodes import ENGINE_REPOSITORY

        [image] = [ref for ref in self.cluster.images() if ref.startswith(ENGINE_REPOSITORY + ":")]
        engine = dc.engine_container(self.oracle, self.engine_port)
        args = engine.pop("command")
        engine.update({
            "image": image, "imagePullPolicy": "Never", "args": args[args.index("--port"):],
            "ports": [{"name": "http", "containerPort": self.engine_port}],
            "securityContext": RESTRICTED,
            "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}})
        return engine

    def workload_manifest(self, replicas: int) -> dict[str, Any]:
        sts = dc.statefulset_manifest(replicas, self.oracle.shape["weights_version"], self.engine_container())
        sts["spec"]["template"]["spec"]["securityContext"] = RESTRICTED_POD
        return sts

    def project_image(self) -> str:
        """The chart's default image, as the operator pod runs it (the serving pods'
        sidecar image too)."""
        pod = self.kubectl.in_namespace(SYSTEM_NAMESPACE).get_json("pod", self.operator_pod)
        return pod["spec"]["containers"][0]["image"]

    def wait_injecting(self, sts: dict[str, Any]) -> None:
        """Until the webhook, called through its Service, injects the workload's pods
        (`nodes.wait_webhook_injects`: otherwise a pod created too early would start
        without the sidecar, its engine finding none to serve through)."""
        from kvtier_testenv.nodes import wait_webhook_injects
        from kvtier_testenv.polling import WaitTimeout

        try:
            wait_webhook_injects(self.kubectl, NAMESPACE, sts, STEP_TIMEOUT_S)
        except WaitTimeout as exc:
            raise DemoFailed(f"{exc}\n{self.operator_log()}") from None

    @staticmethod
    def sidecar_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
        """On this 1.33 API server the sidecar must be a native one: an init container."""
        return pod["spec"].get("initContainers", [])

    def wait_serving(self, replicas: int) -> list[dict[str, Any]]:
        pods = self._wait_pods(NAMESPACE, f"app={APP_LABEL}", replicas)
        nodes = Counter(p["spec"]["nodeName"] for p in pods)
        self.step(f"{replicas} pods Ready on {len(nodes)} node(s): "
                  + ", ".join(f"{n} {c}" for n, c in sorted(nodes.items())))
        return pods

    def placement(self) -> dict[str, dict[str, Any]]:
        pods = self.kubectl.get_json("pods", "-l", f"app={APP_LABEL}")["items"] + self.kubectl.in_namespace(
            SYSTEM_NAMESPACE).get_json("pods", "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
        return {f"{p['metadata']['namespace']}/{p['metadata']['name']}": {
            "node": p["spec"].get("nodeName", ""),
            "readinessGates": [g["conditionType"] for g in p["spec"].get("readinessGates", [])]}
            for p in pods if not p["metadata"].get("deletionTimestamp")}  # those still running, not going

    def pod_ips(self) -> dict[str, str]:
        return {p["metadata"]["name"]: p["status"]["podIP"]
                for p in self.kubectl.get_json("pods", "-l", f"app={APP_LABEL}")["items"]
                if p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")}

    @property
    def model(self) -> str:
        return self.oracle.shape["model_id"]

    def replay(self, requests: list[Any]) -> dc.Phase:
        import time

        from kvtier import routing
        from kvtier_testenv.workload import ReplayStats

        table, addresses = self.table()
        members = sorted(table.members)
        routed: dict[str, list[Any]] = {m: [] for m in members}
        for req in requests:
            routed[routing.pick(req.tenant, table, {}).member].append(req)
        ips = self.pod_ips()
        self.step(f"replaying {len(requests)} requests under epoch {table.epoch} from the host to the engines "
                  f"in the pods ({', '.join(f'{m}: {len(r)}' for m, r in routed.items())})")

        def send(member: str) -> ReplayStats:
            st = ReplayStats()
            for req in routed[member]:
                a = complete(ips[member], self.model, req.tokens, req.tenant)
                st.requests += 1
                st.prompt_tokens += len(req.tokens)
                if a.status == 200:
                    if a.cached_tokens:
                        tier = a.tier or "dram"
                        st.hits[tier] = st.hits.get(tier, 0) + 1
                        st.hit_tokens[tier] = st.hit_tokens.get(tier, 0) + a.cached_tokens
                        st.bytes_materialized += a.cached_tokens // self.oracle.block_size * self.oracle.block_bytes
                    else:
                        st.stores += 1
                elif a.wrong_kv:
                    st.wrong_kv += 1
                else:
                    st.errors += 1
                    if len(st.error_samples) < 3:
                        st.error_samples.append(f"{member}: {a.status} {a.error}")
            return st
        t0 = time.monotonic()
        with ThreadPoolExecutor(len(members)) as pool:
            results = list(pool.map(send, members))
        elapsed = time.monotonic() - t0
        total = ReplayStats()
        for r in results:
            total.merge(r)
        from kvtier_testenv.fleet import fleet_report

        stats = [self.sidecar_stats(m, addresses[m]["ip"]) for m in members]
        return dc.Phase(table.epoch, members, fleet_report(total, stats, self.oracle.block_bytes, elapsed),
                        {m: len(r) for m, r in routed.items()})

    def start_traffic(self, tenants: list[str]):
        modes = {self.oracle.shape["weights_version"]: "hits", dc.GOOD_VERSION: "hits", dc.BAD_VERSION: "misses"}
        self.traffic = FrontTenantTraffic(self, tenants, modes).start()
        self.stack.callback(self.traffic.stop)


class FrontTenantTraffic(dc.TenantTraffic):
    """`TenantTraffic` sent as completions from the host to each Ready pod's engine front
    (the engine checks every hit; a 500 is a wrong hit it caught, counted as wrong KV)."""

    def __init__(self, demo: NodesDemo, tenants: list[str], modes: dict[str, str]) -> None:
        super().__init__(demo, tenants, modes)
        self._ips: dict[str, str] = {}
        self.unreachable = 0  # refused or reset: a pod going away under the rollout
        self.failed = 0  # answered with an error other than a caught wrong hit
        self.failures: list[str] = []
        listed = self._base._pods

        def pods() -> list[tuple[str, str]]:
            self._ips = demo.pod_ips()
            return listed()
        self._base._pods = pods

    def _round(self, pod: str, version: str, mode: str) -> None:
        from kvtier_testenv.traffic import LOOKUPS_PER_ROUND

        base, demo = self._base, self.demo
        mine = self.tenants_of(pod, self._ready)
        ip = self._ips.get(pod)
        if not mine or ip is None:
            return
        weights = [1.0 / n for _, n in mine]
        for _ in range(LOOKUPS_PER_ROUND):
            tenant = self._rng.choices([t for t, _ in mine], weights)[0]
            if mode == "hits":
                t = self.prompt(tenant, self._rng.choices(range(TRAFFIC_PROMPTS), self._weights)[0])
            else:
                t = np.random.default_rng(next(base._fresh)).integers(
                    0, demo.oracle.vocab, TRAFFIC_BLOCKS[0] * demo.oracle.block_size + 1).astype(np.uint32)
            a = complete(ip, demo.model, t, tenant)
            if a.status == 0:
                self.unreachable += 1  # the pod went away under the rollout
                return
            base.lookups[version] = base.lookups.get(version, 0) + 1
            if a.wrong_kv:
                base.wrong_kv += 1
            elif a.status == 200 and a.cached_tokens:
                base.hits[version] = base.hits.get(version, 0) + 1
            elif a.status != 200:
                self.failed += 1
                if len(self.failures) < 3:
                    self.failures.append(f"{pod}: {a.status} {a.error}")


class DeploymentNodesDemo(NodesDemo):
    """The same demo with the serving pods as a Deployment (`--workload deployment`): the
    scale-up scales the Deployment, and each rollout runs as the operator's stable/canary
    pair (a second Deployment, `llm-kvtier-canary`, on the new version), whose new pods
    serve only once warm while the old ones still do; the pair hands back to the stable
    Deployment when the rollout completes, and the canary goes on a rollback."""

    workload_kind = "Deployment"
    where = NodesDemo.where + "; the serving pods a Deployment"

    def workload_manifest(self, replicas: int) -> dict[str, Any]:
        dep = dc.deployment_manifest(replicas, self.oracle.shape["weights_version"], self.engine_container())
        dep["spec"]["template"]["spec"]["securityContext"] = RESTRICTED_POD
        return dep
