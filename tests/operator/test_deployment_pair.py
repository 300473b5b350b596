"""The Deployment stable/canary pair (pure): the planner's workload view of the pair,
and the writes that move it — growing before shrinking, so no step, rollback or hand
back ever leaves fewer ready pods than the side being kept or brought up has."""
from __future__ import annotations

from kvtier_operator import deployment_pair as dp
from kvtier_operator.deployment_pair import Pair, Side
from kvtier_operator.rollout import WorkloadPatch

OLD, NEW = "v1", "v2"
STABLE = {"metadata": {"name": "llm", "namespace": "ns", "uid": "u-1", "labels": {"app": "llm"}},
          "spec": {"replicas": 4, "selector": {"matchLabels": {"app": "llm"}},
                   "template": {"metadata": {"labels": {"app": "llm"},
                                             "annotations": {"kvtier.io/weights-version": OLD}},
                                "spec": {"containers": [{"name": "engine", "image": "e:1"}]}}}}


def test_workload_view_of_the_pair():
    assert Pair(Side(4, 4, OLD), None, 4).workload.partition == 0
    w = Pair(Side(3, 3, OLD), Side(1, 1, NEW), 4).workload
    assert (w.replicas, w.template_version, w.partition) == (4, NEW, 3)
    assert Pair(Side(4, 0, NEW), Side(4, 4, NEW), 4).workload.template_version == NEW  # handing back


def test_step_creates_the_canary_and_keeps_the_stable_until_the_canary_is_ready():
    w = dp.converge(Pair(Side(4, 4, OLD), None, 4), WorkloadPatch(NEW, 3), True, STABLE)
    assert w.stable is None and w.canary_create["spec"]["replicas"] == 1
    canary = w.canary_create
    assert canary["metadata"]["name"] == "llm-kvtier-canary" and canary["metadata"]["annotations"] == {
        "kvtier.io/fleet-replicas": "4"}
    assert canary["spec"]["template"]["metadata"]["annotations"]["kvtier.io/weights-version"] == NEW
    assert canary["spec"]["selector"]["matchLabels"] == {"app": "llm", "kvtier.io/track": "canary"}
    assert canary["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    # Canary created but not ready: the stable keeps its 4.
    assert dp.converge(Pair(Side(4, 4, OLD), Side(1, 0, NEW), 4), WorkloadPatch(NEW, 3), True, STABLE).empty
    w = dp.converge(Pair(Side(4, 4, OLD), Side(1, 1, NEW), 4), WorkloadPatch(NEW, 3), True, STABLE)
    assert w.stable == {"spec": {"replicas": 3}} and w.canary is None


def test_next_step_grows_the_canary_first():
    w = dp.converge(Pair(Side(3, 3, OLD), Side(1, 1, NEW), 4), WorkloadPatch(NEW, 2), True, STABLE)
    assert w.canary["spec"]["replicas"] == 2 and w.stable is None
    w = dp.converge(Pair(Side(3, 3, OLD), Side(2, 2, NEW), 4), WorkloadPatch(NEW, 2), True, STABLE)
    assert w.stable == {"spec": {"replicas": 2}}


def test_rollback_brings_the_stable_back_before_the_canary_goes():
    w = dp.converge(Pair(Side(2, 2, OLD), Side(2, 2, NEW), 4), WorkloadPatch(OLD, 0), False, STABLE)
    assert w.stable == {"spec": {"replicas": 4}} and not w.canary_delete
    w = dp.converge(Pair(Side(4, 3, OLD), Side(2, 2, NEW), 4), WorkloadPatch(OLD, 0), False, STABLE)
    assert w.empty
    assert dp.converge(Pair(Side(4, 4, OLD), Side(2, 2, NEW), 4), WorkloadPatch(OLD, 0), False, STABLE).canary_delete


def test_completion_hands_the_fleet_back_to_the_stable_then_removes_the_canary():
    w = dp.converge(Pair(Side(0, 0, OLD), Side(4, 4, NEW), 4), WorkloadPatch(NEW, 0), False, STABLE)
    assert w.stable["spec"]["replicas"] == 4 and not w.canary_delete
    assert w.stable["spec"]["template"]["metadata"]["annotations"]["kvtier.io/weights-version"] == NEW
    assert dp.converge(Pair(Side(4, 2, NEW), Side(4, 4, NEW), 4), WorkloadPatch(NEW, 0), False, STABLE).empty
    assert dp.converge(Pair(Side(4, 4, NEW), Side(4, 4, NEW), 4), WorkloadPatch(NEW, 0), False, STABLE).canary_delete


def test_a_hand_back_keeps_the_canary_while_its_pods_first_minute_is_measured_a_rollback_never_waits():
    handed_back = Pair(Side(4, 4, NEW), Side(4, 4, NEW), 4)
    # The stable serves, but the last step's canary pods are in their first minute.
    assert dp.converge(handed_back, WorkloadPatch(NEW, 0), False, STABLE, measuring=True).empty
    assert dp.converge(handed_back, WorkloadPatch(NEW, 0), False, STABLE, measuring=False).canary_delete
    # A rollback removes the canary (the bad version) once the stable is back, measured or not.
    rolled_back = Pair(Side(4, 4, OLD), Side(2, 2, NEW), 4)
    assert dp.converge(rolled_back, WorkloadPatch(OLD, 0), False, STABLE, measuring=True).canary_delete
