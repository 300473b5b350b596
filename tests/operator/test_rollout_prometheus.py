"""Rollouts gated on a real Prometheus and Alertmanager: the real apiserver and
controller-manager move the StatefulSet's pods, the node agent runs their real injected
sidecars, steady engine traffic flows through them (kvtier_testenv.traffic), and
Prometheus discovers the sidecars through the apiserver, scrapes them every second and
evaluates the chart's own alert rules (rendered by `helm template`).

- prometheus source: the templated hit-rate query advances every step and completes;
  while the canary waits, every panel of the chart's Grafana dashboard returns series;
- alarm source: a version whose traffic never hits fires KVTierHitRateDrop in
  Prometheus, Alertmanager carries it, and the operator rolls the version back;
- Prometheus SIGKILLed mid-step: the rollout pauses (inconclusive), never rolls back,
  and resumes by itself once Prometheus is back.
"""
from __future__ import annotations

import json
import re

import pytest

from kvtier_operator import names
from kvtier_testenv.kubectl import Kubectl
from kvtier_testenv.prometheus import CHART, wait_for_series
from kvtier_testenv.ports import free_port
from operator_harness import RunningOperator, events, operator_options, register_webhook, wait_for
from kvtier_testenv.traffic import Traffic
from sidecar_fleet import BLOCK_BYTES, BLOCK_SIZE, DIGEST as OLD, tiny_policy
from test_operator_e2e import short_workdir, status_of
from test_rollout_e2e import APP, NEW, REPLICAS, ROLLOUT_TIMEOUT_S, Workload, root, stateful_set

MIN_LOOKUPS = 20
# Generous for a 2-core CI box: each step includes its pods' restarts.
RECOVER_WINDOW = "120s"
DASHBOARD = CHART / "dashboards" / "kvtier.json"
# Grafana's variables as the dashboard test substitutes them (a rate window of a few
# scrapes at the test's 1 s scrape interval).
GRAFANA_VARS = {"$__rate_interval": "10s"}


@pytest.fixture
def metrics_port() -> int:
    return free_port()


@pytest.fixture
def operator(namespace, operator_kubeconfig, control_plane, tmp_path, monkeypatch, metrics_port):
    admin = Kubectl(control_plane.kubeconfig)
    port = free_port()
    options = operator_options(tmp_path, port, metrics_host="127.0.0.1", metrics_port=metrics_port)
    hook = register_webhook(admin, namespace, open(options.webhook_cert, "rb").read(), port)
    op = RunningOperator(namespace, operator_kubeconfig, options, monkeypatch).start()
    yield op
    if op.runner is not None:
        op.stop()
    admin.delete("mutatingwebhookconfiguration", hook)


def policy(recovery: dict, redis_url: str | None = None) -> dict:
    extra = {"redis": {"url": redis_url}} if redis_url else {}
    return tiny_policy("llm", APP, workloadRef={"kind": "StatefulSet", "name": APP}, rollout={
        "canaryPods": 1, "steps": [50, 100], "recovery": {"threshold": 0.5, "minLookups": MIN_LOOKUPS, **recovery}},
        **extra)


def start(kubectl: Kubectl, agent, body: dict, prom) -> tuple[Workload, Traffic]:
    """The old fleet ready and serving hits, its sidecars discovered and scraped."""
    kubectl.apply(body)
    wait_for("sidecar ConfigMap", lambda: kubectl.run(
        "get", "configmap", names.sidecar_config_map("llm"), check=False).returncode == 0)
    kubectl.apply(stateful_set(OLD))
    w = Workload(kubectl, agent)
    w.on(set())
    traffic = Traffic(kubectl, agent, f"app={APP}", {OLD: "hits"}, root, BLOCK_SIZE, BLOCK_BYTES).start()
    wait_for("every sidecar discovered and scraped, labelled with its policy",
             lambda: len([t for t in prom.up_targets("kvtier-sidecars").values()
                          if t.get("policy") == "llm" and t.get("namespace") == kubectl.namespace]) == REPLICAS,
             timeout_s=60)
    wait_for("the policy at rest on the old version",
             lambda: (s := status_of(kubectl, "llm")).get("version") == OLD and s.get("phase") == "Ready")
    return w, traffic


def roll_out(kubectl: Kubectl) -> None:
    kubectl.run("patch", "kvcp", "llm", "--type=merge", "-p",
                json.dumps({"spec": {"model": {"weightsVersion": NEW}}}))


def rollout_status(kubectl: Kubectl) -> dict:
    return status_of(kubectl, "llm").get("rollout") or {}


def dashboard_queries(namespace: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, variables substituted."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$namespace", namespace).replace("$policy", "llm")
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            out.append((panel["title"], expr))
    return out


def test_prometheus_gated_rollout_completes_and_every_dashboard_panel_has_data(
        operator, kubectl, node_agent_factory, prometheus_factory, metrics_port, redis_url):
    prom = prometheus_factory(operator_targets=[f"127.0.0.1:{metrics_port}"])
    body = policy({"source": "prometheus", "prometheus": {"url": prom.url}, "window": RECOVER_WINDOW,
                   "interval": "1s", "count": 2, "analysisWindow": "10s", "inconclusiveLimit": 1000},
                  redis_url=redis_url)
    w, traffic = start(kubectl, node_agent_factory(workdir=short_workdir()), body, prom)
    try:
        wait_for_series(prom, f'kvtier:hit_rate:ratio{{namespace="{kubectl.namespace}", version="{OLD}"}}')
        roll_out(kubectl)
        w.on({"llm-3"})
        started = wait_for("rollout step 1", lambda: (r := rollout_status(kubectl)).get("step") == 1 and r)
        assert started["baselineHitRate"] is not None and started["baselineHitRate"] > 0.5
        # The canary gets no traffic yet: no data is inconclusive (limit 1000), the step waits.
        wait_for("an inconclusive measurement",
                 lambda: (rollout_status(kubectl).get("analysis") or {}).get("lastResult") == "inconclusive")
        assert status_of(kubectl, "llm")["phase"] == "RollingOut"
        wait_for_series(prom, f'kvtier_rollout_step{{namespace="{kubectl.namespace}", policy="llm"}}')

        # Every dashboard panel's query returns series from the real fleet and operator.
        traffic.set(NEW, "hits")
        for title, expr in dashboard_queries(kubectl.namespace):
            wait_for(f"series for panel {title!r}: {expr}", lambda: prom.query(expr), timeout_s=60, interval_s=0.5)

        # The canary's hit rate recovers in Prometheus' eyes -> step 2 -> step 3 -> done.
        done = wait_for("rollout completed", lambda: (s := status_of(kubectl, "llm")).get("version") == NEW and s,
                        timeout_s=ROLLOUT_TIMEOUT_S * 2)
    finally:
        traffic.stop()
    assert traffic.wrong_kv == 0 and traffic.hits.get(NEW, 0) > 0
    assert done["phase"] == "Ready"
    history = done["rollout"]["history"]
    assert [(h["step"], h["outcome"]) for h in history] == [(1, "recovered"), (2, "recovered"), (3, "completed")]
    assert all(h["hitRate"] >= 0.5 * done["rollout"]["baselineHitRate"] for h in history)
    # Each step passed on >= count (2) successful measurements (the last one may collect
    # more while its pods become ready).
    assert all(int(re.search(r"(\d+)/2 successful measurements", h["message"]).group(1)) >= 2 for h in history)
    [step1, step2] = sorted(events(kubectl, "llm", "RolloutStep"), key=lambda e: e["firstTimestamp"])
    assert f"prometheus {prom.url}" in step1["message"] and "step 1 recovered" in step1["message"]
    sts = w.sts()
    assert sts["spec"]["updateStrategy"]["rollingUpdate"]["partition"] == 0
    assert sts["spec"]["template"]["metadata"]["annotations"][names.WEIGHTS_VERSION_ANNOTATION] == NEW
    # Finished rollouts leave no rollout series behind.
    wait_for("rollout series gone", lambda: not prom.query(
        f'kvtier_rollout_step{{namespace="{kubectl.namespace}", policy="llm"}}'), timeout_s=30)


def test_alarm_firing_for_the_new_version_rolls_it_back(
        operator, kubectl, node_agent_factory, prometheus_factory, alertmanager):
    prom = prometheus_factory()
    body = policy({"source": "alarm", "alarm": {"url": alertmanager.url, "api": "alertmanager"},
                   "window": RECOVER_WINDOW, "interval": "1s", "count": 1000, "inconclusiveLimit": 1000})
    w, traffic = start(kubectl, node_agent_factory(workdir=short_workdir()), body, prom)
    try:
        traffic.set(NEW, "misses")  # the bad version: its cache never helps
        roll_out(kubectl)
        w.on({"llm-3"})
        rolled = wait_for("rolled back", lambda: (s := status_of(kubectl, "llm")).get("phase") == "RolledBack" and s,
                          timeout_s=ROLLOUT_TIMEOUT_S)
        w.on(set())
    finally:
        traffic.stop()
    # It fired in Prometheus (its ALERTS series; the canary is gone now, so it resolved).
    [fired] = prom.fired("KVTierHitRateDrop", {"namespace": kubectl.namespace, "policy": "llm", "version": NEW})
    assert float(fired["value"][1]) == 1.0
    assert traffic.wrong_kv == 0 and traffic.hits.get(NEW, 0) == 0  # the bad version never hit
    assert rolled["version"] == OLD
    [record] = rolled["rollout"]["history"]
    assert (record["step"], record["outcome"], record["version"]) == (1, "rolledBack", NEW)
    assert "alert KVTierHitRateDrop firing for" in record["message"]
    conds = {c["type"]: c for c in rolled["conditions"]}
    assert conds["RolledBack"]["status"] == "True" and conds["RolledBack"]["reason"] == "AnalysisFailed"
    [event] = events(kubectl, "llm", "RolledBack")
    assert event["type"] == "Warning" and f"alarm KVTierHitRateDrop (alertmanager {alertmanager.url})" in event["message"]
    sts = w.sts()
    assert sts["spec"]["template"]["metadata"]["annotations"][names.WEIGHTS_VERSION_ANNOTATION] == OLD


def test_prometheus_killed_mid_step_pauses_instead_of_rolling_back_and_resumes_when_it_returns(
        operator, kubectl, node_agent_factory, prometheus_factory):
    prom = prometheus_factory()
    body = policy({"source": "prometheus", "prometheus": {"url": prom.url}, "window": RECOVER_WINDOW,
                   "interval": "1s", "count": 2, "analysisWindow": "10s", "inconclusiveLimit": 1000,
                   "consecutiveErrorLimit": 2})
    w, traffic = start(kubectl, node_agent_factory(workdir=short_workdir()), body, prom)
    try:
        wait_for_series(prom, f'kvtier:hit_rate:ratio{{namespace="{kubectl.namespace}", version="{OLD}"}}')
        roll_out(kubectl)
        w.on({"llm-3"})
        wait_for("a measurement in step 1",
                 lambda: (rollout_status(kubectl).get("analysis") or {}).get("lastResult") is not None)
        prom.kill()
        paused = wait_for("paused, inconclusive", lambda: (s := status_of(kubectl, "llm")).get("phase") == "Paused"
                          and s, timeout_s=60)
        conds = {c["type"]: c for c in paused["conditions"]}
        assert conds["RolloutDegraded"]["reason"] == "AnalysisInconclusive"
        assert "errors in a row (consecutiveErrorLimit 2)" in conds["RolloutDegraded"]["message"]
        assert "unreachable" in conds["RolloutDegraded"]["message"]
        assert paused["rollout"]["pausedReason"] == "inconclusive" and paused["version"] == OLD
        # Not rolled back: the canary stays on the new version.
        sts = w.sts()
        assert sts["spec"]["template"]["metadata"]["annotations"][names.WEIGHTS_VERSION_ANNOTATION] == NEW
        assert sts["spec"]["updateStrategy"]["rollingUpdate"]["partition"] == REPLICAS - 1
        assert not events(kubectl, "llm", "RolledBack")

        prom.start()
        traffic.set(NEW, "hits")
        resumed = wait_for("resumed", lambda: events(kubectl, "llm", "RolloutResumed"), timeout_s=60)
        assert "answers again" in resumed[0]["message"]
        wait_for("rollout step 2 after the resume", lambda: rollout_status(kubectl).get("step") == 2,
                 timeout_s=ROLLOUT_TIMEOUT_S)
    finally:
        traffic.stop()
    assert status_of(kubectl, "llm")["phase"] == "RollingOut"
    assert [h["outcome"] for h in rollout_status(kubectl)["history"]] == ["paused", "resumed", "recovered"]


DEPLOYMENT = "dep"


def deployment(version: str) -> dict:
    engine = {"name": "engine", "image": "engine:1", "command": ["sleep", "infinity"]}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": DEPLOYMENT},
            "spec": {"replicas": REPLICAS, "selector": {"matchLabels": {"app": DEPLOYMENT}},
                     "template": {"metadata": {"labels": {"app": DEPLOYMENT},
                                               "annotations": {names.WEIGHTS_VERSION_ANNOTATION: version}},
                                  "spec": {"terminationGracePeriodSeconds": 0, "containers": [engine]}}}}


class ReadyWatch:
    """Samples, until stopped, how many of the workload's pods are Ready (the fewest seen)."""

    def __init__(self, kubectl: Kubectl, selector: str) -> None:
        import threading

        self.kubectl, self.selector, self.fewest, self.samples = kubectl, selector, None, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            pods = self.kubectl.get_json("pods", "-l", self.selector)["items"]
            ready = sum(1 for p in pods if not p["metadata"].get("deletionTimestamp") and any(
                c.get("type") == "Ready" and c.get("status") == "True" for c in p["status"].get("conditions") or []))
            self.fewest = ready if self.fewest is None else min(self.fewest, ready)
            self.samples += 1
            self._stop.wait(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def test_prometheus_gated_deployment_rollout_walks_a_canary_pair_and_never_empties_the_fleet(
        operator, kubectl, node_agent_factory, prometheus_factory):
    prom = prometheus_factory()
    body = tiny_policy("llm", DEPLOYMENT, workloadRef={"kind": "Deployment", "name": DEPLOYMENT}, rollout={
        "canaryPods": 1, "steps": [50, 100], "recovery": {
            "threshold": 0.5, "minLookups": MIN_LOOKUPS, "source": "prometheus", "prometheus": {"url": prom.url},
            "window": RECOVER_WINDOW, "interval": "1s", "count": 2, "analysisWindow": "10s",
            "inconclusiveLimit": 1000}})
    kubectl.apply(body)
    wait_for("sidecar ConfigMap", lambda: kubectl.run(
        "get", "configmap", names.sidecar_config_map("llm"), check=False).returncode == 0)
    kubectl.apply(deployment(OLD))
    agent = node_agent_factory(workdir=short_workdir())
    agent.wait_ready(REPLICAS, selector=f"app={DEPLOYMENT}", timeout_s=ROLLOUT_TIMEOUT_S)
    traffic = Traffic(kubectl, agent, f"app={DEPLOYMENT}", {OLD: "hits", NEW: "hits"}, root, BLOCK_SIZE,
                      BLOCK_BYTES).start()
    watch = None
    try:
        wait_for("the policy at rest on the old version",
                 lambda: (s := status_of(kubectl, "llm")).get("version") == OLD and s.get("phase") == "Ready")
        wait_for_series(prom, f'kvtier:hit_rate:ratio{{namespace="{kubectl.namespace}", version="{OLD}"}}')
        watch = ReadyWatch(kubectl, f"app={DEPLOYMENT}")
        roll_out(kubectl)
        canary = wait_for("the canary Deployment", lambda: kubectl.run(
            "get", "deployment", f"{DEPLOYMENT}-kvtier-canary", "-o", "json", check=False).stdout, timeout_s=60)
        assert json.loads(canary)["metadata"]["annotations"]["kvtier.io/fleet-replicas"] == str(REPLICAS)
        done = wait_for("rollout completed", lambda: (s := status_of(kubectl, "llm")).get("version") == NEW and s,
                        timeout_s=ROLLOUT_TIMEOUT_S * 2)
        wait_for("the canary handed back and removed", lambda: kubectl.run(
            "get", "deployment", f"{DEPLOYMENT}-kvtier-canary", check=False).returncode != 0,
            timeout_s=ROLLOUT_TIMEOUT_S)
        stable = kubectl.get_json("deployment", DEPLOYMENT)
        assert stable["spec"]["replicas"] == REPLICAS
        assert stable["spec"]["template"]["metadata"]["annotations"][names.WEIGHTS_VERSION_ANNOTATION] == NEW
        agent.wait_ready(REPLICAS, selector=f"app={DEPLOYMENT}", timeout_s=ROLLOUT_TIMEOUT_S)
    finally:
        traffic.stop()
        if watch is not None:
            watch.stop()
    assert traffic.wrong_kv == 0
    assert [(h["step"], h["outcome"]) for h in done["rollout"]["history"]] == [
        (1, "recovered"), (2, "recovered"), (3, "completed")]
    # Never a zero-ready window: new pods served before old ones went, at every step
    # and at the hand-back.
    assert watch.samples > 10 and watch.fewest >= REPLICAS // 2, (watch.fewest, watch.samples)
