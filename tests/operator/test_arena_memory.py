"""The injected sidecar's memory: request = limit = arena + headroom, the headroom
overridable in the policy; the node-fit check names each node too small, with numbers."""
from __future__ import annotations

import pytest
import yaml

from kvtier import policy
from kvtier_operator import arena_memory, injection, names
from kvtier_operator.sidecar_render import sidecar_config
from operator_cases import EXAMPLES_DIR

GI = 2**30


@pytest.fixture
def spec() -> policy.KVCachePolicySpec:
    return policy.parse_policy(yaml.safe_load((EXAMPLES_DIR / "llama-70b-interactive.yaml").read_text())).spec


def pod() -> dict:
    return {"metadata": {"name": "p", "labels": {}}, "spec": {"containers": [{"name": "engine", "image": "e"}]}}


def sidecar_of(patch: dict) -> dict:
    return next(c for c in patch["spec"]["containers"] if c["name"] == names.SIDECAR_CONTAINER)


def test_injected_sidecar_requests_and_is_limited_to_the_arena_plus_headroom(spec):
    slots = sidecar_config(spec).slots
    expected = 500 * GI + arena_memory.BASE_HEADROOM_BYTES + arena_memory.PER_SLOT_HEADROOM_BYTES * slots
    resources = sidecar_of(injection.inject(pod(), "chat", spec, injection.SidecarImage()))["resources"]
    assert resources == {"requests": {"memory": str(expected)}, "limits": {"memory": str(expected)}}
    assert slots > 0 and expected > 500 * GI


def test_policy_headroom_override_replaces_the_default_and_operator_cpu_defaults_are_kept(spec):
    spec = spec.model_copy(update={"tiers": spec.tiers.model_copy(update={
        "dram": policy.DramTier(capacity="2Gi", sidecar_memory_headroom="300Mi")})})
    image = injection.SidecarImage(resources={"requests": {"cpu": "500m"}, "limits": {"memory": "1"}})
    resources = sidecar_of(injection.inject(pod(), "chat", spec, image))["resources"]
    memory = str(2 * GI + 300 * 2**20)
    assert resources == {"requests": {"cpu": "500m", "memory": memory}, "limits": {"memory": memory}}
    assert image.resources == {"requests": {"cpu": "500m"}, "limits": {"memory": "1"}}  # input untouched


def test_headroom_override_must_be_a_quantity():
    with pytest.raises(ValueError, match="sidecar_memory_headroom|sidecarMemoryHeadroom"):
        policy.DramTier.model_validate({"capacity": "1Gi", "sidecarMemoryHeadroom": "lots"})


def test_node_fit_names_each_node_too_small_with_the_numbers(spec):
    need = arena_memory.sidecar_memory_bytes(spec)
    fits = arena_memory.node_fits(spec, {"big": 2048 * GI, "small": 256 * GI})
    assert [(f.node, f.fits) for f in fits] == [("big", True), ("small", False)]
    message = arena_memory.fit_message(fits)
    assert f"node small: allocatable memory {256 * GI} bytes < {need} bytes" in message and "big" not in message
    assert arena_memory.fit_message(fits[:1]) is None


def test_a_pending_pod_is_named_only_when_nodes_match_and_none_of_them_fits(spec):
    need = arena_memory.sidecar_memory_bytes(spec)
    pending = arena_memory.pending_fits(spec, {
        "stranded": {"s1": 256 * GI, "s2": 128 * GI},  # matches nodes, none large enough
        "placeable": {"s1": 256 * GI, "b1": 2048 * GI},  # one candidate fits: the scheduler can place it
        "unmatched": {},  # no node matches its nodeSelector: not a DRAM matter
    })
    assert [(p.pod, p.stranded) for p in pending] == [("placeable", False), ("stranded", True), ("unmatched", False)]
    message = arena_memory.fit_message([], pending)
    assert f"1 pod(s) cannot be scheduled: stranded (none of s1 ({256 * GI} bytes), s2 ({128 * GI} bytes) " \
           f"holds {need} bytes)" in message
    assert "placeable" not in message and "unmatched" not in message
    assert arena_memory.fit_message([], [p for p in pending if not p.stranded]) is None


def test_many_stranded_pods_are_counted_beyond_the_named_ones(spec):
    many = {f"p{i:02d}": {"s1": GI} for i in range(arena_memory.MAX_PENDING_NAMED + 3)}
    message = arena_memory.fit_message([], arena_memory.pending_fits(spec, many))
    assert f"{arena_memory.MAX_PENDING_NAMED + 3} pod(s) cannot be scheduled" in message
    assert message.count("none of") == arena_memory.MAX_PENDING_NAMED and "and 3 more" in message
