"""A pod belongs to the policy that injected it until it is recreated: after that policy
is deleted, an overlapping policy does not adopt its running pods (they still run the
deleted policy's config) but reports them, and a pod created afterwards is its own."""
from __future__ import annotations

from datetime import datetime, timezone

from kvtier import policy
from kvtier_operator import conflicts, names
from kvtier_testenv.kubectl import Kubectl
from operator_harness import wait_for
from sidecar_fleet import serving_pod, tiny_policy
from test_operator_e2e import short_workdir, status_of

APP = "kept"


def _condition(kubectl: Kubectl, name: str, type_: str) -> dict | None:
    return next((c for c in status_of(kubectl, name).get("conditions", []) if c["type"] == type_), None)


def test_foreign_pods_are_reported_and_owned_by_nobody():
    this = conflicts.PolicyRef("alpha", "2026-03-01T00:00:00Z", policy.LabelSelector(match_labels={"app": "llm"}))
    pods = [conflicts.PodLabels("llm-0", {"app": "llm"}, "zeta"), conflicts.PodLabels("llm-1", {"app": "llm"}, None),
            conflicts.PodLabels("llm-2", {"app": "llm"}, "alpha"), conflicts.PodLabels("web-0", {"app": "web"}, "x")]
    assert conflicts.foreign(this, pods, [this]) == {"llm-0": "zeta"}
    obs = conflicts.foreign_observation({"llm-0": "zeta"})
    assert obs.status == "True" and "llm-0 (injected by zeta)" in obs.message
    assert conflicts.foreign_observation({}).status == "False"


def test_pods_of_a_deleted_policy_are_not_adopted_by_an_overlapping_one(operator, kubectl, node_agent_factory):
    agent = node_agent_factory(workdir=short_workdir())
    kubectl.apply(tiny_policy("zeta", APP))
    wait_for("zeta config", lambda: _condition(kubectl, "zeta", "SidecarConfigRendered"))
    created = kubectl.get_json("kvcp", "zeta")["metadata"]["creationTimestamp"]
    wait_for("a later second", lambda: datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") > created)
    newer = tiny_policy("alpha", APP)
    newer["spec"]["model"]["id"] = "reference-tiny-b"  # another model: its members must never be zeta's pods
    kubectl.apply(newer)
    wait_for("alpha config", lambda: _condition(kubectl, "alpha", "SidecarConfigRendered"))
    # Only the webhook says which policy's sidecar a pod runs: a forged label goes.
    forged = serving_pod("forged-0", "web")
    forged["metadata"]["labels"][names.INJECTED_LABEL] = "zeta"
    kubectl.apply(forged)
    assert names.INJECTED_LABEL not in kubectl.get_json("pod", "forged-0")["metadata"]["labels"]
    kubectl.apply(serving_pod(f"{APP}-0", APP))
    agent.wait_ready(1, selector=f"app={APP}", timeout_s=90)
    meta = kubectl.get_json("pod", f"{APP}-0")["metadata"]
    assert meta["annotations"][names.INJECTED_ANNOTATION] == "zeta" and meta["labels"][names.INJECTED_LABEL] == "zeta"
    wait_for("zeta's member", lambda: status_of(kubectl, "zeta").get("memberCount") == 1)

    kubectl.delete("kvcp", "zeta", wait=True)
    foreign = wait_for("alpha reports the foreign pod", lambda: (c := _condition(kubectl, "alpha", "ForeignSidecars"))
                       and c["status"] == "True" and c)
    assert f"{APP}-0 (injected by zeta)" in foreign["message"]
    alpha = status_of(kubectl, "alpha")
    assert alpha["memberCount"] == 0 and alpha.get("members", []) == []

    # A pod created now is alpha's, and alpha's only member.
    kubectl.apply(serving_pod(f"{APP}-1", APP))
    agent.wait_ready(2, selector=f"app={APP}", timeout_s=90)
    assert kubectl.get_json("pod", f"{APP}-1")["metadata"]["annotations"][names.INJECTED_ANNOTATION] == "alpha"
    alpha = wait_for("alpha's member", lambda: (s := status_of(kubectl, "alpha")).get("memberCount") == 1 and s)
    assert [m.split("=")[0] for m in alpha["members"]] == [f"{APP}-1"]


def test_the_injected_label_is_a_label_value_unique_per_policy():
    assert names.injected_label_value("tiny") == "tiny"
    long_a, long_b = "a" * 60 + ".x" * 20, "a" * 60 + ".y" * 20
    labels = {names.injected_label_value(n) for n in (long_a, long_b)}
    assert len(labels) == 2
    assert all(len(v) <= names.MAX_LABEL_VALUE and v[0].isalnum() and v[-1].isalnum() for v in labels)
