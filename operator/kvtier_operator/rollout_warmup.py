"""Warm-before-ready, the pure part: which gated pods to warm or release, which tenants
a pod serves, where their hottest prefixes come from, how a pod's budget is spent, and
what the gate says afterwards. The I/O is `rollout_warmup_io`.

With `spec.rollout.warmup` (and a `workloadRef`) the webhook gives every pod of the
policy the readiness gate `kvtier.io/warm` (`injection.warm_gated`): the pod is Ready
only once the operator sets that pod condition True. Per gated pod, on every rollout
tick (`decide`):

    gate already True                              -> nothing
    warm-up off now (warmup removed, maxTokens 0)  -> release, reason WarmupOff
    not moved by a rollout in flight (the first
      creation, no rollout, a pod back on the old
      version, a rollback)                         -> release, reason NotRolledOut
    moved to the target, containers not up yet    -> wait (the engine cannot prefill)
    moved to the target, containers up            -> warm it

Warming a pod: the tenants whose homes include it (`tenants_of_pod`: rendezvous over the
published table with the pod as a member), each weighted by the pod's rank in its homes
(`home_weights`: full weight where it is the tenant's first home, which gets the
tenant's traffic; `OTHER_HOME_WEIGHT` elsewhere). A Deployment pair's canary pod also
gets the tenants it may gain when the step then scales the stable Deployment down
(`maybe_home`, weighted by the chance: the ReplicaSet controller picks the stable pods
that go, and a membership warm-up copies only the old version's blocks, which a
new-version pod cannot use). Each tenant's hottest prefixes taken
first from the pod's OWN sidecar, read before it restarted (`rollout_snapshot`; at
`OWN_WEIGHT`: that frequency is the pod's own traffic), then read from its current
homes on the old version (`sources`; their sidecars' `GET /cache/hot`, each asked for
at least `ASK_FLOOR_TOKENS`; pods already on the new version when no old one holds the
tenant), two sources in all, cut to the prefixes they share, weighted and merged
(`tenant_prompts`), then all the tenants' prompts in one pool and
the pod's `maxTokens` spent greedily on the best by weight x frequency x the tokens
not already warmed (`plan`), replayed as prompts through the pod's own engine within
`timeout`, most valuable first. The gate is then released
whatever happened (`outcome`): Warmed, WarmupFailed (the engine refused or could not be
reached), WarmupTimedOut. A pod never stays gated because its warm-up went wrong.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvtier.affinity import AffinityTable
from kvtier.warmup_plan import (ASK_FLOOR_TOKENS, OTHER_HOME_WEIGHT, OWN_WEIGHT, Planned,  # noqa: F401 (re-exported)
                                 Prompt, ask_tokens, cut_to_shared, keep_own, plan, rank, tenant_prompts)

from kvtier_operator import names

GATE = names.WARM_GATE
WARMED = "Warmed"
FAILED = "WarmupFailed"
TIMED_OUT = "WarmupTimedOut"
NOT_ROLLED_OUT = "NotRolledOut"
WARMUP_OFF = "WarmupOff"
POLICY_DELETED = "PolicyDeleted"
# Engine answers in a row that fail, with nothing warmed yet, before the warm-up gives
# up as WarmupFailed (an engine that is down does not get the whole deadline).
MAX_ENGINE_FAILURES = 3


@dataclass(frozen=True, slots=True)
class Decision:
    kind: Literal["none", "wait", "warm", "release"]
    reason: str = ""
    message: str = ""


def gated(pod: Mapping[str, Any]) -> bool:
    return any(g.get("conditionType") == GATE for g in (pod.get("spec") or {}).get("readinessGates") or [])


def gate_condition(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == GATE), None)


def released(pod: Mapping[str, Any]) -> bool:
    return (gate_condition(pod) or {}).get("status") == "True"


def containers_up(pod: Mapping[str, Any]) -> bool:
    """Running with an IP and every container ready: the engine can take a prompt."""
    status = pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    return (status.get("phase") == "Running" and bool(status.get("podIP")) and bool(statuses)
            and all(s.get("ready") for s in statuses))


def pod_version(pod: Mapping[str, Any]) -> str | None:
    return ((pod.get("metadata") or {}).get("annotations") or {}).get(names.WEIGHTS_VERSION_ANNOTATION)


def decide(pod: Mapping[str, Any], *, warms: bool, in_flight: bool, target: str | None,
           old: str | None) -> Decision:
    """What to do with one pod's gate now (see the module doc). `in_flight`: a rollout
    towards `target` is RollingOut or Paused; `old`: the version the fleet served."""
    if not gated(pod) or released(pod) or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return Decision("none")
    if not warms:
        return Decision("release", WARMUP_OFF, "spec.rollout.warmup is off: released without a warm-up")
    version = pod_version(pod)
    if not in_flight or target is None or version != target or target == old:
        return Decision("release", NOT_ROLLED_OUT,
                        f"not moved by a rollout in flight (pod on {version or 'no version'}): no warm-up needed")
    if not containers_up(pod):
        return Decision("wait")
    return Decision("warm")


def tenants_of_pod(table: AffinityTable | None, pod: str, weight: float, tenants: Iterable[str],
                   leaving: int = 0, removable: Iterable[str] = ()) -> list[str]:
    """The tenants whose homes include `pod` once it serves: the published table with
    the pod as a member (while it is gated it may have left the table); with `leaving`,
    also those it may gain when the step removes that many of the `removable` members
    (`maybe_home`)."""
    return sorted(home_weights(table, pod, weight, tenants, leaving, removable))


def maybe_home(order: Sequence[str], homes: Sequence[str], pod: str, leaving: int, removable: set[str]) -> float:
    """The chance that `pod`, not among a tenant's `homes`, becomes one when the step
    removes `leaving` members picked from `removable` (a Deployment pair's step: the
    ReplicaSet controller picks which stable pods go): it must rank within the homes
    plus `leaving` in the tenant's rendezvous `order`, and one of its homes must go.
    0.0 when it cannot."""
    if leaving <= 0 or pod not in order or pod in homes or order.index(pod) >= len(homes) + leaving:
        return 0.0
    ahead = sum(1 for m in homes if m in removable)
    n, k = len(removable), min(leaving, len(removable))
    if ahead == 0 or k == 0:
        return 0.0
    return 1.0 - math.comb(n - ahead, k) / math.comb(n, k)


def sources(table: AffinityTable | None, tenant: str, pod: str, old_members: Iterable[str],
            holders: Iterable[str], new_members: Iterable[str] = ()) -> list[str]:
    """Where `tenant`'s hottest prefixes are read (token ids: the same whatever the
    weights): its homes on the old version first (in its rendezvous order), then any
    other old-version pod holding some of it, then pods already serving the new version
    that hold some (the last old pod of a fleet has no old peer left). Never the pod
    being warmed."""
    old, new = set(old_members) - {pod}, set(new_members) - {pod} - set(old_members)
    held = list(dict.fromkeys(holders))
    order = table.order_for(tenant) if table is not None else []

    def rank(m: str) -> tuple[int, str]:
        return (order.index(m) if m in order else len(order), m)

    homes = [m for m in (table.homes_for(tenant) if table is not None else []) if m in old]
    rest = sorted((m for m in held if m in old and m not in homes), key=rank)
    return homes + rest + sorted((m for m in held if m in new), key=rank)


def home_weights(table: AffinityTable | None, pod: str, weight: float, tenants: Iterable[str],
                 leaving: int = 0, removable: Iterable[str] = ()) -> dict[str, float]:
    """Each tenant's weight on `pod` (the published table with the pod as a member):
    1.0 where the pod is its first home, `OTHER_HOME_WEIGHT` where it is another home;
    with `leaving`, `OTHER_HOME_WEIGHT` x the chance it becomes a home when the step
    removes that many `removable` members (`maybe_home`); tenants it is no home of, and
    cannot become one of, are left out."""
    if table is None:
        return {}
    joined = table.model_copy(update={"members": {**table.members, pod: table.members.get(pod, weight)}})
    gone = set(removable) - {pod}
    out = {}
    for t in sorted(set(tenants)):
        homes = joined.homes_for(t)
        if pod in homes:
            out[t] = 1.0 if homes[0] == pod else OTHER_HOME_WEIGHT
        elif leaving and (chance := maybe_home(joined.order_for(t), homes, pod, leaving, gone)) > 0:
            out[t] = OTHER_HOME_WEIGHT * chance
    return out


# A warm-up's budget fills at most this share of its deadline at the engine's estimated
# prefill rate (the break-even arithmetic's peak figure): the rest is margin for what
# the estimate leaves out (attention, scheduling, the sources' answers), so a budget the
# estimate allows does not run into the deadline.
DEADLINE_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class Budget:
    """A new pod's warm-up budget: `tokens` = min(the policy's `max_tokens`,
    `capacity_tokens`); `capacity_tokens` None where there is no estimate."""

    tokens: int
    max_tokens: int
    capacity_tokens: int | None
    tokens_per_s: float

    @property
    def by_capacity(self) -> bool:
        return self.capacity_tokens is not None and self.capacity_tokens < self.max_tokens


def budget(max_tokens: int, timeout_s: float, replica_tokens_per_s: float) -> Budget:
    """What a new pod may prefill before it takes traffic: the policy's `maxTokens`,
    capped by what the capacity estimate says its engine can absorb within the
    warm-up's deadline. The pod takes no traffic while gated, so its whole prefill rate
    (one replica's recompute rate, `replica_tokens_per_s`, the figure the step's
    cold-cache prefill is stated in) is the warm-up's, for `DEADLINE_SHARE` of the
    deadline; the rest of the fleet serves as before. No estimate (rate 0): maxTokens."""
    max_tokens = max(0, max_tokens)
    if replica_tokens_per_s <= 0 or timeout_s <= 0:
        return Budget(max_tokens, max_tokens, None, 0.0)
    capacity = int(replica_tokens_per_s * timeout_s * DEADLINE_SHARE)
    return Budget(min(max_tokens, capacity), max_tokens, capacity, replica_tokens_per_s)


def budget_text(b: Budget, timeout_s: float) -> str:
    """Where the budget comes from, for the capacity-event message and the pod's record."""
    if b.capacity_tokens is None:
        return f"policy maxTokens {b.max_tokens:,}; no capacity estimate"
    estimate = (f"capacity estimate {b.capacity_tokens:,} = {b.tokens_per_s:,.0f} prefill tokens/s x "
                f"{timeout_s:g}s x {DEADLINE_SHARE:g}")
    if b.by_capacity:
        return f"{estimate}, under policy maxTokens {b.max_tokens:,}"
    return f"policy maxTokens {b.max_tokens:,}, within the {estimate}"


@dataclass(frozen=True, slots=True)
class Tally:
    """What one pod's warm-up did."""

    tokens: int = 0
    prompts: int = 0
    failed_prompts: int = 0
    tenants: int = 0
    cold_tenants: int = 0
    timed_out: bool = False
    engine_error: str = ""
    source_error: str = ""  # no old-version sidecar to read the prefixes from


def outcome(t: Tally) -> str:
    """The gate's reason: out of time first; with nothing warmed, an engine that
    refused or could not be reached, or no source that answered, is a failure;
    anything else (some prompts warmed, or nothing the tenants cached) is Warmed."""
    if t.timed_out:
        return TIMED_OUT
    if not t.prompts and (t.failed_prompts or t.source_error):
        return FAILED
    return WARMED


def message(t: Tally, reason: str, budget: int, seconds: float) -> str:
    text = (f"{reason}: {t.tokens} prompt tokens ({t.prompts} prompts) of {budget} prefilled for {t.tenants} "
            f"tenants in {seconds:.1f}s; {t.cold_tenants} tenants cold")
    if t.failed_prompts:
        text += f"; {t.failed_prompts} prompts failed"
    if t.engine_error:
        text += f" (engine: {t.engine_error})"
    if t.source_error:
        text += f" (sources: {t.source_error})"
    return text[:1024]


def condition(reason: str, text: str, now_rfc3339: str) -> dict[str, Any]:
    """The gate's pod condition: always True (released); the reason says how."""
    return {"type": GATE, "status": "True", "reason": reason, "message": text[:1024],
            "lastTransitionTime": now_rfc3339, "lastProbeTime": None}
