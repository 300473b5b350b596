"""SIGKILL-equivalent crashes of the operator between the side effects of a rollout
step (KVTIER_CRASH_AT, see `kvtier_operator.crashpoints`): the operator runs as its
own process (`kvtier-operator`, the ServiceAccount's kubeconfig), dies right after the
named side effect, is restarted, and the end state equals an uninterrupted run's —
the same StatefulSet patch, the same step in status, the step's Event exactly once."""
from __future__ import annotations

import pytest

from kvtier_operator import crashpoints, names
from kvtier_testenv.kubectl import Kubectl
from kvtier_testenv.ports import free_port
from operator_harness import OperatorProcess, operator_options, register_webhook, wait_for
from test_operator_e2e import short_workdir, status_of
from test_rollout_e2e import APP, NEW, OLD, RECOVER_WINDOW, REPLICAS, event_count, rollout_status, start_fleet


@pytest.fixture
def operator_process(namespace, operator_kubeconfig, control_plane, tmp_path):
    admin = Kubectl(control_plane.kubeconfig)
    port = free_port()
    options = operator_options(tmp_path, port)
    hook = register_webhook(admin, namespace, open(options.webhook_cert, "rb").read(), port)
    op = OperatorProcess(namespace, operator_kubeconfig, options, tmp_path / "operator.log")
    yield op
    op.stop()
    admin.delete("mutatingwebhookconfiguration", hook)


@pytest.mark.parametrize("point", crashpoints.ROLLOUT_POINTS)
def test_operator_killed_after_each_rollout_side_effect_converges_to_the_uninterrupted_step(
        operator_process, kubectl, node_agent_factory, point):
    op = operator_process.start()
    w, _ = start_fleet(kubectl, node_agent_factory(workdir=short_workdir()), RECOVER_WINDOW)
    op.stop()
    op.start(crash_at=point)
    kubectl.run("patch", "kvcp", "llm", "--type=merge", "-p",
                f'{{"spec": {{"model": {{"weightsVersion": "{NEW}"}}}}}}')
    assert op.proc.wait(120) == crashpoints.CRASH_EXIT_CODE  # it died right after `point`
    sts = w.sts()["spec"]
    patched = sts["updateStrategy"]["rollingUpdate"]["partition"] == REPLICAS - 1
    assert patched == (point == "rollout-workload-patched"), (point, sts["updateStrategy"])
    assert bool(rollout_status(kubectl).get("step")) == (point != "rollout-event-posted")

    op.start()  # a plain restart
    w.on({f"{APP}-{REPLICAS - 1}"})  # the canary: the same patch an uninterrupted run applies
    sts = w.sts()["spec"]
    assert sts["updateStrategy"]["rollingUpdate"]["partition"] == REPLICAS - 1
    assert sts["template"]["metadata"]["annotations"][names.WEIGHTS_VERSION_ANNOTATION] == NEW
    status = wait_for("step 1 in status", lambda: (s := status_of(kubectl, "llm"))["phase"] == "RollingOut" and s)
    assert status["version"] == OLD and status["rollout"]["step"] == 1 and status["rollout"]["targetVersion"] == NEW
    assert status["rollout"].get("history", []) == []
    assert event_count(kubectl, "RolloutStarted") == 1  # neither lost nor repeated
