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

DramFits checks the nodes the selected pods are bound to, and, for a pod not scheduled
yet, the nodes its nodeSelector matches (affinity, taints and other pods' requests are
the scheduler's business): a pod some of whose candidate nodes exist but none of which
can hold one sidecar will never be scheduled, and is named.
"""
from __future__ import annotations

from collections.abc import Sequence
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


# Unscheduled pods named in the condition; the count covers the rest.
MAX_PENDING_NAMED = 10


@dataclass(frozen=True, slots=True)
class PendingFit:
    """A pod not scheduled yet, against the nodes its nodeSelector matches."""

    pod: str
    candidates: tuple[NodeFit, ...]

    @property
    def stranded(self) -> bool:
        """Some node matches, yet none can hold the sidecar: the scheduler never will."""
        return bool(self.candidates) and not any(c.fits for c in self.candidates)


def pending_fits(spec: policy.KVCachePolicySpec, candidates: dict[str, dict[str, int]]) -> list[PendingFit]:
    """Per unscheduled pod (pod -> its candidate nodes' allocatable memory bytes)."""
    return [PendingFit(pod, tuple(node_fits(spec, nodes))) for pod, nodes in sorted(candidates.items())]


def fit_message(fits: list[NodeFit], pending: Sequence[PendingFit] = ()) -> str | None:
    """A condition message naming every node that cannot hold the sidecar and every
    unscheduled pod no candidate node of which can, or None."""
    short = [f for f in fits if not f.fits]
    stranded = [p for p in pending if p.stranded]
    if not short and not stranded:
        return None
    parts = [f"node {f.node}: allocatable memory {f.allocatable_bytes} bytes < {f.needed_bytes} bytes "
             "(DRAM tier plus sidecar headroom)" for f in short]
    if stranded:
        named = [f"{p.pod} (none of {', '.join(f'{c.node} ({c.allocatable_bytes} bytes)' for c in p.candidates)} "
                 f"holds {p.candidates[0].needed_bytes} bytes)" for p in stranded[:MAX_PENDING_NAMED]]
        more = f" and {len(stranded) - MAX_PENDING_NAMED} more" if len(stranded) > MAX_PENDING_NAMED else ""
        parts.append(f"{len(stranded)} pod(s) cannot be scheduled: {', '.join(named)}{more}")
    return "; ".join(parts) + "; lower tiers.dram.capacity or select larger nodes"
