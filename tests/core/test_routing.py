"""Routing: first cool home, deterministic spill along the rendezvous order, hysteresis."""
from __future__ import annotations

import pytest

from kvtier.affinity import AffinityTable
from kvtier.routing import SpillState, homes_for, pick

TABLE = AffinityTable(
    epoch=3, members={f"pod-{i}": 1.0 for i in range(8)}, homes=2,
    spill_occupancy=0.85, balance_factor=1.25, hysteresis=0.05,
)
ORDER = TABLE.order_for("acme")  # pod-4, pod-0, pod-5, ... (golden in test_rendezvous)
HOME1, HOME2, SPILL1 = ORDER[0], ORDER[1], ORDER[2]


def occupancy(base: float = 0.3, **overrides: float) -> dict[str, float]:
    occ = {m: base for m in TABLE.members}
    occ.update(overrides)
    return occ


def test_a_cool_fleet_routes_to_the_first_home():
    p = pick("acme", TABLE, occupancy())
    assert (p.member, p.rank, p.spilled, p.epoch) == (HOME1, 0, False, 3)


def test_a_home_above_threshold_but_not_above_the_fleet_mean_keeps_its_tenant():
    # 0.9 > 0.85, but the fleet mean is 0.8 and 1.25 x 0.8 = 1.0: the whole fleet is full.
    p = pick("acme", TABLE, occupancy(base=0.8, **{HOME1: 0.9}))
    assert p.member == HOME1


def test_a_hot_first_home_hands_over_to_the_second_home_then_spills_in_order():
    p = pick("acme", TABLE, occupancy(**{HOME1: 0.95}))
    assert (p.member, p.rank, p.spilled) == (HOME2, 1, False)
    p = pick("acme", TABLE, occupancy(**{HOME1: 0.95, HOME2: 0.97}))
    assert (p.member, p.rank, p.spilled) == (SPILL1, 2, True)


def test_spill_is_the_same_on_every_router():
    occ = occupancy(**{HOME1: 0.95, HOME2: 0.97})
    routers = [SpillState() for _ in range(5)]
    assert len({pick("acme", TABLE, occ, s).member for s in routers}) == 1


def test_spilled_tenant_returns_only_below_the_lower_watermark():
    state = SpillState()
    hot = occupancy(**{HOME1: 0.95, HOME2: 0.95})
    assert pick("acme", TABLE, hot, state).member == SPILL1
    # Homes at 0.84: no longer hot, but not below 0.85 - 0.05 = 0.80 -> stay spilled.
    hovering = occupancy(**{HOME1: 0.84, HOME2: 0.84})
    assert pick("acme", TABLE, hovering, state).member == SPILL1
    # A router without state would already go back: stickiness is what differs.
    assert pick("acme", TABLE, hovering).member == HOME1
    # Second home cools first: the tenant moves up to it, still off its first home.
    assert pick("acme", TABLE, occupancy(**{HOME1: 0.84, HOME2: 0.70}), state).member == HOME2
    assert pick("acme", TABLE, occupancy(**{HOME1: 0.79, HOME2: 0.70}), state).member == HOME1
    assert state.spilled_tenants() == {}


def test_a_hot_spill_target_moves_the_tenant_further_along_its_order():
    state = SpillState()
    pick("acme", TABLE, occupancy(**{HOME1: 0.95, HOME2: 0.95}), state)
    p = pick("acme", TABLE, occupancy(**{HOME1: 0.84, HOME2: 0.84, SPILL1: 0.96}), state)
    assert p.member == ORDER[3] and p.rank == 3


def test_a_new_epoch_forgets_stickiness():
    state = SpillState()
    pick("acme", TABLE, occupancy(**{HOME1: 0.95, HOME2: 0.95}), state)
    newer = TABLE.model_copy(update={"epoch": 4})
    assert pick("acme", newer, occupancy(**{HOME1: 0.84, HOME2: 0.84}), state).member == HOME1


def test_unreported_members_count_as_empty_and_stay_out_of_the_mean():
    # Only HOME1 reported: the mean is its own 0.95, so it is not above 1.25 x mean.
    assert pick("acme", TABLE, {HOME1: 0.95}).member == HOME1
    # With one cool report elsewhere HOME1 is hot; unreported HOME2 counts as empty.
    assert pick("acme", TABLE, {HOME1: 0.95, ORDER[5]: 0.3}).member == HOME2


def test_an_empty_table_cannot_route():
    with pytest.raises(ValueError, match="no members"):
        pick("acme", AffinityTable(), {})


# The operator moved acme off plain rendezvous (bounded loads): its homes are the
# third- and first-ranked members, in that order.
OVERRIDDEN = TABLE.model_copy(update={"home_overrides": {"acme": [ORDER[2], ORDER[0]]}})


def test_pick_routes_an_overridden_tenant_to_its_published_homes_first():
    assert homes_for("acme", OVERRIDDEN) == [ORDER[2], ORDER[0]]
    p = pick("acme", OVERRIDDEN, occupancy())
    assert (p.member, p.rank, p.spilled) == (ORDER[2], 0, False)
    p = pick("acme", OVERRIDDEN, occupancy(**{ORDER[2]: 0.95}))
    assert (p.member, p.rank, p.spilled) == (ORDER[0], 1, False)


def test_an_overridden_tenant_spills_along_its_rendezvous_order_past_its_homes():
    assert OVERRIDDEN.order_for("acme") == [ORDER[2], ORDER[0], ORDER[1], *ORDER[3:]]
    p = pick("acme", OVERRIDDEN, occupancy(**{ORDER[2]: 0.95, ORDER[0]: 0.95}))
    assert (p.member, p.rank, p.spilled) == (ORDER[1], 2, True)


def test_tenants_without_an_override_keep_plain_rendezvous_homes():
    for tenant in ("globex", "initech", "t-17"):
        assert homes_for(tenant, OVERRIDDEN) == TABLE.order_for(tenant)[:2]
        assert pick(tenant, OVERRIDDEN, occupancy()).member == TABLE.order_for(tenant)[0]


def test_a_router_reading_the_published_json_routes_like_the_planner_decided():
    from kvtier.affinity import plan_membership_change

    tenants = [f"tenant-{i}" for i in range(1200)]
    plan = plan_membership_change(AffinityTable(members={}), {f"pod-{i}": 1.0 for i in range(60)}, tenants)
    published = AffinityTable.from_json(plan.table.to_json())
    assert published.home_overrides
    cool = {m: 0.3 for m in published.members}
    for tenant in tenants:
        assert pick(tenant, published, cool).member == plan.assignment.homes_of(tenant)[0]
