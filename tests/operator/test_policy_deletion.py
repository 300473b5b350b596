"""Deleting a policy mid-rollout, on the real apiserver and controller-manager with the
real injected sidecars: before the finalizer lets the policy go, its StatefulSet is
back on the stable version (template and partition 0) and every pod runs it, with a
RolloutAbandoned Event — never a workload left half-rolled. A Deployment rolls as a
stable/canary pair: the stable Deployment is back at the fleet size and the canary
Deployment is gone before the policy goes."""
from __future__ import annotations

from kvtier_operator import deployment_pair, names
from operator_harness import events, wait_for
from test_operator_e2e import short_workdir
from test_rollout_e2e import (  # noqa: F401  (operator: the rollout tests' fixture)
    APP, MIN_LOOKUPS, NEW, OLD, RECOVER_WINDOW, REPLICAS, ROLLOUT_TIMEOUT_S, operator, start_fleet,
)
from sidecar_fleet import tiny_policy
from test_operator_e2e import status_of
from test_rollout_prometheus import DEPLOYMENT, deployment


def test_deleting_a_policy_mid_rollout_rolls_the_workload_back_to_the_stable_version_first(
        operator, kubectl, node_agent_factory):
    w, _ = start_fleet(kubectl, node_agent_factory(workdir=short_workdir()), RECOVER_WINDOW)
    kubectl.run("patch", "kvcp", "llm", "--type=merge", "-p",
                f'{{"spec": {{"model": {{"weightsVersion": "{NEW}"}}}}}}')
    w.on({f"{APP}-3"})  # the canary runs the new version: the fleet is on two versions
    assert w.sts()["spec"]["updateStrategy"]["rollingUpdate"]["partition"] == 3

    kubectl.delete("kvcp", "llm")  # returns at once; the finalizer does the work
    gone = wait_for("policy released", lambda: kubectl.run("get", "kvcp", "llm", check=False).returncode != 0,
                    timeout_s=ROLLOUT_TIMEOUT_S)
    assert gone
    # The moment the policy is gone, the workload is already whole on the stable version.
    sts = w.sts()["spec"]
    assert sts["template"]["metadata"]["annotations"][names.WEIGHTS_VERSION_ANNOTATION] == OLD
    assert sts["updateStrategy"]["rollingUpdate"]["partition"] == 0
    assert w.versions() == {f"{APP}-{i}": OLD for i in range(4)}
    abandoned = events(kubectl, "llm", "RolloutAbandoned")
    assert abandoned and f"rolled back to the stable version {OLD}" in abandoned[0]["message"]


def test_a_policy_deleted_while_the_operator_is_down_is_rolled_back_with_every_recreated_pod_injected(
        operator, kubectl, node_agent_factory):
    """The restarted operator's delete handler rolls the canary back only once its own
    webhook serves, so the pod the StatefulSet controller recreates gets its sidecar."""
    w, _ = start_fleet(kubectl, node_agent_factory(workdir=short_workdir()), RECOVER_WINDOW)
    kubectl.run("patch", "kvcp", "llm", "--type=merge", "-p",
                f'{{"spec": {{"model": {{"weightsVersion": "{NEW}"}}}}}}')
    w.on({f"{APP}-3"})
    canary_uid = w.pods()[f"{APP}-3"]["metadata"]["uid"]
    operator.stop()
    kubectl.delete("kvcp", "llm")  # the finalizer waits for the operator
    operator.start()
    wait_for("policy released", lambda: kubectl.run("get", "kvcp", "llm", check=False).returncode != 0,
             timeout_s=ROLLOUT_TIMEOUT_S)
    pods = w.pods()
    assert w.versions() == {f"{APP}-{i}": OLD for i in range(REPLICAS)}
    assert pods[f"{APP}-3"]["metadata"]["uid"] != canary_uid  # recreated by the rollback
    assert {n: p["metadata"].get("annotations", {}).get(names.INJECTED_ANNOTATION) for n, p in pods.items()} == \
        {f"{APP}-{i}": "llm" for i in range(REPLICAS)}

def test_deleting_a_policy_mid_rollout_of_a_deployment_restores_the_stable_one_and_removes_the_canary(
        operator, kubectl, node_agent_factory):
    kubectl.apply(tiny_policy("llm", DEPLOYMENT, workloadRef={"kind": "Deployment", "name": DEPLOYMENT}, rollout={
        "canaryPods": 1, "steps": [50, 100],
        "recovery": {"threshold": 0.5, "window": RECOVER_WINDOW, "minLookups": MIN_LOOKUPS}}))
    wait_for("sidecar ConfigMap", lambda: kubectl.run(
        "get", "configmap", names.sidecar_config_map("llm"), check=False).returncode == 0)
    kubectl.apply(deployment(OLD))
    agent = node_agent_factory(workdir=short_workdir())
    agent.wait_ready(REPLICAS, selector=f"app={DEPLOYMENT}", timeout_s=ROLLOUT_TIMEOUT_S)
    wait_for("the policy at rest on the old version",
             lambda: (s := status_of(kubectl, "llm")).get("version") == OLD and s.get("phase") == "Ready")
    kubectl.run("patch", "kvcp", "llm", "--type=merge", "-p",
                f'{{"spec": {{"model": {{"weightsVersion": "{NEW}"}}}}}}')
    canary = deployment_pair.canary_name(DEPLOYMENT)
    wait_for("the canary serving and the stable side shrunk", lambda: (
        (c := kubectl.get_json("deployment", canary) if kubectl.run("get", "deployment", canary, check=False)
         .returncode == 0 else None) and (c.get("status") or {}).get("readyReplicas") == 1
        and kubectl.get_json("deployment", DEPLOYMENT)["spec"]["replicas"] == REPLICAS - 1), timeout_s=ROLLOUT_TIMEOUT_S)

    kubectl.delete("kvcp", "llm")  # returns at once; the finalizer does the work
    wait_for("policy released", lambda: kubectl.run("get", "kvcp", "llm", check=False).returncode != 0,
             timeout_s=ROLLOUT_TIMEOUT_S)
    # The moment the policy is gone, the stable Deployment serves the fleet and the canary is deleted.
    stable = kubectl.get_json("deployment", DEPLOYMENT)
    assert stable["spec"]["replicas"] == REPLICAS and stable["status"].get("readyReplicas") == REPLICAS
    assert stable["spec"]["template"]["metadata"]["annotations"][names.WEIGHTS_VERSION_ANNOTATION] == OLD
    left = kubectl.run("get", "deployment", canary, "-o", "json", check=False)
    assert left.returncode != 0 or '"deletionTimestamp"' in left.stdout
    abandoned = events(kubectl, "llm", "RolloutAbandoned")
    assert len(abandoned) == 1 and abandoned[0].get("count", 1) == 1, abandoned  # once, however many ticks
    assert canary in abandoned[0]["message"] and OLD in abandoned[0]["message"]
