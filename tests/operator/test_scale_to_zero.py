"""A workload scaled to 0 and back under a live policy, at rest and mid-rollout, on the
real apiserver and controller-manager with the real injected sidecars: membership
empties and refills without an operator error, and a rollout holds its step while
there are no pods (ScaledToZero). With no pods the StatefulSet controller counts its
rolling update as complete and promotes the update revision, so the pods come back all
on the new version: the rollout then moves to its last step (FleetCaughtUp, an Event,
a history record), still RollingOut with its hit-rate judgement armed, and its
partition at 0. (The window is long here so a slow machine's pod restarts never
expire it; what the judgement does after catching up is pinned in the planner's tests.)"""
from __future__ import annotations

from operator_harness import events, wait_for
from test_operator_e2e import short_workdir, status_of
from test_rollout_e2e import (  # noqa: F401  (operator: the rollout tests' fixture)
    APP, NEW, OLD, REPLICAS, ROLLOUT_TIMEOUT_S, operator, rollout_status, start_fleet,
)


LONG_WINDOW = "600s"


def progressing(kubectl) -> dict:
    return next((c for c in status_of(kubectl, "llm").get("conditions", []) if c["type"] == "RolloutProgressing"), {})


def test_scale_to_zero_and_back_at_rest_and_mid_rollout(operator, kubectl, node_agent_factory):
    w, _ = start_fleet(kubectl, node_agent_factory(workdir=short_workdir()), LONG_WINDOW)
    kubectl.scale(f"statefulset/{APP}", 0)
    wait_for("no members", lambda: status_of(kubectl, "llm").get("memberCount") == 0, timeout_s=ROLLOUT_TIMEOUT_S)
    kubectl.scale(f"statefulset/{APP}", REPLICAS)
    w.ready()
    wait_for("members back", lambda: status_of(kubectl, "llm").get("memberCount") == REPLICAS,
             timeout_s=ROLLOUT_TIMEOUT_S)

    kubectl.run("patch", "kvcp", "llm", "--type=merge", "-p",
                f'{{"spec": {{"model": {{"weightsVersion": "{NEW}"}}}}}}')
    w.on({f"{APP}-3"})
    kubectl.scale(f"statefulset/{APP}", 0)
    held = wait_for("step held", lambda: (c := progressing(kubectl)).get("reason") == "ScaledToZero" and c,
                    timeout_s=ROLLOUT_TIMEOUT_S)
    assert "0 replicas" in held["message"]
    assert status_of(kubectl, "llm")["phase"] == "RollingOut" and rollout_status(kubectl)["step"] == 1
    # The controller's view once the pods are gone: its rolling update counts as done.
    wait_for("no pods, and the update revision promoted to current", lambda: not w.pods() and (
        (st := w.sts().get("status") or {}).get("currentRevision") == st.get("updateRevision")),
        timeout_s=ROLLOUT_TIMEOUT_S)
    kubectl.scale(f"statefulset/{APP}", REPLICAS)
    w.ready()
    assert w.versions() == {f"{APP}-{i}": NEW for i in range(REPLICAS)}  # all back on the new version
    caught = wait_for("the rollout at its last step", lambda: (r := rollout_status(kubectl)).get("step") == 3 and r,
                      timeout_s=ROLLOUT_TIMEOUT_S)
    assert caught["history"][-1]["outcome"] == "caughtUp" and caught["history"][-1]["step"] == 1
    assert caught["canaryPercent"] == 100
    assert progressing(kubectl).get("reason") in ("FleetCaughtUp", "WaitingForRecovery")
    status = status_of(kubectl, "llm")
    assert status["phase"] == "RollingOut" and status["version"] == OLD  # nothing promoted without recovery
    wait_for("partition of the last step", lambda: w.sts()["spec"]["updateStrategy"]["rollingUpdate"]["partition"] == 0,
             timeout_s=ROLLOUT_TIMEOUT_S)
    caught_up = events(kubectl, "llm", "RolloutCaughtUp")
    assert len(caught_up) == 1 and f"all {REPLICAS} pods came back on {NEW}" in caught_up[0]["message"]
