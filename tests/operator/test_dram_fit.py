"""A policy whose DRAM tier cannot fit the allocatable memory of the nodes its pods run
on gets DramFits=False naming each node with the numbers (and an Event); one that fits
says so. Real apiserver, the real operator, and nodes registered by the node agent
(512Gi allocatable)."""
from __future__ import annotations

from kvtier import policy
from kvtier_operator import arena_memory
from operator_harness import events, wait_for
from sidecar_fleet import serving_pod, tiny_policy
from test_operator_e2e import short_workdir, status_of

NODE_ALLOCATABLE = 512 * 2**30


def dram_fits(kubectl, name: str) -> dict | None:
    return next((c for c in status_of(kubectl, name).get("conditions", []) if c["type"] == "DramFits"), None)


def test_dram_tier_larger_than_the_nodes_allocatable_memory_is_a_condition_with_the_numbers(
        operator, kubectl, node_agent_factory):
    agent = node_agent_factory(workdir=short_workdir())
    big = tiny_policy("big", "big", tiers={"dram": {"capacity": "600Gi"}})
    kubectl.apply(big)
    kubectl.apply(tiny_policy("small", "small"))
    kubectl.apply(serving_pod("big-0", "big"))
    kubectl.apply(serving_pod("small-0", "small"))
    need = arena_memory.sidecar_memory_bytes(policy.parse_policy(big).spec)
    cond = wait_for("big: DramFits False", lambda: (c := dram_fits(kubectl, "big")) and c["status"] == "False" and c,
                    timeout_s=60)
    assert cond["reason"] == "NodeTooSmall"
    assert f"node {agent.node_name}: allocatable memory {NODE_ALLOCATABLE} bytes < {need} bytes" in cond["message"]
    assert wait_for("event", lambda: events(kubectl, "big", "DramDoesNotFit"))
    ok = wait_for("small: DramFits True on its node", lambda: (c := dram_fits(kubectl, "small"))
                  and c["message"].startswith("1 node(s)") and c, timeout_s=60)
    assert ok["status"] == "True"
