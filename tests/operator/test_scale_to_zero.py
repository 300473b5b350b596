"""A workload scaled to 0 and back under a live policy, at rest and mid-rollout, on the
real apiserver and controller-manager with the real injected sidecars: membership
empties and refills without an operator error, and a rollout holds its step while
there are no pods (ScaledToZero) and resumes the same step when they return. (The
window is long here so a slow machine's pod restarts never expire it; that the clock
restarts after a scale-to-zero is pinned in the planner's tests.)"""
from __future__ import annotations

from operator_harness import wait_for
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
    kubectl.scale(f"statefulset/{APP}", REPLICAS)
    # Which revision the StatefulSet controller recreates pods at after a scale to zero is
    # its business (it may promote the update revision); the rollout must simply resume.
    w.ready()
    assert set(w.versions().values()) <= {OLD, NEW}
    wait_for("step judged again", lambda: progressing(kubectl).get("reason") != "ScaledToZero",
             timeout_s=ROLLOUT_TIMEOUT_S)
    status = status_of(kubectl, "llm")
    assert status["phase"] == "RollingOut" and status["version"] == OLD
    assert w.sts()["spec"]["updateStrategy"]["rollingUpdate"]["partition"] == REPLICAS - 1
