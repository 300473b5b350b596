"""The periodic fleet hit-rate refresh: `status.fleetHitRate` (the HitRate column of
`kubectl get kvcp`) follows steady traffic, not only membership changes.

One pass reads each member's stats (one small `GET /cache/stats` each, bounded
concurrency in `SidecarClient.fleet_stats`) and patches status only when the rounded
rate changed. A pass takes the policy's status lock after whoever holds it (the
membership reconcile or the rollout tick); asyncio's lock is first come, first served,
so a namespace whose pods change all the time still gets its refresh in turn (kopf
never runs two passes of one timer at once, so waiting cannot pile them up)."""
from __future__ import annotations

import logging
from typing import Any

from kvtier import policy

from kvtier_operator import membership
from kvtier_operator.kube import Kube
from kvtier_operator.registry import PolicyEntry
from kvtier_operator.sidecar_client import FleetStats, SidecarClient

log = logging.getLogger("kvtier.operator")

# How often the hit rate is refreshed: a person watching `kubectl get kvcp` sees new
# hits within seconds, and each pass costs one small stats request per member.
HIT_RATE_REFRESH_S = 5.0
# Digits kept in status: finer changes are noise and would only churn status writes.
HIT_RATE_DIGITS = 4


def changed_fields(old: policy.KVCachePolicyStatus, stats: FleetStats) -> dict[str, Any] | None:
    """The status fields to write for this fleet's stats; None when nothing changed
    (no answer, no lookups yet, or the same rounded rate as in status)."""
    rate = stats.hit_rate
    if rate is None:
        return None
    rounded = round(rate, HIT_RATE_DIGITS)
    if old.fleet_hit_rate is not None and round(old.fleet_hit_rate, HIT_RATE_DIGITS) == rounded:
        return None
    return {"fleetHitRate": rounded}


async def refresh(kube: Kube, sidecars: SidecarClient, namespace: str, name: str,
                  views: list[membership.PodView], entry: PolicyEntry) -> bool:
    """One refresh pass; True when it wrote status."""
    async with entry.lock:
        body = await kube.read_policy(namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return False
        try:
            spec = policy.KVCachePolicySpec.model_validate(body.get("spec") or {})
            old = policy.KVCachePolicyStatus.model_validate(body.get("status") or {})
        except ValueError:
            return False  # an invalid policy: reconcile_spec reports it
        members = membership.members(views, spec.selector)
        if not members:
            return False
        fields = changed_fields(old, await sidecars.fleet_stats(members))
        if fields is None:
            return False
        await kube.patch_status(namespace, name, fields)
        log.debug("fleet hit rate of %s/%s: %s", namespace, name, fields["fleetHitRate"])
        return True
