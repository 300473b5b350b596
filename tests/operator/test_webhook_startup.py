"""The injection webhook's start-up gap: kopf serves admission requests as soon as its
webhook server is up, possibly before the policy index has loaded the policies that
already exist. Until the index is known loaded the webhook decides from a LIST on the
apiserver, so a pod created in an operator's first moments still gets its sidecar.
Real apiserver, the operator's own ServiceAccount, the real webhook. The handler is
also called directly with an empty index (the gap, made certain); the end-to-end test
creates a pod the moment the webhook listens, which may or may not fall in the gap."""
from __future__ import annotations

import asyncio
import socket

import kopf

from kvtier_operator import admission_policies, handlers, names
from kvtier_operator.kube import Kube
from operator_harness import operator_behind_its_webhook, operator_options, wait_for
from sidecar_fleet import serving_pod, tiny_policy


def operator_kube(kubeconfig, monkeypatch) -> Kube:
    """The operator's own clients, logged in as its ServiceAccount."""
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    return Kube.from_environment()


def test_until_the_index_is_loaded_the_webhook_reads_policies_from_the_apiserver(
        namespace, kubectl, operator_kubeconfig, monkeypatch):
    kubectl.apply(tiny_policy("early", "llm"))
    kube = operator_kube(operator_kubeconfig, monkeypatch)
    try:
        source = admission_policies.WebhookAdmissionPolicies()
        empty_index: list[admission_policies.Entry] = []  # what a still-loading index holds
        listed = asyncio.run(source.entries(kube, namespace, empty_index))
        assert [name for name, _spec, _created in listed] == ["early"]
        name, spec, created = listed[0]
        assert spec["selector"] == {"matchLabels": {"app": "llm"}} and created

        source.mark_loaded()  # from now on the index is the answer, however it differs
        stale_index = [admission_policies.entry("from-index", {"selector": {}}, {})]
        assert asyncio.run(source.entries(kube, namespace, stale_index)) == stale_index
    finally:
        kube.close()


def test_the_webhook_handler_injects_from_the_apiserver_while_its_index_is_still_empty(
        namespace, kubectl, operator_kubeconfig, monkeypatch, tmp_path):
    kubectl.apply(tiny_policy("early", "llm"))
    memo = kopf.Memo()
    memo.kube = operator_kube(operator_kubeconfig, monkeypatch)
    memo.admission = admission_policies.WebhookAdmissionPolicies()  # a fresh operator: nothing loaded
    memo.options = operator_options(tmp_path)
    pod = serving_pod("llm-0", "llm")
    pod["metadata"]["namespace"] = namespace
    body = kopf.Body(pod)
    patch = kopf.Patch(body=body)
    try:
        asyncio.run(handlers.inject_sidecar(body=body, patch=patch, memo=memo, policies_by_namespace={}))
    finally:
        memo.kube.close()
    assert patch["metadata"]["annotations"][names.INJECTED_ANNOTATION] == "early"
    assert names.SIDECAR_CONTAINER in [c["name"] for c in patch["spec"]["containers"]
                                       + patch["spec"].get("initContainers", [])]


def test_a_failed_list_falls_back_to_the_index(namespace, kubectl, control_plane, monkeypatch):
    kubectl.run("create", "serviceaccount", "no-rights")  # may not list policies: 403
    kube = operator_kube(control_plane.kubeconfig_for_service_account(namespace, "no-rights"), monkeypatch)
    try:
        index = [admission_policies.entry("p", {"selector": {}}, {})]
        assert asyncio.run(admission_policies.WebhookAdmissionPolicies().entries(kube, namespace, index)) == index
    finally:
        kube.close()


def webhook_listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_a_pod_created_the_moment_the_operator_starts_gets_its_sidecar(
        namespace, operator_kubeconfig, control_plane, kubectl, tmp_path, monkeypatch):
    kubectl.apply(tiny_policy("present", "llm"))  # exists before the operator starts
    with operator_behind_its_webhook(namespace, operator_kubeconfig, control_plane, tmp_path, monkeypatch) as (op, port):
        op.start()
        wait_for("the webhook listening", lambda: webhook_listens(port), timeout_s=60, interval_s=0.01)
        kubectl.apply(serving_pod("llm-0", "llm"))  # at once: the index may not have loaded yet
        created = kubectl.get_json("pod", "llm-0")
        assert created["metadata"]["annotations"][names.INJECTED_ANNOTATION] == "present"
        assert names.SIDECAR_CONTAINER in [c["name"] for c in created["spec"]["containers"]
                                           + created["spec"].get("initContainers", [])]
