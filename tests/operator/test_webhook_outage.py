"""Webhook outage: with failurePolicy Ignore and the operator down, selected pods start
without the sidecar; when the operator returns it reports them (count, names, a
SidecarsInjected=False condition and an Event) rather than leaving them uncached in
silence, and a recreated pod is injected and clears the report."""
from __future__ import annotations

from kvtier_operator import names
from operator_harness import events, operator_behind_its_webhook, wait_for
from sidecar_fleet import serving_pod, tiny_policy
from test_operator_e2e import status_of


def test_pods_created_while_the_operator_is_down_are_reported_when_it_returns(
        namespace, operator_kubeconfig, control_plane, kubectl, tmp_path, monkeypatch):
    with operator_behind_its_webhook(namespace, operator_kubeconfig, control_plane, tmp_path, monkeypatch) as (op, _):
        kubectl.apply(tiny_policy("outage", "llm"))
        # Operator down: nothing listens on the webhook's port; failurePolicy Ignore admits the pods.
        for pod in ("llm-0", "llm-1"):
            kubectl.apply(serving_pod(pod, "llm"))
            created = kubectl.get_json("pod", pod)
            assert [c["name"] for c in created["spec"]["containers"]] == ["engine"]
            assert names.INJECTED_ANNOTATION not in (created["metadata"].get("annotations") or {})
        kubectl.apply(serving_pod("web-0", "web"))  # not selected: never reported

        op.start()
        status = wait_for("uninjected pods reported", lambda: (s := status_of(kubectl, "outage"))
                          .get("uninjectedPods") == 2 and s, timeout_s=60)
        assert status["uninjectedPodNames"] == ["llm-0", "llm-1"]
        cond = next(c for c in status["conditions"] if c["type"] == "SidecarsInjected")
        assert (cond["status"], cond["reason"]) == ("False", "PodsWithoutSidecar")
        assert "2 selected pods run without the sidecar" in cond["message"] and "llm-0, llm-1" in cond["message"]
        assert wait_for("event", lambda: events(kubectl, "outage", "PodsWithoutSidecar"))

        # With the operator back, recreated pods are injected and the report clears.
        for pod in ("llm-0", "llm-1"):
            kubectl.delete("pod", pod, "--grace-period=0", "--force", wait=True)
            kubectl.apply(serving_pod(pod, "llm"))
            assert kubectl.get_json("pod", pod)["metadata"]["annotations"][names.INJECTED_ANNOTATION] == "outage"
        status = wait_for("report cleared", lambda: (s := status_of(kubectl, "outage"))
                          .get("uninjectedPods") == 0 and s, timeout_s=60)
        assert status.get("uninjectedPodNames", []) == []
        assert next(c for c in status["conditions"] if c["type"] == "SidecarsInjected")["status"] == "True"
