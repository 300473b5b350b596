"""Who serves: the ready pods a policy selects, as the operator's pod index sees them.

The index (`handlers.pods_by_namespace`) keeps one `PodView` per pod; a policy's
members are the views in its namespace that its selector picks, that are Ready, have
an IP, and are not being deleted. Pure: the handler passes the index's contents.

A member that stops serving (deleted, or no longer Ready) while still holding an IP is
a leaving candidate: if its sidecar says it is draining, or answers while the pod is
being deleted, it is a LEAVER — planned out of the next epoch, yet still the best
source to warm its tenants' new homes from.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NewType

from kvtier import policy
from kvtier.sidecar_config import SidecarConfig

from kvtier_operator.names import (
    INJECTED_ANNOTATION,
    INJECTION_SKIPPED_ANNOTATION,
    OPT_OUT_LABEL,
    SIDECAR_CONTAINER,
    WEIGHT_ANNOTATION,
)

MemberName = NewType("MemberName", str)

# Default home weight: replicas are assumed equal unless a pod says otherwise.
DEFAULT_WEIGHT = 1.0


@dataclass(frozen=True, slots=True)
class PodView:
    """The few fields of a pod that membership depends on (what the index stores)."""

    name: str
    labels: tuple[tuple[str, str], ...]
    ip: str | None
    ready: bool
    deleting: bool
    weight: float
    injected_by: str | None = None  # the policy whose sidecar the webhook injected
    node: str | None = None  # spec.nodeName once bound
    node_selector: tuple[tuple[str, str], ...] = ()  # spec.nodeSelector: where it may be scheduled
    injection_skipped: str | None = None  # "<policy>: <why>": admitted without the sidecar
    namespace: str = ""
    # "<reason>: <message>" while the injected sidecar container cannot run (its image
    # missing, a crash loop, a bad config): kubelet's own words, from the pod's status.
    sidecar_problem: str | None = None

    def selected_by(self, selector: policy.LabelSelector) -> bool:
        return selector.matches(dict(self.labels))

    @property
    def serving(self) -> bool:
        return self.ready and bool(self.ip) and not self.deleting


@dataclass(frozen=True, slots=True)
class Member:
    name: MemberName
    ip: str
    weight: float
    namespace: str = ""  # the pod's: its sidecar's token audience names it
    # The policy that injected the pod's sidecar: the name its control certificate carries.
    policy: str = ""

    def http_url(self, port: int = SidecarConfig.model_fields["http_port"].default, tls: bool = True) -> str:
        return f"{'https' if tls else 'http'}://{self.ip}:{port}"

    def peer_address(self, port: int = SidecarConfig.model_fields["peer_port"].default) -> str:
        return f"{self.ip}:{port}"


def pod_view(body: Mapping[str, Any]) -> PodView:
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    try:
        weight = float((meta.get("annotations") or {}).get(WEIGHT_ANNOTATION, DEFAULT_WEIGHT))
    except ValueError:
        weight = DEFAULT_WEIGHT
    if not weight > 0:
        weight = DEFAULT_WEIGHT
    return PodView(
        name=meta.get("name", ""),
        labels=tuple(sorted((meta.get("labels") or {}).items())),
        ip=status.get("podIP") or None,
        ready=ready and status.get("phase") == "Running",
        deleting=bool(meta.get("deletionTimestamp")),
        weight=weight,
        injected_by=(meta.get("annotations") or {}).get(INJECTED_ANNOTATION),
        node=(body.get("spec") or {}).get("nodeName") or None,
        node_selector=tuple(sorted(((body.get("spec") or {}).get("nodeSelector") or {}).items())),
        injection_skipped=(meta.get("annotations") or {}).get(INJECTION_SKIPPED_ANNOTATION),
        namespace=meta.get("namespace", ""),
        sidecar_problem=sidecar_problem(status),
    )


# Waiting reasons that mean the container will not run until someone acts (kubelet keeps
# retrying, so none of them ends by itself): ContainerCreating and PodInitializing are
# the normal start.
STUCK_REASONS = frozenset({
    "ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName", "CrashLoopBackOff",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError", "PreCreateHookError",
    "PostStartHookError",
})
MAX_PROBLEM_CHARS = 300


def sidecar_problem(status: Mapping[str, Any]) -> str | None:
    """Why the pod's sidecar container is stuck (waiting for a reason in STUCK_REASONS),
    as kubelet says it, or None. It is an init container when native, else a container."""
    for c in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        if c.get("name") != SIDECAR_CONTAINER:
            continue
        waiting = (c.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason") or ""
        if reason not in STUCK_REASONS:
            return None
        message = waiting.get("message") or ""
        if not message and reason == "CrashLoopBackOff":
            last = (c.get("lastState") or {}).get("terminated") or {}
            message = f"last exit {last.get('exitCode')} ({last.get('reason') or 'no reason'})" if last else ""
        return f"{reason}: {message}"[:MAX_PROBLEM_CHARS] if message else reason
    return None


def members(views: Iterable[PodView], selector: policy.LabelSelector) -> dict[MemberName, Member]:
    """The serving members, by pod name (the affinity table's member names)."""
    out = {
        MemberName(v.name): Member(MemberName(v.name), v.ip or "", v.weight, v.namespace, v.injected_by or "")
        for v in views
        if v.serving and v.selected_by(selector)
    }
    return dict(sorted(out.items()))


def leaving(views: Iterable[PodView], selector: policy.LabelSelector,
            previous: Iterable[str]) -> dict[MemberName, Member]:
    """Pods in the `previous` (published) member set that no longer serve but still
    have an IP: candidates to warm from before they go (their sidecars decide)."""
    was = set(previous)
    out = {
        MemberName(v.name): Member(MemberName(v.name), v.ip or "", v.weight, v.namespace, v.injected_by or "")
        for v in views
        if v.name in was and v.ip and not v.serving and v.selected_by(selector)
    }
    return dict(sorted(out.items()))


def weights(members_: Mapping[MemberName, Member]) -> dict[str, float]:
    return {name: m.weight for name, m in members_.items()}


def uninjected(views: Iterable[PodView], selector: policy.LabelSelector) -> list[str]:
    """Selected pods, not leaving, that run without the sidecar (no injected-by
    annotation and not opted out): the webhook was unreachable when they were created."""
    return sorted(v.name for v in views
                  if v.selected_by(selector) and not v.deleting and v.injected_by is None
                  and dict(v.labels).get(OPT_OUT_LABEL) != "false")


def skipped(views: Iterable[PodView], selector: policy.LabelSelector, policy_name: str) -> dict[str, str]:
    """Selected pods admitted without the sidecar because `policy_name`'s config was
    invalid when they were created: pod -> what the webhook said to fix."""
    prefix = f"{policy_name}: "
    return {v.name: v.injection_skipped[len(prefix):] for v in sorted(views, key=lambda v: v.name)
            if v.injection_skipped and v.injection_skipped.startswith(prefix) and v.injected_by is None
            and not v.deleting and v.selected_by(selector)}


def stuck_sidecars(views: Iterable[PodView], selector: policy.LabelSelector) -> dict[str, str]:
    """Selected pods (not leaving) whose sidecar container cannot run: pod -> why."""
    return {v.name: v.sidecar_problem for v in sorted(views, key=lambda v: v.name)
            if v.sidecar_problem and v.selected_by(selector) and not v.deleting}


def nodes(views: Iterable[PodView], selector: policy.LabelSelector) -> list[str]:
    """The nodes the selected pods are bound to."""
    return sorted({v.node for v in views if v.node and v.selected_by(selector) and not v.deleting})


def unscheduled(views: Iterable[PodView], selector: policy.LabelSelector) -> dict[str, tuple[tuple[str, str], ...]]:
    """Selected pods not bound to a node yet (not leaving), with their nodeSelector."""
    return {v.name: v.node_selector for v in sorted(views, key=lambda v: v.name)
            if v.node is None and v.selected_by(selector) and not v.deleting}
