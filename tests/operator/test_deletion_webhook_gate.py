"""The rollback a policy's deletion makes recreates pods, so, like a rollout step, it
waits until this operator's injection webhook serves: a StatefulSet left mid-rollout is
not touched while the webhook's port refuses connections, and is rolled back to the
stable version as soon as it listens. Real apiserver (the StatefulSet, written with the
operator's own ServiceAccount) and real sockets on loopback."""
from __future__ import annotations

import asyncio
import socket

import kopf
import pytest

from kvtier_operator import names, rollout_teardown, webhook_gate
from kvtier_operator.kube import Kube
from kvtier_operator.options import OperatorOptions
from test_rollout_e2e import APP, NEW, OLD, REPLICAS, rollout_policy, stateful_set


def mid_rollout_policy(namespace: str) -> dict:
    """A policy being deleted while its canary runs NEW (status.version: the stable OLD)."""
    body = rollout_policy("90s")
    body["metadata"].update(namespace=namespace, uid="u-1")
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


def test_a_deletion_rolls_the_workload_back_only_once_the_webhook_serves(
        namespace, kubectl, operator_kubeconfig, monkeypatch):
    half_rolled = stateful_set(NEW)
    half_rolled["spec"]["updateStrategy"]["rollingUpdate"]["partition"] = REPLICAS - 1
    kubectl.apply(half_rolled)
    monkeypatch.setenv("KUBECONFIG", str(operator_kubeconfig))
    kube = Kube.from_environment()
    posted: list[tuple[str, str, str]] = []
    body = mid_rollout_policy(namespace)
    port_holder = socket.socket()
    port_holder.bind(("127.0.0.1", 0))  # bound, not listening yet: connections are refused
    memo = webhook_memo(port_holder.getsockname()[1])
    settle = lambda: rollout_teardown.settle_workload(  # noqa: E731
        kube, body, lambda *e: posted.append(e), lambda: webhook_gate.serving(memo))
    try:
        with pytest.raises(kopf.TemporaryError, match="injection webhook"):
            asyncio.run(settle())
        assert sts_state(kubectl) == (NEW, REPLICAS - 1)  # untouched while the webhook is away
        assert posted == []

        port_holder.listen()  # the webhook serves now
        with pytest.raises(kopf.TemporaryError, match=f"to return to {OLD}"):  # the pods are yet to converge
            asyncio.run(settle())
        assert sts_state(kubectl) == (OLD, 0)
        assert [reason for _type, reason, _message in posted] == ["RolloutAbandoned"]
    finally:
        port_holder.close()
        kube.close()
