"""Policies whose selectors overlap: who owns a pod, and the condition both report. Pure.

Ownership rule (deterministic, the same in the webhook and in membership):

1. A pod injected by a policy (annotation `kvtier.io/injected-by`) belongs to that
   policy for its whole life: its sidecar runs that policy's config (model id, peer
   secret, ConfigMap), so no other policy may count it as a member. When the injecting
   policy is deleted or stops selecting it, the pod belongs to nobody until it is
   recreated; the policies that select it report it (`foreign`).
2. An uninjected pod belongs to the OLDEST selecting policy (creationTimestamp, then name): the
   policy that was there first keeps its workload, so a scale-up injects new replicas
   with the same config as their siblings even after a second, overlapping policy
   appears.

Each policy whose selector shares a pod with another reports `SelectorConflict=True`
naming the other policies, the shared pods and who owns them (and an Event when the
conflict starts); the pods it does not own are not its members.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvtier import policy

from kvtier_operator.conditions import Observation

# Shared pods named in a condition message; the rest are counted.
MAX_PODS_NAMED = 5


@dataclass(frozen=True, slots=True)
class PolicyRef:
    name: str
    created: str  # RFC 3339 creationTimestamp: sorts chronologically as text
    selector: policy.LabelSelector

    @property
    def seniority(self) -> tuple[str, str]:
        return (self.created or "~", self.name)  # unknown creation time sorts last


def owner(labels: Mapping[str, str], injected_by: str | None, policies: Iterable[PolicyRef]) -> str | None:
    """The policy that owns a pod with these labels and annotation (see module doc)."""
    selecting = sorted((p for p in policies if p.selector.matches(dict(labels))), key=lambda p: p.seniority)
    if injected_by is not None:
        return injected_by if any(p.name == injected_by for p in selecting) else None
    return selecting[0].name if selecting else None


@dataclass(frozen=True, slots=True)
class PodLabels:
    name: str
    labels: Mapping[str, str]
    injected_by: str | None


def overlaps(this: PolicyRef, pods: Iterable[PodLabels], policies: Iterable[PolicyRef]) -> dict[str, dict[str, str]]:
    """{other policy: {shared pod: its owner}} for every other policy selecting a pod
    that `this` selects too."""
    others = [p for p in policies if p.name != this.name]
    everyone = [this, *others]
    out: dict[str, dict[str, str]] = {}
    for pod in pods:
        if not this.selector.matches(dict(pod.labels)):
            continue
        for other in others:
            if other.selector.matches(dict(pod.labels)):
                out.setdefault(other.name, {})[pod.name] = owner(pod.labels, pod.injected_by, everyone) or "nobody"
    return {k: dict(sorted(v.items())) for k, v in sorted(out.items())}


def foreign(this: PolicyRef, pods: Iterable[PodLabels], policies: Iterable[PolicyRef]) -> dict[str, str]:
    """{pod: the policy that injected it} for pods `this` selects that run the sidecar of
    a policy now gone or no longer selecting them: nobody's members until recreated."""
    everyone = list(policies)
    return {pod.name: pod.injected_by for pod in sorted(pods, key=lambda p: p.name)
            if pod.injected_by is not None and this.selector.matches(dict(pod.labels))
            and owner(pod.labels, pod.injected_by, everyone) is None}


def foreign_observation(found: Mapping[str, str]) -> Observation:
    if not found:
        return Observation("ForeignSidecars", "False", "NoForeignSidecars",
                           "no selected pod runs another policy's sidecar")
    named = ", ".join(f"{pod} (injected by {by})" for pod, by in list(found.items())[:MAX_PODS_NAMED])
    more = len(found) - MAX_PODS_NAMED
    return Observation("ForeignSidecars", "True", "InjectedByAnotherPolicy",
                       f"{len(found)} selected pods run the sidecar of a policy that is gone or no longer selects "
                       f"them: {named}" + (f" and {more} more" if more > 0 else "")
                       + "; they are nobody's members until recreated (delete them or restart the workload)")


def observation(this: PolicyRef, found: Mapping[str, Mapping[str, str]]) -> Observation:
    if not found:
        return Observation("SelectorConflict", "False", "NoOverlap", "no other policy selects these pods")
    parts = []
    for other, shared in found.items():
        named = ", ".join(f"{pod} (owned by {own})" for pod, own in list(shared.items())[:MAX_PODS_NAMED])
        more = len(shared) - MAX_PODS_NAMED
        parts.append(f"policy {other} also selects {named}" + (f" and {more} more" if more > 0 else ""))
    return Observation("SelectorConflict", "True", "OverlappingSelectors",
                       "; ".join(parts) + ". A pod belongs to the policy that injected it, else to the oldest "
                       "selecting policy; narrow one selector so each pod is selected once")
