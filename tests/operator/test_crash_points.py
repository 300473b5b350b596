"""SIGKILL-equivalent crashes of the operator between the side effects of a rollout
step (KVTIER_CRASH_AT, see `kvtier_operator.crashpoints`): the operator runs as its
own process (`kvtier-operator`, the ServiceAccount's kubeconfig), dies right after the
named side effect, is restarted, and the end state equals an uninterrupted run's —
the same StatefulSet patch, the same step in status, the step's Event exactly once.

A crash after the workload patch leaves the StatefulSet controller recreating the
canary while nothing serves the injection webhook (failurePolicy Ignore): the canary
starts without the sidecar, as it would in a real cluster. The restarted operator
reports it in status; deleting it (the remedy the condition names) brings it back
injected, and the rollout carries on at the same step."""
from __future__ import annotations

import pytest

from kvtier_operator import crashpoints, names
from operator_harness import wait_for
from test_operator_e2e import short_workdir, status_of
from test_rollout_e2e import APP, NEW, OLD, RECOVER_WINDOW, REPLICAS, event_count, rollout_status, start_fleet

CANARY = f"{APP}-{REPLICAS - 1}"


def injected(pod: dict) -> bool:
    return names.INJECTED_ANNOTATION in (pod["metadata"].get("annotations") or {})


def canary_uninjected_is_reported_then_recreated(kubectl, w, op) -> None:
    """The canary recreated while the operator was dead runs without the sidecar: the
    restarted operator names it in status; deleted once the webhook serves, it comes
    back injected."""
    status = wait_for("the uninjected canary in status", lambda: (s := status_of(kubectl, "llm"))
                      .get("uninjectedPodNames") == [CANARY] and s, timeout_s=60)
    assert status["uninjectedPods"] == 1
    cond = next(c for c in status["conditions"] if c["type"] == "SidecarsInjected")
    assert (cond["status"], cond["reason"]) == ("False", "PodsWithoutSidecar") and CANARY in cond["message"]
    wait_for("the restarted operator's webhook", op.webhook_listening)
    kubectl.delete("pod", CANARY, "--grace-period=0", "--force", wait=True)
    wait_for("the canary recreated with the sidecar",
             lambda: (p := w.pods().get(CANARY)) is not None and injected(p), timeout_s=60)
    wait_for("the report cleared", lambda: status_of(kubectl, "llm").get("uninjectedPods") == 0, timeout_s=60)


@pytest.mark.parametrize("point", crashpoints.ROLLOUT_POINTS)
def test_operator_killed_after_each_rollout_side_effect_converges_to_the_uninterrupted_step(
        operator_process, kubectl, node_agent_factory, point):
    op = operator_process.start()
    w, _ = start_fleet(kubectl, node_agent_factory(workdir=short_workdir()), RECOVER_WINDOW)
    op.stop()
    op.start(crash_at=point)
    kubectl.run("patch", "kvcp", "llm", "--type=merge", "-p",
                f'{{"spec": {{"model": {{"weightsVersion": "{NEW}"}}}}}}')
    assert op.exit_code() == crashpoints.CRASH_EXIT_CODE  # it died right after `point`
    sts = w.sts()["spec"]
    patched = sts["updateStrategy"]["rollingUpdate"]["partition"] == REPLICAS - 1
    assert patched == (point == "rollout-workload-patched"), (point, sts["updateStrategy"])
    assert bool(rollout_status(kubectl).get("step")) == (point != "rollout-event-posted")
    if patched:  # the controller rolls the canary while nothing serves the webhook
        canary = wait_for("the canary recreated on the new version", lambda: (p := w.pods().get(CANARY)) and (
            p["metadata"].get("annotations") or {}).get(names.WEIGHTS_VERSION_ANNOTATION) == NEW and p, timeout_s=60)
        assert not injected(canary)

    op.start()  # a plain restart
    if patched:
        canary_uninjected_is_reported_then_recreated(kubectl, w, op)
    w.on({CANARY})  # the canary: the same patch an uninterrupted run applies
    sts = w.sts()["spec"]
    assert sts["updateStrategy"]["rollingUpdate"]["partition"] == REPLICAS - 1
    assert sts["template"]["metadata"]["annotations"][names.WEIGHTS_VERSION_ANNOTATION] == NEW
    status = wait_for("step 1 in status", lambda: (s := status_of(kubectl, "llm"))["phase"] == "RollingOut" and s)
    assert status["version"] == OLD and status["rollout"]["step"] == 1 and status["rollout"]["targetVersion"] == NEW
    assert status["rollout"].get("history", []) == []
    assert event_count(kubectl, "RolloutStarted") == 1  # neither lost nor repeated
    assert all(injected(p) for p in w.pods().values())  # the whole fleet cached again
