"""The affinity table and the membership planner: epochs, minimal movement, balance."""
from __future__ import annotations

import numpy as np
import pydantic
import pytest

from kvtier.affinity import (
    DEFAULT_SPILL_OCCUPANCY,
    AffinityTable,
    assign,
    load_imbalance,
    plan_membership_change,
)

TENANTS = [f"tenant-{i}" for i in range(6000)]


def fleet(n: int, weight: float = 1.0) -> dict[str, float]:
    return {f"pod-{i}": weight for i in range(n)}


def test_table_round_trips_through_camel_case_json_and_defaults_to_the_cliff():
    table = AffinityTable(epoch=4, members=fleet(3), homes=2)
    text = table.to_json()
    assert '"spillOccupancy":0.85' in text and '"balanceFactor"' in text and "tenant" not in text
    back = AffinityTable.from_json(text)
    assert back == table
    assert back.spill_occupancy == DEFAULT_SPILL_OCCUPANCY == 0.85
    assert back.homes_for("acme") == table.homes_for("acme")


def test_table_for_a_hundred_members_fits_easily_in_a_configmap():
    assert len(AffinityTable(members=fleet(100)).to_json()) < 4096


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"members": {"a": 0.0}}, "weights must be finite and > 0"),
        ({"members": {"": 1.0}}, "non-empty"),
        ({"homes": 0}, "homes"),
        ({"spillOccupancy": 1.5}, "spillOccupancy"),
        ({"hysteresis": 0.9}, "must be below spillOccupancy"),
        ({"rendezvousVersion": 99}, "upgrade the reader"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_invalid_tables_are_rejected_with_a_message(fields, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        AffinityTable.model_validate(fields)


def test_a_join_bumps_the_epoch_and_moves_about_k_over_n_plus_one_of_tenants():
    old = AffinityTable(epoch=7, members=fleet(20), homes=3)
    plan = plan_membership_change(old, dict(old.members, **{"pod-new": 1.0}), TENANTS)
    assert plan.changed and plan.table.epoch == 8 and plan.joined == ["pod-new"]
    # Every move is the newcomer becoming a home, and it gained exactly that tenant.
    assert all(m.gained == ("pod-new",) and len(m.lost) == 1 for m in plan.moves)
    expected = 3 / 21
    assert plan.movement_fraction == pytest.approx(expected, rel=0.12)


def test_a_leave_moves_only_the_departed_members_tenants():
    old = AffinityTable(epoch=1, members=fleet(20), homes=3)
    before = assign(old, TENANTS)
    shrunk = {m: w for m, w in old.members.items() if m != "pod-3"}
    plan = plan_membership_change(old, shrunk, TENANTS, current=before)
    had_pod3 = {t for t in TENANTS if "pod-3" in before.homes_of(t)}
    assert {m.tenant for m in plan.moves} == had_pod3
    assert all(m.lost == ("pod-3",) and len(m.gained) == 1 for m in plan.moves)
    assert plan.left == ["pod-3"] and plan.table.epoch == 2


@pytest.mark.parametrize(
    "change",
    [
        lambda m: dict(m, **{"pod-x": 1.0, "pod-y": 2.0}),
        lambda m: {k: v for k, v in m.items() if k not in ("pod-1", "pod-9")},
        lambda m: dict(m, **{"pod-2": 3.0, "pod-z": 1.0}),
        lambda m: dict({k: v for k, v in m.items() if k != "pod-0"}, **{"pod-0b": 1.0}),
    ],
    ids=["two-joins", "two-leaves", "reweigh-and-join", "replace"],
)
def test_incremental_plan_equals_a_from_scratch_assignment(change):
    old = AffinityTable(epoch=1, members=fleet(12), homes=3)
    current = assign(old, TENANTS)
    plan = plan_membership_change(old, change(dict(old.members)), TENANTS, current=current)
    scratch = assign(plan.table, TENANTS)
    assert plan.assignment.members == scratch.members
    assert np.array_equal(plan.assignment.homes, scratch.homes)
    moved = {m.tenant for m in plan.moves}
    for t in TENANTS[:500]:
        assert (t in moved) == (current.homes_of(t) != scratch.homes_of(t))


def test_no_change_keeps_the_epoch_and_moves_nobody():
    old = AffinityTable(epoch=5, members=fleet(6))
    plan = plan_membership_change(old, dict(old.members), TENANTS[:100])
    assert not plan.changed and plan.table.epoch == 5 and plan.moves == []


def test_stale_or_partial_current_assignment_is_recomputed_not_trusted():
    old = AffinityTable(epoch=1, members=fleet(10))
    stale = assign(AffinityTable(members=fleet(9)), TENANTS)
    plan = plan_membership_change(old, dict(old.members, **{"pod-n": 1.0}), TENANTS, current=stale)
    assert np.array_equal(plan.assignment.homes, assign(plan.table, TENANTS).homes)
    partial = assign(old, TENANTS[:100])
    plan = plan_membership_change(old, dict(old.members, **{"pod-n": 1.0}), TENANTS, current=partial)
    assert np.array_equal(plan.assignment.homes, assign(plan.table, TENANTS).homes)


def test_changing_k_recomputes_every_tenant():
    old = AffinityTable(epoch=1, members=fleet(10), homes=2)
    plan = plan_membership_change(old, dict(old.members), TENANTS[:500], homes=3)
    assert plan.table.homes == 3 and plan.table.epoch == 2
    assert all(len(m.new_homes) == 3 and m.new_homes[:2] == m.old_homes for m in plan.moves)
    assert len(plan.moves) == 500


def test_growing_past_k_members_from_a_tiny_fleet_is_planned_correctly():
    old = AffinityTable(epoch=1, members=fleet(2), homes=3)
    plan = plan_membership_change(old, fleet(4), TENANTS[:200])
    assert np.array_equal(plan.assignment.homes, assign(plan.table, TENANTS[:200]).homes)
    assert all(len(m.new_homes) == 3 for m in plan.moves)


def test_home_load_is_balanced_with_many_tenants():
    table = AffinityTable(members=fleet(10), homes=3)
    tenants = [f"tenant-{i}" for i in range(30_000)]
    a = assign(table, tenants)
    assert sum(a.loads().values()) == 3 * len(tenants)
    # Mean 9,000 homes per member; binomial spread puts the max within ~2.5%.
    assert load_imbalance(a, table) <= 1.05


def test_home_load_follows_weights():
    members = {"a": 1.0, "b": 1.0, "c": 2.0, "d": 4.0}
    table = AffinityTable(members=members, homes=1)
    a = assign(table, [f"tenant-{i}" for i in range(40_000)])
    loads = a.loads()
    assert loads["d"] / loads["a"] == pytest.approx(4.0, rel=0.06)
    assert loads["c"] / loads["b"] == pytest.approx(2.0, rel=0.06)
    assert load_imbalance(a, table) <= 1.05


def test_a_copied_table_with_other_members_never_reuses_the_old_members_order():
    table = AffinityTable(members=fleet(4))
    table.homes_for("acme")  # fills the per-table cache
    copied = table.model_copy(update={"members": {"pod-9": 1.0, "pod-8": 1.0}})
    assert sorted(copied.homes_for("acme")) == ["pod-8", "pod-9"]
    assert copied.order_for("acme") == AffinityTable(members={"pod-8": 1.0, "pod-9": 1.0}).order_for("acme")
