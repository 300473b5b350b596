"""A person's rollout controls through the real `kubectl-kvtier` plugin, against the real
apiserver and controller-manager, with the operator running as its own process (the
`kvtier-operator` console script, the conftest's `operator_process`) so it can be
SIGKILLed mid-step:

- pause / resume / promote / abort / retry, each acted on once and told back by the
  plugin; a request that does not apply is rejected with a reason and exit status 1;
- an operator SIGKILLed mid-step comes back at the same step with the same clock, and
  patches nothing differently (the StatefulSet's generation does not move);
- `status` and `affinity show` print what the policy's status and ConfigMap hold.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from kvtier.affinity import AffinityTable
from kvtier_operator import names
from kvtier_testenv import binaries
from kvtier_testenv.kubectl import Kubectl
from operator_harness import events, wait_for
from sidecar_fleet import DIGEST as OLD, tiny_policy
from test_operator_e2e import short_workdir, status_of
from test_rollout_e2e import APP, NEW, Workload, stateful_set

PLUGIN = os.path.join(os.path.dirname(sys.executable), "kubectl-kvtier")
# The rollout never recovers by itself here (no traffic): only the controls move it.
WINDOW = "30m"


def plugin(kubectl: Kubectl, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVTIER_KUBECTL": str(binaries.find().kubectl)}
    return subprocess.run([PLUGIN, "--kubeconfig", str(kubectl.kubeconfig), "-n", kubectl.namespace, *args],
                          capture_output=True, text=True, env=env, timeout=120)


def rollout_status(kubectl: Kubectl) -> dict:
    return status_of(kubectl, "llm").get("rollout") or {}


def partition(w: Workload) -> int:
    return w.sts()["spec"]["updateStrategy"]["rollingUpdate"]["partition"]


def test_plugin_controls_and_sigkilled_operator_resumes_mid_step(operator_process, kubectl, node_agent_factory):
    operator = operator_process.start()
    kubectl.apply(tiny_policy("llm", APP, workloadRef={"kind": "StatefulSet", "name": APP}, rollout={
        "canaryPods": 1, "steps": [50, 100], "recovery": {"window": WINDOW, "minLookups": 10}}))
    wait_for("sidecar ConfigMap", lambda: kubectl.run(
        "get", "configmap", names.sidecar_config_map("llm"), check=False).returncode == 0, timeout_s=60)
    kubectl.apply(stateful_set(OLD))
    w = Workload(kubectl, node_agent_factory(workdir=short_workdir()))
    w.on(set())
    wait_for("at rest on the old version", lambda: status_of(kubectl, "llm").get("phase") == "Ready", timeout_s=60)
    kubectl.run("patch", "kvcp", "llm", "--type=merge", "-p", json.dumps({"spec": {"model": {"weightsVersion": NEW}}}))
    w.on({"llm-3"})
    step1 = wait_for("rollout step 1", lambda: (r := rollout_status(kubectl)).get("step") == 1 and r)

    # SIGKILL mid-step: same step, same clock, no new patch, no second RolloutStarted.
    generation = w.sts()["metadata"]["generation"]
    operator.sigkill()
    operator.start()
    out = plugin(kubectl, "rollout", "pause", "llm")  # answered only by the restarted operator
    assert out.returncode == 0, out.stdout + out.stderr + operator.tail()
    assert "paused (manual)" in out.stdout
    after = rollout_status(kubectl)
    assert after["step"] == 1 and after["stepStartedAt"] == step1["stepStartedAt"]
    assert w.sts()["metadata"]["generation"] == generation and partition(w) == 3
    assert sum(e.get("count") or 1 for e in events(kubectl, "llm", "RolloutStarted")) == 1
    assert status_of(kubectl, "llm")["phase"] == "Paused"

    # A request that does not apply: rejected with a reason, nothing moves.
    out = plugin(kubectl, "rollout", "retry", "llm")
    assert out.returncode == 1 and "only a rolled-back rollout" in out.stdout
    assert partition(w) == 3

    out = plugin(kubectl, "rollout", "resume", "llm")
    assert out.returncode == 0 and status_of(kubectl, "llm")["phase"] == "RollingOut"

    # Promote: step 2 at once (the canary never recovered), llm-2 moves to the new version.
    out = plugin(kubectl, "rollout", "promote", "llm")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "step 2" in out.stdout
    w.on({"llm-3", "llm-2"})
    assert partition(w) == 2 and rollout_status(kubectl)["history"][-1]["outcome"] == "promoted"

    # Abort: every pod back on the old version.
    out = plugin(kubectl, "rollout", "abort", "llm")
    assert out.returncode == 0 and "Phase:         RolledBack" in out.stdout
    w.on(set())
    aborted = status_of(kubectl, "llm")
    assert {c["type"]: c for c in aborted["conditions"]}["RolledBack"]["reason"] == "Aborted"
    assert [e["type"] for e in events(kubectl, "llm", "RolledBack")] == ["Warning"]

    # Retry: the same target from step 1 again.
    out = plugin(kubectl, "rollout", "retry", "llm")
    assert out.returncode == 0, out.stdout + out.stderr
    w.on({"llm-3"})
    r = rollout_status(kubectl)
    assert r["step"] == 1 and r["targetVersion"] == NEW
    assert [h["outcome"] for h in r["history"]] == ["paused", "resumed", "promoted", "aborted"]

    status = plugin(kubectl, "status", "llm")
    assert status.returncode == 0
    assert f"Rollout:       {NEW} step 1 (25% of pods)" in status.stdout and "aborted" in status.stdout
    shown = plugin(kubectl, "affinity", "show", "llm", "--tenant", "acme")
    assert shown.returncode == 0, shown.stderr
    table = AffinityTable.from_json(kubectl.get_json("configmap", names.affinity_config_map("llm"))["data"][
        names.AFFINITY_KEY])
    assert f"Epoch:   {table.epoch}" in shown.stdout
    assert [ln.split()[0] for ln in shown.stdout.splitlines() if ln.startswith("  ")] == sorted(table.members)
    assert f"Tenant acme: homes {', '.join(table.homes_for('acme'))}" in shown.stdout
