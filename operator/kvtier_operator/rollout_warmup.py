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
published table with the pod as a member), each tenant's hottest prefixes read from its
current homes on the old version (`sources`; their sidecars' `GET /cache/hot`; pods
already on the new version when no old one holds the tenant), merged
and ranked by frequency x length (`rank`), the pod's `maxTokens` split over its tenants
(`spend`: an even share each, what a tenant cannot use goes to the others), replayed as
prompts through the pod's own engine within `timeout`. The gate is then released
whatever happened (`outcome`): Warmed, WarmupFailed (the engine refused or could not be
reached), WarmupTimedOut. A pod never stays gated because its warm-up went wrong.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvtier.affinity import AffinityTable

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
class Prompt:
    """One prefix to replay: its token ids and its decayed hit frequency."""

    tokens: tuple[int, ...]
    frequency: float

    @property
    def value(self) -> float:
        """The prefill a hit on it saves per unit of time: frequency x length."""
        return self.frequency * len(self.tokens)


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


def tenants_of_pod(table: AffinityTable | None, pod: str, weight: float, tenants: Iterable[str]) -> list[str]:
    """The tenants whose homes include `pod` once it serves: the published table with
    the pod as a member (while it is gated it may have left the table)."""
    if table is None:
        return []
    joined = table.model_copy(update={"members": {**table.members, pod: table.members.get(pod, weight)}})
    return sorted(t for t in set(tenants) if pod in joined.homes_for(t))


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


def rank(answers: Iterable[Sequence[Prompt]]) -> list[Prompt]:
    """Several sources' prompts as one list: the same token ids once (the highest
    frequency seen), best first by frequency x length, ties longer first."""
    best: dict[tuple[int, ...], float] = {}
    for answer in answers:
        for p in answer:
            if p.tokens:
                best[p.tokens] = max(best.get(p.tokens, 0.0), p.frequency)
    return sorted((Prompt(t, f) for t, f in best.items()), key=lambda p: (-p.value, -len(p.tokens), p.tokens))


def shares(max_tokens: int, tenants: Sequence[str]) -> dict[str, int]:
    """An even split of the pod's budget, the remainder to the first tenants by name."""
    ordered = sorted(tenants)
    if not ordered or max_tokens <= 0:
        return {t: 0 for t in ordered}
    base, extra = divmod(max_tokens, len(ordered))
    return {t: base + (i < extra) for i, t in enumerate(ordered)}


def _take(prompts: Sequence[Prompt], budget: int, taken: set[tuple[int, ...]]) -> tuple[list[Prompt], int]:
    out, spent = [], 0
    for p in prompts:
        if p.tokens in taken or spent + len(p.tokens) > budget:
            continue
        out.append(p)
        taken.add(p.tokens)
        spent += len(p.tokens)
    return out, spent


def spend(ranked: Mapping[str, Sequence[Prompt]], max_tokens: int) -> dict[str, list[Prompt]]:
    """Each tenant's prompts within the pod's budget: first its even share (`shares`),
    then what the tenants left unspent, offered again in name order. Never more than
    `max_tokens` prompt tokens in all, never a prompt twice."""
    share = shares(max_tokens, list(ranked))
    chosen: dict[str, list[Prompt]] = {}
    taken: dict[str, set[tuple[int, ...]]] = {t: set() for t in ranked}
    left = 0
    for t in sorted(ranked):
        chosen[t], spent = _take(ranked[t], share[t], taken[t])
        left += share[t] - spent
    for t in sorted(ranked):
        if left <= 0:
            break
        more, spent = _take(ranked[t], left, taken[t])
        chosen[t] += more
        left -= spent
    return chosen


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


def ask_tokens(max_tokens: int, tenants: int) -> int:
    """How many tokens to ask each tenant's sources for: twice its even share (room
    for what the others leave), never more than the whole budget."""
    if tenants <= 0 or max_tokens <= 0:
        return 0
    return min(max_tokens, 2 * -(-max_tokens // tenants))


def replay_order(chosen: Mapping[str, Sequence[Prompt]]) -> list[tuple[str, Prompt]]:
    """Every chosen prompt, the most valuable first whatever its tenant: a deadline
    that cuts the warm-up short cuts the least valuable ones."""
    pairs = [(t, p) for t in sorted(chosen) for p in chosen[t]]
    return sorted(pairs, key=lambda tp: (-tp[1].value, tp[0], tp[1].tokens))


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
