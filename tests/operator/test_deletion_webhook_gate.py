"""The rollback a policy's deletion makes recreates pods, so, like a rollout step, it
waits until this operator's injection webhook serves: a StatefulSet left mid-rollout is
not touched while the webhook's port refuses connections, and is rolled back to the
stable version as soon as it listens; a Deployment pair's stable side grows back only
then too. Real apiserver (the workloads, written with the operator's own
ServiceAccount) and real sockets on loopback."""
from __future__ import annotations

import asyncio
import socket

import kopf
import pytest

from kvtier_operator import deployment_pair, names, rollout_teardown, webhook_gate
from kvtier_operator.kube import Kube
from kvtier_operator.options import OperatorOptions
from test_rollout_e2e import APP, NEW, OLD, REPLICAS, rollout_policy, stateful_set
from test_rollout_prometheus import DEPLOYMENT, deployment


def mid_rollout_policy(namespace: str, workload_ref: dict | None = None) -> dict:
    """A policy being deleted while its canary runs NEW (status.version: the stable OLD)."""
    body = rollout_policy("90s")
    body["metadata"].update(namespace=namespace, uid="u-1")
    if workload_ref:
        body["spec"]["workloadRef"] = workload_ref
    body["spec"]["model"]["weightsVersion"] = NEW
    body["status"] = {"version": OLD, "phase": "RollingOut"}
    return body


def webhook_memo(port: int) -> kopf.Memo:
    memo = kopf.Memo()
    memo.options = OperatorOptions(webhook_host="127.0.0.1", webhook_port=port)
    return memo


def sts_state(kubectl) -> tuple[str, int]:
    spec = kubectl.get_json("statefulset", APP)["spec"]
    return (spec["template"]["metadata"]["annotations"][names.WEIGHTS_VERSION_ANNOTATION],
            spec["updateStrategy"]["rollingUpdate"]["partition"])


class Deletion:
    """The delete handler's rollback step for `body`, with this test's webhook port:
    bound but refusing connections until `webhook_listens`."""

    def __init__(self, body: dict, operator_kubeconfig, monkeypatch) -> None:
        monkeypatch.setenv("KUBECONFIG", str(operator_kubeconfig))
        self.kube = Kube.from_environment()  # the operator's own ServiceAccount
        self.body, self.posted = body, []
        self.port = socket.socket()
        self.port.bind(("127.0.0.1", 0))
        self.memo = webhook_memo(self.port.getsockname()[1])

    def webhook_listens(self) -> None:
        self.port.listen()

    def __call__(self) -> None:
        asyncio.run(rollout_teardown.settle_workload(self.kube, self.body, lambda *e: self.posted.append(e),
                                                     lambda: webhook_gate.serving(self.memo)))

    def close(self) -> None:
        self.port.close()
        self.kube.close()


def test_a_deletion_rolls_the_workload_back_only_once_the_webhook_serves(
        namespace, kubectl, operator_kubeconfig, monkeypatch):
    half_rolled = stateful_set(NEW)
    half_rolled["spec"]["updateStrategy"]["rollingUpdate"]["partition"] = REPLICAS - 1
    kubectl.apply(half_rolled)
    settle = Deletion(mid_rollout_policy(namespace), operator_kubeconfig, monkeypatch)
    posted = settle.posted
    try:
        with pytest.raises(kopf.TemporaryError, match="injection webhook"):
            settle()
        assert sts_state(kubectl) == (NEW, REPLICAS - 1)  # untouched while the webhook is away
        assert posted == []

        settle.webhook_listens()
        with pytest.raises(kopf.TemporaryError, match=f"to return to {OLD}"):  # the pods are yet to converge
            settle()
        assert sts_state(kubectl) == (OLD, 0)
        assert [reason for _type, reason, _message in posted] == ["RolloutAbandoned"]
    finally:
        settle.close()


def test_a_deletion_hands_a_deployment_pair_back_only_once_the_webhook_serves(
        namespace, kubectl, operator_kubeconfig, monkeypatch):
    stable = deployment(OLD)
    stable["spec"]["replicas"] = REPLICAS - 1  # the canary holds the fleet's last replica
    kubectl.apply(stable)
    canary = deployment_pair.canary_manifest(kubectl.get_json("deployment", DEPLOYMENT), NEW, 1, REPLICAS)
    kubectl.apply(canary)
    body = mid_rollout_policy(namespace, {"kind": "Deployment", "name": DEPLOYMENT})
    settle = Deletion(body, operator_kubeconfig, monkeypatch)
    try:
        with pytest.raises(kopf.TemporaryError, match="injection webhook"):
            settle()
        assert kubectl.get_json("deployment", DEPLOYMENT)["spec"]["replicas"] == REPLICAS - 1  # untouched
        assert settle.posted == []

        settle.webhook_listens()
        with pytest.raises(kopf.TemporaryError, match="ready pods"):  # the canary goes once they serve
            settle()
        assert kubectl.get_json("deployment", DEPLOYMENT)["spec"]["replicas"] == REPLICAS  # grown back first
        assert kubectl.run("get", "deployment", deployment_pair.canary_name(DEPLOYMENT), check=False).returncode == 0
    finally:
        settle.close()
