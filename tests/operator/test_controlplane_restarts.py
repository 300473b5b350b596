"""kube-apiserver, then etcd, SIGKILLed and restarted mid-rollout (same ports, etcd on
the same data): the operator, the StatefulSet controller and the node agent recover
without help, nothing is lost (the rollout's step is still in status), and the
operator still acts on a change made afterwards (setting the version back rolls every
pod back to it)."""
from __future__ import annotations

from kvtier_operator import names
from operator_harness import wait_for
from test_operator_e2e import short_workdir, status_of
from test_rollout_e2e import (  # noqa: F401  (operator: the rollout tests' fixture)
    APP, NEW, OLD, REPLICAS, ROLLOUT_TIMEOUT_S, operator, rollout_status, start_fleet,
)

LONG_WINDOW = "600s"  # the step must not be judged while the control plane is down


def test_apiserver_then_etcd_restart_mid_rollout_recovers_without_help(
        operator, kubectl, node_agent_factory, control_plane):
    w, _ = start_fleet(kubectl, node_agent_factory(workdir=short_workdir()), LONG_WINDOW)
    kubectl.run("patch", "kvcp", "llm", "--type=merge", "-p",
                f'{{"spec": {{"model": {{"weightsVersion": "{NEW}"}}}}}}')
    w.on({f"{APP}-{REPLICAS - 1}"})
    before = rollout_status(kubectl)
    assert before["step"] == 1

    control_plane.restart("kube-apiserver")
    control_plane.restart("etcd")
    after = wait_for("the API answers again", lambda: rollout_status(kubectl), timeout_s=60)
    assert after["step"] == 1 and after["targetVersion"] == NEW  # nothing lost

    kubectl.run("patch", "kvcp", "llm", "--type=merge", "-p",
                f'{{"spec": {{"model": {{"weightsVersion": "{OLD}"}}}}}}')
    w.on(set())  # every pod back on the old version: the operator saw the change
    sts = w.sts()["spec"]
    assert sts["template"]["metadata"]["annotations"][names.WEIGHTS_VERSION_ANNOTATION] == OLD
    assert sts["updateStrategy"]["rollingUpdate"]["partition"] == 0
    status = wait_for("at rest on the old version", lambda: (s := status_of(kubectl, "llm"))["phase"] != "RollingOut"
                      and s, timeout_s=ROLLOUT_TIMEOUT_S)
    assert status["version"] == OLD
