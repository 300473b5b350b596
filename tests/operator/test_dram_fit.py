"""A policy whose DRAM tier cannot fit the allocatable memory of the nodes its pods run
on gets DramFits=False naming each node with the numbers (and an Event); one that fits
says so; a pod not scheduled yet none of whose candidate nodes (by its nodeSelector)
can hold the sidecar is named too. Real apiserver, the real operator, and nodes
registered by the node agent (512Gi allocatable) or created as Node objects."""
from __future__ import annotations

import json

from kvtier import policy
from kvtier_operator import arena_memory
from operator_harness import events, wait_for
from sidecar_fleet import serving_pod, tiny_policy
from kvtier_testenv.kubectl import Kubectl
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
    # Until the node agent binds big-0 it is a pending pod (named as such); then its node is.
    bound = f"node {agent.node_name}: allocatable memory {NODE_ALLOCATABLE} bytes < {need} bytes"
    cond = wait_for("big: DramFits False on its node", lambda: (c := dram_fits(kubectl, "big"))
                    and c["status"] == "False" and bound in c["message"] and c, timeout_s=60)
    assert cond["reason"] == "NodeTooSmall" and "cannot be scheduled" not in cond["message"]
    assert wait_for("event", lambda: events(kubectl, "big", "DramDoesNotFit"))
    ok = wait_for("small: DramFits True on its node", lambda: (c := dram_fits(kubectl, "small"))
                  and c["message"].startswith("1 node(s)") and c, timeout_s=60)
    assert ok["status"] == "True"


def node(name: str, pool: str, memory: str) -> dict:
    """A Node object as a kubelet registers it: labels and allocatable memory."""
    resources = {"memory": memory, "cpu": "8", "pods": "110"}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {POOL_LABEL: pool}},
            "status": {"capacity": resources, "allocatable": resources}}


def pod_for_pool(name: str, app: str, pool: str) -> dict:
    pod = serving_pod(name, app)
    pod["spec"]["nodeSelector"] = {POOL_LABEL: pool}
    return pod


POOL_LABEL = "kvtier.test/pool"
SMALL_NODE, BIG_NODE = 64 * 2**30, 2 * 2**40


def test_a_pending_pod_no_candidate_node_of_which_can_hold_the_sidecar_is_named(
        operator, kubectl, control_plane, namespace):
    admin = Kubectl(control_plane.kubeconfig)
    unique = namespace.rsplit("-", 1)[1]  # nodes are cluster-wide: pools of this test alone
    small, big = f"small-{unique}", f"big-{unique}"
    nodes = [node(f"{small}-a", small, "64Gi"), node(f"{small}-b", small, "64Gi"), node(f"{big}-a", big, "2Ti")]
    try:
        for n in nodes:
            admin.run("create", "-f", "-", input=json.dumps(n))
        assert admin.get_json("node", f"{small}-a")["status"]["allocatable"]["memory"] == "64Gi"
        pol = tiny_policy("big", "big", tiers={"dram": {"capacity": "600Gi"}})
        kubectl.apply(pol)
        # No node agent runs: nothing binds these pods, they stay Pending and unscheduled.
        kubectl.apply(pod_for_pool("big-0", "big", small))  # only 64Gi nodes: can never be scheduled
        kubectl.apply(pod_for_pool("big-1", "big", big))  # a 2Ti node can take it
        kubectl.apply(pod_for_pool("big-2", "big", f"none-{unique}"))  # no such node: not a DRAM matter
        need = arena_memory.sidecar_memory_bytes(policy.parse_policy(pol).spec)
        cond = wait_for("DramFits False naming the stranded pod",
                        lambda: (c := dram_fits(kubectl, "big")) and c["status"] == "False" and c, timeout_s=60)
        assert cond["reason"] == "NodeTooSmall"
        assert (f"1 pod(s) cannot be scheduled: big-0 (none of {small}-a ({SMALL_NODE} bytes), "
                f"{small}-b ({SMALL_NODE} bytes) holds {need} bytes)") in cond["message"]
        assert "big-1" not in cond["message"] and "big-2" not in cond["message"] and big not in cond["message"]
        assert wait_for("event", lambda: events(kubectl, "big", "DramDoesNotFit"))

        # The stranded pod goes: nothing is left that cannot be scheduled.
        kubectl.delete("pod", "big-0", "--grace-period=0", "--force", wait=True)
        ok = wait_for("DramFits True", lambda: (c := dram_fits(kubectl, "big")) and c["status"] == "True" and c,
                      timeout_s=60)
        assert ok["reason"] == "Fits"
    finally:
        for n in nodes:
            admin.run("delete", "node", n["metadata"]["name"], "--ignore-not-found", check=False)
