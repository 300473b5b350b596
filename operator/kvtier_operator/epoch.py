"""Whether membership needs a new affinity epoch, and which table it publishes. Pure.

A new epoch is published when there is none yet, when the planner moved members or
tenants, or when the policy changed a routing knob (spill occupancy, balance factor)
without any move: routers must see the new knobs, under a new epoch number.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvtier import policy
from kvtier.affinity import AffinityTable, MembershipPlan


@dataclass(frozen=True, slots=True)
class EpochDecision:
    table: AffinityTable  # what routers should read after this reconcile
    new_epoch: bool  # True: warm the moves, then publish `table`


def decide_epoch(published: AffinityTable | None, base: AffinityTable, plan: MembershipPlan) -> EpochDecision:
    """`base` is the published table (or an empty one) with the policy's knobs applied;
    `plan` the planner's answer from it."""
    knobs_changed = published is not None and knobs(published) != knobs(base)
    table = plan.table if plan.changed else base
    if knobs_changed and not plan.changed:
        table = base.model_copy(update={"epoch": base.epoch + 1})
    return EpochDecision(table, published is None or plan.changed or knobs_changed)


def empty_table(spec: policy.KVCachePolicySpec, epoch: int) -> AffinityTable:
    return AffinityTable(epoch=epoch, members={}, homes=spec.affinity.homes,
                         spill_occupancy=spec.affinity.spill_occupancy, balance_factor=spec.affinity.balance_factor)


def knobs(table: AffinityTable) -> tuple[float, float]:
    return (table.spill_occupancy, table.balance_factor)


def with_knobs(table: AffinityTable, spec: policy.KVCachePolicySpec) -> AffinityTable:
    want = {"spill_occupancy": spec.affinity.spill_occupancy, "balance_factor": spec.affinity.balance_factor}
    if knobs(table) == (want["spill_occupancy"], want["balance_factor"]):
        return table
    return table.model_copy(update=want)
