"""The membership loop's pure epoch decision, the per-policy registry, and the one
"pod is ready" rule that membership and the rollout share."""
from __future__ import annotations

import asyncio

import yaml

from kvtier import policy
from kvtier.affinity import plan_membership_change
from kvtier.affinity import AffinityTable
from kvtier_operator import epoch, membership
from kvtier_operator.registry import PolicyKey, PolicyRegistry
from operator_cases import EXAMPLES_DIR

SPEC = policy.KVCachePolicySpec.model_validate(
    yaml.safe_load((EXAMPLES_DIR / "minimal.yaml").read_text())["spec"])
TENANTS = [f"t{i}" for i in range(40)]
MEMBERS = {"a": 1.0, "b": 1.0, "c": 1.0}


def _published() -> AffinityTable:
    first = plan_membership_change(epoch.empty_table(SPEC, 0), MEMBERS, TENANTS, homes=SPEC.affinity.homes)
    return first.table


def test_no_published_table_is_a_new_epoch():
    base = epoch.with_knobs(epoch.empty_table(SPEC, 0), SPEC)
    plan = plan_membership_change(base, MEMBERS, TENANTS, homes=SPEC.affinity.homes)
    decision = epoch.decide_epoch(None, base, plan)
    assert decision.new_epoch and decision.table == plan.table and decision.table.epoch == 1


def test_the_same_members_and_knobs_keep_the_published_epoch():
    published = _published()
    base = epoch.with_knobs(published, SPEC)
    plan = plan_membership_change(base, MEMBERS, TENANTS, homes=SPEC.affinity.homes)
    decision = epoch.decide_epoch(published, base, plan)
    assert not decision.new_epoch and decision.table.epoch == published.epoch


def test_a_knob_change_without_moves_bumps_the_epoch_and_carries_the_knob():
    published = _published()
    spec = SPEC.model_copy(update={"affinity": SPEC.affinity.model_copy(update={"balance_factor": 1.5})})
    base = epoch.with_knobs(published, spec)
    plan = plan_membership_change(base, MEMBERS, TENANTS, homes=spec.affinity.homes)
    decision = epoch.decide_epoch(published, base, plan)
    assert decision.new_epoch and decision.table.epoch == published.epoch + 1
    assert decision.table.balance_factor == 1.5


def test_a_member_joining_publishes_the_planners_table():
    published = _published()
    base = epoch.with_knobs(published, SPEC)
    plan = plan_membership_change(base, {**MEMBERS, "d": 1.0}, TENANTS, homes=SPEC.affinity.homes)
    decision = epoch.decide_epoch(published, base, plan)
    assert decision.new_epoch and decision.table == plan.table and "d" in decision.table.members


def test_a_deleted_policy_leaves_no_lock_state_or_trigger_behind():
    async def run() -> None:
        registry = PolicyRegistry()
        key, other = PolicyKey("ns", "p"), PolicyKey("ns", "q")
        trigger = registry.open_trigger(key)
        registry.lock(other)
        registry.wake_namespace("ns")
        assert trigger.is_set()
        registry.forget(key)
        assert len(registry) == 1
        assert registry.entry(key).trigger is None  # a recreated policy starts afresh
    asyncio.run(run())


def _pod(phase: str, ready: str = "True", ip: str | None = "10.0.0.1") -> dict:
    return {"metadata": {"name": "p", "labels": {"app": "llm"}},
            "status": {"phase": phase, "podIP": ip, "conditions": [{"type": "Ready", "status": ready}]}}


def test_a_pod_serves_only_when_running_ready_and_addressed():
    assert membership.pod_view(_pod("Running")).serving
    assert not membership.pod_view(_pod("Pending")).serving
    assert not membership.pod_view(_pod("Running", ready="False")).serving
    assert not membership.pod_view(_pod("Running", ip=None)).serving
