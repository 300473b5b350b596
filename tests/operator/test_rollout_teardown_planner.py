"""The deletion planner: a workload mid-rollout goes back to the stable version with
partition 0; a consistent one is left alone."""
from kvtier_operator.rollout import Workload, WorkloadPatch
from kvtier_operator.rollout_teardown import pods_off, settle

OLD, NEW = "sha256:" + "1" * 64, "sha256:" + "2" * 64


def test_half_rolled_workload_goes_back_to_the_stable_version_with_partition_zero():
    assert settle(Workload(4, NEW, 2), OLD) == WorkloadPatch(template_version=OLD, partition=0)
    assert settle(Workload(4, OLD, 3), OLD) == WorkloadPatch(template_version=OLD, partition=0)  # rolled back, partition stuck


def test_consistent_workload_or_unknown_stable_version_is_left_alone():
    assert settle(Workload(4, OLD, 0), OLD) is None
    assert settle(Workload(4, NEW, 2), None) is None


def test_pods_off_the_stable_version_are_named():
    assert pods_off({"a-0": OLD, "a-1": NEW, "a-2": None}, OLD) == ["a-1", "a-2"]
