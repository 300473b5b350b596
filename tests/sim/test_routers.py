"""Routing policies behind one interface."""
import numpy as np
import pytest

from kvtier.affinity import AffinityTable
from kvtier.routing import homes_for
from kvtier.sim.fleet import Fleet, FleetSpec
from kvtier.sim.routers import (ApproxPrefixRouter, ConsistentHashRouter, KvtierRouter, RootBook,
                                 RoundRobinRouter, make_router)
from kvtier.sim.request import HashCache, SimRequest

TENANTS = [f"tenant-{i:05d}" for i in range(200)]


def _bound(policy, n=8):
    fleet = Fleet(FleetSpec(n_replicas=n))
    policy.bind(fleet, [None] * n, RootBook(TENANTS))
    return fleet, policy


def _req(tenant, tokens=(1, 2, 3, 4, 5, 6, 7, 8, 9)):
    r = SimRequest(hash_cache=HashCache(4))
    r.tenant, r.tenant_name = tenant, TENANTS[tenant]
    r.tokens = np.asarray(tokens, dtype=np.uint32)
    r.token_bytes = r.tokens.tobytes()
    return r


def test_kvtier_routes_a_cool_tenant_to_its_first_home_in_the_published_table():
    fleet, policy = _bound(KvtierRouter())
    plain = AffinityTable(members={name: 1.0 for name in fleet.names})
    assert policy.table.members == plain.members
    for t in range(50):
        assert fleet.names[policy.route(_req(t), 0.0)] == homes_for(TENANTS[t], policy.table)[0]


def test_kvtier_spills_off_a_home_that_is_hot_and_above_the_fleet_mean():
    fleet, policy = _bound(KvtierRouter())
    first = policy.route(_req(3), 0.0)
    fleet.occupancy_by_name[fleet.names[first]] = 0.95
    second = policy.route(_req(3), 0.0)
    assert second != first
    assert fleet.names[second] == homes_for(TENANTS[3], policy.table)[1]


def test_kvtier_join_moves_about_one_in_n_of_the_tenants_and_bumps_the_epoch():
    fleet, policy = _bound(KvtierRouter(), n=8)
    fleet.join()
    plan = policy.membership_changed()
    assert plan.table.epoch == 1
    # k=3 homes: a tenant moves when the newcomer enters its top 3, ~3/9 of them.
    assert 0.2 < plan.movement_fraction < 0.5


def test_consistent_hashing_on_tenant_is_sticky_and_moves_few_tenants_on_join():
    fleet, policy = _bound(ConsistentHashRouter("tenant"))
    before = [policy.route(_req(t), 0.0) for t in range(200)]
    assert before == [policy.route(_req(t), 0.0) for t in range(200)]
    fleet.join()
    policy.membership_changed()
    after = [policy.route(_req(t), 0.0) for t in range(200)]
    moved = sum(a != b for a, b in zip(before, after))
    assert 0 < moved < 60  # ~1/9 of 200 expected
    assert all(b == a or b == 8 for a, b in zip(before, after))


def test_round_robin_cycles_through_live_replicas():
    fleet, policy = _bound(RoundRobinRouter(), n=4)
    assert sorted(policy.route(_req(0), 0.0) for _ in range(4)) == [0, 1, 2, 3]


def test_approx_prefix_prefers_the_replica_it_sent_the_prefix_to():
    fleet, policy = _bound(ApproxPrefixRouter())
    req = _req(0)
    first = policy.route(req, 0.0)
    policy.routed(req, first)
    req2 = _req(0)
    assert policy.route(req2, 0.0) == first


def test_unknown_policy_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match="kvtier"):
        make_router("nope")


def test_precise_prefix_goes_where_the_blocks_really_are_unless_load_outweighs_them():
    from kvtier.sim.caches import LruCache
    from kvtier.sim.routers import PrecisePrefixRouter

    fleet = Fleet(FleetSpec(n_replicas=4))
    caches = [LruCache(100, 4) for _ in range(4)]
    policy = PrecisePrefixRouter()
    roots = RootBook(TENANTS)
    policy.bind(fleet, caches, roots)
    req = _req(0, tokens=tuple(range(64)))
    req.prompt_tokens = 64
    caches[2].serve(req, roots.root(0, 0), 0.0)
    assert policy.route(req, 0.0) == 2
    fleet.active_kv_tokens[2] = 10_000  # 625 decode blocks dwarf the 15 cached ones
    assert policy.route(req, 0.0) != 2


def test_sglang_routes_by_prefix_when_balanced_and_to_the_shortest_queue_when_not():
    from kvtier.sim.routers import SglangRouter

    fleet, policy = _bound(SglangRouter(), n=4)
    req = _req(0, tokens=tuple(range(64)))
    policy.routed(req, 1)
    assert policy.route(req, 0.0) == 1
    fleet.in_flight[:] = [5, 200, 5, 0]  # 200 - 0 > 64 and 200 > 1.5 x 0: imbalanced
    assert policy.route(req, 0.0) == 3
