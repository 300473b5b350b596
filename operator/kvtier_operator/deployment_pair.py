"""Deployment rollouts as a stable/canary pair: pure.

A StatefulSet rolls by partition; a Deployment cannot keep two versions, so the operator
runs a second Deployment, `<name>-kvtier-canary` (owned by the user's Deployment, its
pods labelled kvtier.io/track=canary), with the new weights version, and moves
replicas between the two. The rollout planner (`rollout.plan`) sees the pair as the
same `Workload` it sees for a StatefulSet:

    replicas          the fleet size R, fixed when the canary is created (annotation
                      kvtier.io/fleet-replicas on the canary)
    template_version  the canary's version while it exists, else the stable's
    partition         the stable's replicas (pods still on the old version)

and asks for the same `WorkloadPatch(version, partition)`. `converge` turns a patch
into Deployment writes without a zero-ready window: the side that grows is scaled up
first; the side that shrinks is scaled down only once the growing side has as many
ready pods as it wants. So a step never removes old pods before the new ones serve,
and a rollback never removes the canary before the stable fleet is back.

Three shapes of patch:
    version == the stable's   -> stable R, canary gone (steady, or a rollback)
    rollout in flight          -> stable = partition, canary = R - partition on version
    completed (not in flight)  -> hand back: the stable takes the new version and R pods
                                  (its new pods warm from the canary's through the peer
                                  tier), then the canary goes, once its pods' first minute
                                  of traffic is measured (`first_minute.measuring`)
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from kvtier_operator import names
from kvtier_operator.rollout import Workload, WorkloadPatch

CANARY_SUFFIX = "-kvtier-canary"
FLEET_ANNOTATION = f"{names.PREFIX}/fleet-replicas"
TRACK_LABEL = f"{names.PREFIX}/track"
CANARY_TRACK = "canary"


def canary_name(stable: str) -> str:
    return f"{stable}{CANARY_SUFFIX}"


def is_canary(pod: dict[str, Any]) -> bool:
    """A pod of the canary Deployment (its template's track label)."""
    return ((pod.get("metadata") or {}).get("labels") or {}).get(TRACK_LABEL) == CANARY_TRACK


@dataclass(frozen=True, slots=True)
class Side:
    replicas: int
    ready: int
    version: str | None


@dataclass(frozen=True, slots=True)
class Pair:
    stable: Side
    canary: Side | None
    fleet: int  # R

    @property
    def workload(self) -> Workload:
        if self.canary is None or self.canary.version == self.stable.version:
            return Workload(self.fleet, self.stable.version, 0)
        return Workload(self.fleet, self.canary.version, self.stable.replicas)


@dataclass(frozen=True, slots=True)
class Writes:
    """What to do to the pair this tick (None / False: nothing)."""

    stable: dict[str, Any] | None = None  # merge patch of the stable Deployment
    canary_create: dict[str, Any] | None = None  # a canary Deployment to create
    canary: dict[str, Any] | None = None  # merge patch of the existing canary
    canary_delete: bool = False

    @property
    def empty(self) -> bool:
        return self.stable is None and self.canary_create is None and self.canary is None and not self.canary_delete


def side(deployment: dict[str, Any] | None) -> Side | None:
    if deployment is None:
        return None
    spec, status = deployment.get("spec") or {}, deployment.get("status") or {}
    return Side(int(spec.get("replicas", 1)), int(status.get("readyReplicas") or 0), template_version(deployment))


def template_version(deployment: dict[str, Any]) -> str | None:
    meta = ((deployment.get("spec") or {}).get("template") or {}).get("metadata") or {}
    return (meta.get("annotations") or {}).get(names.WEIGHTS_VERSION_ANNOTATION)


def pair_of(stable: dict[str, Any], canary: dict[str, Any] | None) -> Pair:
    s, c = side(stable), side(canary)
    assert s is not None
    fleet = s.replicas
    if canary is not None:
        annotated = ((canary.get("metadata") or {}).get("annotations") or {}).get(FLEET_ANNOTATION)
        fleet = int(annotated) if annotated and annotated.isdigit() else s.replicas + (c.replicas if c else 0)
    return Pair(s, c, fleet)


def converge(pair: Pair, patch: WorkloadPatch, in_flight: bool, stable: dict[str, Any],
             measuring: bool = False) -> Writes:
    """The writes that move the pair toward `patch`, growing before shrinking.
    `measuring`: canary pods are in their first minute of traffic (`first_minute`); at a
    hand-back the canary then stays until they are measured (the last step's figure is
    theirs), while the stable serves beside it. A rollback never waits for them."""
    r = pair.fleet
    if patch.template_version == pair.stable.version:
        handing_back = pair.canary is not None and pair.canary.version == pair.stable.version
        return _toward(pair, stable_want=r, canary_want=0, version=None, stable=stable,
                       keep_canary=measuring and handing_back)
    if in_flight or patch.partition > 0:
        return _toward(pair, stable_want=patch.partition, canary_want=r - patch.partition,
                       version=patch.template_version, stable=stable)
    # Completed: the stable takes the new version (it holds no pods now, or only new
    # ones), grows back to R, and the canary goes once the stable serves.
    return Writes(stable=_scaled_to(r, patch.template_version))


def _toward(pair: Pair, stable_want: int, canary_want: int, version: str | None, stable: dict[str, Any],
            keep_canary: bool = False) -> Writes:
    s, c = pair.stable, pair.canary
    stable_patch = canary_patch = create = None
    delete = False
    # Grow first.
    if s.replicas < stable_want:
        stable_patch = {"spec": {"replicas": stable_want}}
    if canary_want > 0:
        if c is None:
            create = canary_manifest(stable, version or "", canary_want, pair.fleet)
        elif c.replicas < canary_want or (version is not None and c.version != version):
            canary_patch = _scaled_to(max(c.replicas, canary_want), version or c.version or "")
    # Shrink only behind the other side's ready pods.
    canary_ready = c.ready if c is not None and (version is None or c.version == version) else 0
    if s.replicas > stable_want and canary_ready >= canary_want:
        stable_patch = {"spec": {"replicas": stable_want}}
    if c is not None and s.ready >= stable_want:
        if canary_want == 0:
            delete = not keep_canary
        elif c.replicas > canary_want:
            canary_patch = _scaled_to(canary_want, version or c.version or "")
    return Writes(stable_patch, create, canary_patch, delete)


def _scaled_to(replicas: int, version: str) -> dict[str, Any]:
    """Replicas and pod-template version in one merge patch."""
    return {"spec": {"replicas": replicas,
                     "template": {"metadata": {"annotations": {names.WEIGHTS_VERSION_ANNOTATION: version}}}}}


def canary_manifest(stable: dict[str, Any], version: str, replicas: int, fleet: int) -> dict[str, Any]:
    """The canary: the stable's pod template on `version`, its pods told apart by the
    track label, owned by the stable Deployment (deleting it deletes the canary)."""
    meta, spec = stable["metadata"], stable.get("spec") or {}
    template = copy.deepcopy(spec.get("template") or {})
    tmeta = template.setdefault("metadata", {})
    tmeta.setdefault("labels", {})[TRACK_LABEL] = CANARY_TRACK
    tmeta.setdefault("annotations", {})[names.WEIGHTS_VERSION_ANNOTATION] = version
    selector = copy.deepcopy(spec.get("selector") or {})
    selector.setdefault("matchLabels", {})[TRACK_LABEL] = CANARY_TRACK
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {
            "name": canary_name(meta["name"]), "namespace": meta["namespace"],
            "labels": {**(meta.get("labels") or {}), TRACK_LABEL: CANARY_TRACK},
            "annotations": {FLEET_ANNOTATION: str(fleet)},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"],
                                 "uid": meta["uid"], "controller": False, "blockOwnerDeletion": False}],
        },
        "spec": {"replicas": replicas, "selector": selector, "template": template,
                 **({"strategy": spec["strategy"]} if spec.get("strategy") else {})},
    }
