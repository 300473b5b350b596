"""Memory accounting for the DRAM tier: what the injected sidecar container requests
and is limited to, and whether that fits the nodes it lands on. Pure.

The arena lives in a memory-backed emptyDir that the sidecar fills at start-up
(`posix_fallocate`), so its pages are charged to the sidecar container's cgroup. The
container therefore requests and is limited to the arena plus headroom for the process
itself, so the scheduler reserves the host DRAM and the kubelet never meets a pod far
larger than it was told:

    memory = arena bytes + headroom
    headroom = spec.tiers.dram.sidecarMemoryHeadroom
               or BASE_HEADROOM_BYTES + PER_SLOT_HEADROOM_BYTES x arena slots

The request equals the limit (Guaranteed memory): the arena is preallocated, so the
sidecar's footprint does not grow past it under load.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier import policy

from kvtier_operator.sidecar_render import sidecar_config

# The sidecar process beyond its arena: measured at ~48 MiB (Python, numpy, aiohttp,
# redis client, 8 peer-fetch threads) with a 64 MiB arena full; 128 MiB leaves 2.5x.
BASE_HEADROOM_BYTES = 128 << 20
# Per arena slot: its radix-tree node, block-pool entry and checksum (a few hundred
# bytes in Python objects), with margin.
PER_SLOT_HEADROOM_BYTES = 1024


def headroom_bytes(spec: policy.KVCachePolicySpec) -> int:
    override = spec.tiers.dram.sidecar_memory_headroom
    if override is not None:
        return policy.parse_quantity_bytes(override)
    return headroom_for_slots(sidecar_config(spec).slots)


def headroom_for_slots(slots: int) -> int:
    return BASE_HEADROOM_BYTES + PER_SLOT_HEADROOM_BYTES * slots


def sidecar_memory_bytes(spec: policy.KVCachePolicySpec) -> int:
    return policy.parse_quantity_bytes(spec.tiers.dram.capacity) + headroom_bytes(spec)


def sidecar_resources(spec: policy.KVCachePolicySpec) -> dict[str, Any]:
    """The injected container's `resources` (memory; CPU is left to the cluster's defaults)."""
    memory = str(sidecar_memory_bytes(spec))
    return {"requests": {"memory": memory}, "limits": {"memory": memory}}


@dataclass(frozen=True, slots=True)
class NodeFit:
    node: str
    allocatable_bytes: int
    needed_bytes: int  # the sidecar alone, per pod of this policy on the node

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.allocatable_bytes


def node_fits(spec: policy.KVCachePolicySpec, allocatable: dict[str, int]) -> list[NodeFit]:
    """Per node (name -> allocatable memory bytes): does one sidecar of this policy fit?"""
    need = sidecar_memory_bytes(spec)
    return [NodeFit(node, alloc, need) for node, alloc in sorted(allocatable.items())]


def fit_message(fits: list[NodeFit]) -> str | None:
    """A condition message naming every node that cannot hold the sidecar, or None."""
    short = [f for f in fits if not f.fits]
    if not short:
        return None
    return "; ".join(f"node {f.node}: allocatable memory {f.allocatable_bytes} bytes < {f.needed_bytes} bytes "
                     "(DRAM tier plus sidecar headroom)" for f in short) + \
        "; lower tiers.dram.capacity or select larger nodes"
