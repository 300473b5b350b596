"""The deletion planner: a workload mid-rollout goes back to the stable version with
partition 0; a consistent one is left alone."""
from kvtier_operator.rollout import Workload, WorkloadPatch
from kvtier_operator.deployment_pair import Pair, Side
from kvtier_operator.rollout_teardown import pods_off, settle, settle_pair

OLD, NEW = "sha256:" + "1" * 64, "sha256:" + "2" * 64


def test_half_rolled_workload_goes_back_to_the_stable_version_with_partition_zero():
    assert settle(Workload(4, NEW, 2), OLD) == WorkloadPatch(template_version=OLD, partition=0)
    assert settle(Workload(4, OLD, 3), OLD) == WorkloadPatch(template_version=OLD, partition=0)  # rolled back, partition stuck


def test_consistent_workload_or_unknown_stable_version_is_left_alone():
    assert settle(Workload(4, OLD, 0), OLD) is None
    assert settle(Workload(4, NEW, 2), None) is None


def test_pods_off_the_stable_version_are_named():
    assert pods_off({"a-0": OLD, "a-1": NEW, "a-2": None}, OLD) == ["a-1", "a-2"]


def _pair(stable: Side, canary: Side | None, fleet: int = 4) -> Pair:
    return Pair(stable, canary, fleet)


STABLE_DEPLOYMENT = {"metadata": {"name": "llm", "namespace": "ns", "uid": "u"},
                     "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "llm"}}, "template": {}}}


def test_deleted_mid_rollout_the_stable_deployment_grows_back_to_the_fleet_before_the_canary_goes():
    writes = settle_pair(_pair(Side(1, 1, OLD), Side(3, 3, NEW)), OLD, STABLE_DEPLOYMENT)
    assert writes.stable == {"spec": {"replicas": 4}} and not writes.canary_delete  # grow first
    writes = settle_pair(_pair(Side(4, 2, OLD), Side(3, 3, NEW)), OLD, STABLE_DEPLOYMENT)
    assert writes.empty  # the stable side does not serve the fleet yet: the canary stays
    writes = settle_pair(_pair(Side(4, 4, OLD), Side(3, 3, NEW)), OLD, STABLE_DEPLOYMENT)
    assert writes.canary_delete and writes.stable is None  # then the canary goes


def test_a_pair_without_canary_is_left_alone_on_deletion():
    assert settle_pair(_pair(Side(4, 4, OLD), None), OLD, STABLE_DEPLOYMENT) is None
