"""Graceful leave against the real apiserver: a deleted pod stays Terminating while its
sidecar drains; the operator plans the epoch without it, warms each moved tenant's new
homes FROM IT (the only pod that held the tenant), publishes, then releases it."""
from __future__ import annotations

import time

from kvtier import routing
from kvtier_operator import injection, names
from operator_harness import wait_for
from sidecar_fleet import tiny_policy
from test_operator_e2e import (EpochWatcher,
                               Fleet, PROMPTS, affinity_table, new_warm_jobs, short_workdir,
                               wait_table)

TENANTS = [f"leave-{i:02d}" for i in range(24)]
OCCUPANCY = 0.5  # every home equally (and lightly) loaded: pick() is the first home


def first_home(table, tenant: str) -> str:
    return routing.pick(tenant, table, {m: OCCUPANCY for m in table.members}).member


def test_leaver_warms_its_tenants_new_first_homes_before_the_epoch_and_exits_within_grace(
        operator, kubectl, node_agent_factory, api_client):
    fleet = Fleet(kubectl, node_agent_factory(workdir=short_workdir()), "leave", "leave")
    kubectl.apply(tiny_policy("leave", "leave", affinity={"homes": 2, "warmTimeout": "30s"}))
    # The operator is serving (and so is its webhook) once it rendered the ConfigMap.
    wait_for("sidecar ConfigMap", lambda: kubectl.run(
        "get", "configmap", names.sidecar_config_map("leave"), check=False).returncode == 0)
    fleet.add("g0", "g1", "g2")
    fleet.ready(3)
    t0 = wait_table(kubectl, "leave", 3)
    # Each tenant is seeded on its first home only: a tenant whose first home leaves
    # is cold everywhere else, so only a warm-up from the leaver can make it hit.
    for t in TENANTS:
        fleet.sidecar(first_home(t0, t)).seed(t, PROMPTS)
    seeded, t0 = t0, fleet.learn_tenants(len(TENANTS))
    leaver = "g1"
    leaver_ip = fleet.sidecar(leaver).ip
    grace = kubectl.get_json("pod", leaver)["spec"]["terminationGracePeriodSeconds"]
    assert grace >= injection.sidecar_grace_s()
    process = fleet.agent.process(kubectl.namespace, leaver, "kvtier-sidecar")
    # The leaver's own tenants: seeded on it and homed as they were seeded. Learning the
    # tenants can move some by bounded loads (the operator then warms their new homes),
    # and a moved tenant is held by more than the leaver, which is not this test's case.
    own = [t for t in TENANTS if first_home(t0, t) == leaver and seeded.homes_for(t) == t0.homes_for(t)]
    assert own, "no tenant's first home is the leaver; pick other names"

    watcher = EpochWatcher(api_client, kubectl.namespace, "leave")
    try:
        deleted_at, deleted_mono = time.time(), time.monotonic()
        kubectl.delete("pod", leaver)
        t1 = wait_table(kubectl, "leave", 2, epoch=t0.epoch + 1)
        wait_for("epoch seen", lambda: t1.epoch in watcher.first_seen)
        published_at = watcher.first_seen[t1.epoch]
    finally:
        watcher.stop()
    assert leaver not in t1.members
    moved = [t for t in TENANTS if t0.homes_for(t) != t1.homes_for(t)]
    assert set(own) <= set(moved)
    for t in own:
        home = fleet.sidecar(first_home(t1, t))
        assert home.holds(t, PROMPTS), f"{t} is cold on its new first home {home.name}"
        jobs = [j for j in new_warm_jobs(home, deleted_at) if j["tenant"] == t]
        assert jobs and all(j["from_peer"].rsplit(":", 1)[0] == leaver_ip for j in jobs), jobs
        assert all(j["state"] == "done" and j["finished_s"] < published_at for j in jobs), jobs

    # Released after publication, the leaver exits cleanly (not SIGKILLed) within its
    # grace period, and only then does its pod object go.
    code = process.proc.wait(timeout=grace)
    assert code == 0, f"sidecar exit status {code}"
    wait_for("the pod object gone", lambda: leaver not in [
        p["metadata"]["name"] for p in kubectl.get_json("pods", "-l", "app=leave")["items"]], timeout_s=grace)
    assert time.monotonic() - deleted_mono < grace
    assert affinity_table(kubectl, "leave").epoch == t1.epoch
