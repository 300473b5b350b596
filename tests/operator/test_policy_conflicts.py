"""Two policies selecting the same pods, on the real apiserver with the real operator,
webhook and injected sidecars: both report SelectorConflict with an Event, the older
policy owns the pods (a scale-up injects the new replica with the same policy as its
siblings, though the newer policy sorts first by name), and only the owner counts them
as members."""
from __future__ import annotations

from datetime import datetime, timezone

from kvtier_operator import names
from kvtier_testenv.kubectl import Kubectl
from operator_harness import events, wait_for
import sidecar_fleet
from sidecar_fleet import tiny_policy
from test_operator_e2e import short_workdir, status_of

APP = "shared"


def stateful_set(replicas: int) -> dict:
    return sidecar_fleet.stateful_set(APP, replicas)


def condition(kubectl: Kubectl, name: str, type_: str) -> dict | None:
    return next((c for c in status_of(kubectl, name).get("conditions", []) if c["type"] == type_), None)


def test_overlapping_policies_report_the_conflict_and_the_older_one_owns_pods_through_a_scale_up(
        operator, kubectl, node_agent_factory):
    agent = node_agent_factory(workdir=short_workdir())
    older = tiny_policy("zeta", APP)
    kubectl.apply(older)
    wait_for("zeta config", lambda: condition(kubectl, "zeta", "SidecarConfigRendered"))
    # creationTimestamp has one-second resolution: create the second policy in a later second.
    created = kubectl.get_json("kvcp", "zeta")["metadata"]["creationTimestamp"]
    wait_for("a later second", lambda: datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") > created)
    newer = tiny_policy("alpha", APP)  # sorts first by name, created second, another model id
    newer["spec"]["model"]["id"] = "reference-tiny-b"
    kubectl.apply(newer)
    kubectl.apply(stateful_set(1))
    agent.wait_ready(1, selector=f"app={APP}", timeout_s=90)

    for name, other in (("zeta", "alpha"), ("alpha", "zeta")):
        cond = wait_for(f"{name} conflict", lambda n=name: (c := condition(kubectl, n, "SelectorConflict"))
                        and c["status"] == "True" and c)
        assert cond["reason"] == "OverlappingSelectors"
        assert f"policy {other} also selects {APP}-0 (owned by zeta)" in cond["message"]
        assert wait_for(f"{name} event", lambda n=name: events(kubectl, n, "SelectorConflict"))

    kubectl.scale(f"statefulset/{APP}", 2)
    pods = agent.wait_ready(2, selector=f"app={APP}", timeout_s=90)
    assert [p["metadata"]["annotations"][names.INJECTED_ANNOTATION] for p in pods] == ["zeta", "zeta"]
    zeta = wait_for("zeta members", lambda: (s := status_of(kubectl, "zeta")).get("memberCount") == 2 and s)
    assert sorted(m.split("=")[0] for m in zeta["members"]) == [f"{APP}-0", f"{APP}-1"]
    alpha = wait_for("alpha reconciled", lambda: (s := status_of(kubectl, "alpha")).get("memberCount") is not None and s)
    assert alpha["memberCount"] == 0 and alpha.get("members", []) == []

    # Narrowing the newer policy's selector ends the conflict on both.
    kubectl.apply(tiny_policy("alpha", "elsewhere") | {"spec": {**newer["spec"], "selector": {"matchLabels": {"app": "elsewhere"}}}})
    for name in ("zeta", "alpha"):
        wait_for(f"{name} conflict cleared", lambda n=name: condition(kubectl, n, "SelectorConflict")["status"] == "False")
