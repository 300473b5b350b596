"""Deleting a policy mid-rollout, on the real apiserver and controller-manager with the
real injected sidecars: before the finalizer lets the policy go, its StatefulSet is
back on the stable version (template and partition 0) and every pod runs it, with a
RolloutAbandoned Event — never a workload left half-rolled."""
from __future__ import annotations

from kvtier_operator import names
from operator_harness import events, wait_for
from test_operator_e2e import short_workdir
from test_rollout_e2e import (  # noqa: F401  (operator: the rollout tests' fixture)
    APP, NEW, OLD, RECOVER_WINDOW, ROLLOUT_TIMEOUT_S, operator, start_fleet,
)


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
