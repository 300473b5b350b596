"""Faults during a MEMBERSHIP CHANGE (a pod joins):

- the operator SIGKILLed (KVTIER_CRASH_AT, see `kvtier_operator.crashpoints`) right
  after each side effect of the join — journal write, warm-ups, ConfigMap publish,
  Redis publish, journal clear, Event, status — then restarted: the end state is an
  uninterrupted run's (one new epoch, each moved tenant warmed once on the real
  newcomer's sidecar, Redis and status agree, the epoch's Event once);
- Redis down when a pod joins and started again while the join waits: the newcomer's
  warm-ups, which need Redis to confirm their source peers, are asked again until it
  is back, then the epoch is published once, warmed, and reaches Redis with nothing
  but the operator's own retries."""
from __future__ import annotations

import time

import pytest

from kvtier_operator import crashpoints, names
from operator_harness import wait_for
from test_operator_e2e import (Fleet, affinity_table, epochs_in_events, new_warm_jobs, pending_journal, redis_table, 
                               short_workdir, status_of, wait_table)
from sidecar_fleet import tiny_policy

TENANTS = [f"tenant-{i:03d}" for i in range(12)]
HOMES = 2
POLICY = "fleet"
# Generous for a loaded 2-core box: a join's warm-ups may wait for a restarted Redis
# and the sidecars' next heartbeats (after their backoff) before they can start.
WARM_TIMEOUT = "90s"
# Points at or after which the new epoch's ConfigMap exists when the operator dies.
PUBLISHED_FROM = crashpoints.MEMBERSHIP_POINTS.index("membership-table-published")


def three_member_fleet(kubectl, agent, redis_url: str) -> tuple[Fleet, object]:
    fleet = Fleet(kubectl, agent, POLICY, POLICY)
    kubectl.apply(tiny_policy(POLICY, POLICY, affinity={"homes": HOMES, "warmTimeout": WARM_TIMEOUT},
                              redis={"url": redis_url}))
    wait_for("sidecar ConfigMap", lambda: kubectl.run(
        "get", "configmap", names.sidecar_config_map(POLICY), check=False).returncode == 0)
    fleet.add("f0", "f1", "f2")
    fleet.ready(3)
    fleet.seed_homes(wait_table(kubectl, POLICY, 3), TENANTS)
    return fleet, fleet.learn_tenants(len(TENANTS))


def assert_one_join_epoch(kubectl, fleet: Fleet, t0, joined_at: float, redis_url: str):
    t1 = wait_table(kubectl, POLICY, 4, epoch=t0.epoch + 1)
    moved = {t for t in TENANTS if t0.homes_for(t) != t1.homes_for(t)}
    assert moved and all(set(t1.homes_for(t)) - set(t0.homes_for(t)) == {"f3"} for t in moved)
    warms = new_warm_jobs(fleet.sidecar("f3"), joined_at)
    assert sorted(j["tenant"] for j in warms) == sorted(moved), warms  # each moved tenant warmed exactly once
    assert all(j["state"] == "done" for j in warms)
    wait_for("status of the join", lambda: status_of(kubectl, POLICY).get("epoch") == t1.epoch)
    assert pending_journal(kubectl, POLICY) is None
    wait_for("the epoch in Redis", lambda: (r := redis_table(redis_url, kubectl.namespace, POLICY)) and r[0] == t1)
    wait_for("the epoch's Event", lambda: t1.epoch in epochs_in_events(kubectl, POLICY))
    numbers = epochs_in_events(kubectl, POLICY)
    assert numbers.count(t1.epoch) == 1, numbers  # neither lost nor repeated
    return t1


@pytest.mark.parametrize("point", crashpoints.MEMBERSHIP_POINTS)
def test_operator_killed_after_each_join_side_effect_converges_to_one_epoch_warmed_once(
        operator_process, kubectl, node_agent_factory, redis_server_fn, point):
    op = operator_process.start()
    fleet, t0 = three_member_fleet(kubectl, node_agent_factory(workdir=short_workdir()), redis_server_fn.url)
    op.stop()
    op.start(crash_at=point)
    wait_for("the webhook of the restarted operator", op.webhook_listening)
    joined_at = time.time()
    fleet.add("f3")
    fleet.ready(4)
    assert op.exit_code() == crashpoints.CRASH_EXIT_CODE  # it died right after `point`
    published = affinity_table(kubectl, POLICY).epoch == t0.epoch + 1
    assert published == (crashpoints.MEMBERSHIP_POINTS.index(point) >= PUBLISHED_FROM), (point, published)

    op.start()  # a plain restart
    t1 = assert_one_join_epoch(kubectl, fleet, t0, joined_at, redis_server_fn.url)
    assert affinity_table(kubectl, POLICY) == t1  # no further epoch


def test_redis_restarted_during_a_join_warms_and_publishes_once_it_returns(
        operator, kubectl, node_agent_factory, redis_server_fn):  # noqa: F811
    fleet, t0 = three_member_fleet(kubectl, node_agent_factory(workdir=short_workdir()), redis_server_fn.url)
    assert redis_table(redis_server_fn.url, kubectl.namespace, POLICY)[0] == t0
    redis_server_fn.kill()
    joined_at = time.time()
    fleet.add("f3")
    fleet.ready(4)
    # The newcomer cannot confirm its sources while Redis is away (503, ask again): the
    # join waits in its warm-ups, journaled, instead of publishing f3 cold.
    wait_for("the join's warm-ups under way", lambda: pending_journal(kubectl, POLICY))
    assert affinity_table(kubectl, POLICY) == t0
    redis_server_fn.start()  # empty: no persistence
    t1 = assert_one_join_epoch(kubectl, fleet, t0, joined_at, redis_server_fn.url)
    assert affinity_table(kubectl, POLICY) == t1
