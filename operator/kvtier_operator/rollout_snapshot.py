"""Warm-before-ready's first source: the restarted pod's OWN sidecar, read before it
restarts (issue #24).

With affinity routing a tenant's traffic goes to its first home, so its hot prefixes
live there — on the very pod a rollout step restarts; its other homes hold little of
it. So before the operator moves a StatefulSet's partition past a pod (and on every
tick after, for a pod past the partition still on the old version that has none, e.g.
after an operator restart), it reads that pod's own sidecar: its tenants (`GET
/cache/stats`) whose homes include it, each one's hottest prefixes (`GET /cache/hot`,
the control API's auth, asked for `rollout_warmup.ask_tokens` like every source), and
keeps what the pod's budget could replay from them (`warmup_plan.keep_own`). The
pod's warm-up, once it runs the new version, takes that snapshot as each tenant's
first source (`rollout_warmup_io`), then the tenant's other homes as before.

Held in this process's memory only, never written anywhere: the token ids are the
tenants' prompts (their data), so they never go into a ConfigMap, Secret, the
policy's status or an Event, and they are kept per tenant (a tenant's snapshot only
ever feeds that tenant's warm-up, replayed under its own cache_salt). Bounded: at most
`MAX_TOKENS` token ids in all (oldest snapshots dropped first), each dropped after
`TTL_S` or once its pod's warm-up ends. A snapshot that is missing — the operator
restarted after the pod did, the sidecar did not answer, the read ran past
`READ_TIMEOUT_S` — is no error: the warm-up reads the other homes as it always did,
within the same deadline, once. Each pod is read once per restart (an empty answer is
kept as empty), so a silent sidecar does not slow every tick.
"""
from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtier import policy
from kvtier.affinity import AffinityTable

from kvtier_operator import names, publish, rollout
from kvtier_operator import rollout_warmup as rw
from kvtier_operator.membership import Member, MemberName, pod_view

log = logging.getLogger("kvtier.operator.warmup")

# The whole read of a step's pods, every sidecar together: the step's partition patch
# waits at most this long (a sidecar's stats answer is bounded at 3 s, like every
# control call; what has not answered by then is left out, and its pod warms from the
# other homes).
READ_TIMEOUT_S = 2.0
# Hot-list requests in flight at once for a snapshot (each answer is small and local),
# and pods read at once (a pod's raw answers are held until cut down to what it keeps).
HOT_IN_FLIGHT = 8
PODS_IN_FLIGHT = 4
# Reads of one pod the deadline may cut before it is given up (kept empty: warmed from
# the other homes), so a slow sidecar costs a few ticks' READ_TIMEOUT_S, not every tick's.
MAX_TRIES = 2
# Token ids held in all, every policy's snapshots together: 8 M ids, 64 MiB as int64.
# The default budget (65,536 tokens) keeps ~0.1-0.2 M per pod (`keep_own`), so a step
# of ~40-80 pods fits; past it the oldest snapshots go (those pods warm as before).
MAX_TOKENS = 8_000_000
# Keys whose reads are counted (`Snapshots.tried`): the oldest forgotten past it.
MAX_KEYS = 100_000
# A snapshot not used within this long is stale (a paused rollout, a pod that never
# restarted): dropped.
TTL_S = 3600.0


Key = tuple[str, str, str, str]
"""(namespace, policy, pod name, target version)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One pod's own hot prompts, read while it ran the old version (`uid`)."""

    uid: str
    taken: float  # time.monotonic()
    prompts: Mapping[str, tuple[tuple[array, float], ...]]  # tenant -> (token ids, frequency)

    @property
    def tokens(self) -> int:
        return sum(len(t) for ps in self.prompts.values() for t, _ in ps)

    def for_tenants(self) -> dict[str, list[rw.Prompt]]:
        """tenant -> its prompts, as the plan takes them."""
        return {t: [rw.Prompt(tuple(ids), f) for ids, f in ps] for t, ps in self.prompts.items()}


class Snapshots:
    """This process's snapshots, bounded by `max_tokens` and `ttl_s` (see the module doc)."""

    def __init__(self, max_tokens: int = MAX_TOKENS, ttl_s: float = TTL_S) -> None:
        self.max_tokens, self.ttl_s = max_tokens, ttl_s
        self._held: OrderedDict[Key, Snapshot] = OrderedDict()
        self._tokens = 0
        self._tries: OrderedDict[Key, int] = OrderedDict()  # reads begun, per key (bounded below)

    def __len__(self) -> int:
        return len(self._held)

    @property
    def tokens(self) -> int:
        return self._tokens

    def put(self, key: Key, snap: Snapshot) -> bool:
        """Keep `snap` (replacing the key's), dropping the oldest past the bound; False
        when it alone is over the bound (not kept)."""
        self.drop(key)
        n = snap.tokens
        if n > self.max_tokens:
            return False
        while self._held and self._tokens + n > self.max_tokens:
            self.drop(next(iter(self._held)))
        self._held[key] = snap
        self._tokens += n
        return True

    def get(self, key: Key, now: float | None = None) -> Snapshot | None:
        self.expire(time.monotonic() if now is None else now)
        return self._held.get(key)

    def has(self, key: Key, uid: str) -> bool:
        """A snapshot of this very pod (`uid`) for the key is held."""
        snap = self.get(key)
        return snap is not None and snap.uid == uid

    def wants(self, key: Key, uid: str) -> bool:
        """This pod (`uid`) is still to be read for the key: none held of it, and fewer
        than `MAX_TRIES` reads begun."""
        return not self.has(key, uid) and self._tries.get(key, 0) < MAX_TRIES

    def tried(self, key: Key) -> None:
        """A read of the key begins (counted; a read cut by the deadline stores nothing)."""
        self._tries[key] = self._tries.pop(key, 0) + 1
        while len(self._tries) > MAX_KEYS:
            self._tries.popitem(last=False)

    def drop(self, key: Key) -> None:
        self._tries.pop(key, None)
        snap = self._held.pop(key, None)
        if snap is not None:
            self._tokens -= snap.tokens

    def drop_policy(self, namespace: str, policy_name: str) -> None:
        for key in [k for k in self._held if k[:2] == (namespace, policy_name)]:
            self.drop(key)
        for key in [k for k in self._tries if k[:2] == (namespace, policy_name)]:
            del self._tries[key]

    def expire(self, now: float) -> None:
        for key in [k for k, s in self._held.items() if now - s.taken > self.ttl_s]:
            self.drop(key)


def store(memo) -> Snapshots:
    """The operator's snapshots (`memo.own_snapshots`), made on first use."""
    held = memo.get("own_snapshots")
    if held is None:
        held = memo["own_snapshots"] = Snapshots()
    return held


def due(pods: Iterable[Mapping[str, Any]], patch: rollout.WorkloadPatch) -> list[Mapping[str, Any]]:
    """The pods the StatefulSet controller restarts onto `patch.template_version` once
    `patch` is applied (or already is): ordinal >= its partition, on another version,
    serving (their sidecar holds what their traffic asked for), not being deleted."""
    out = []
    for p in pods:
        v = pod_view(p)
        if (rollout.ordinal(v.name) >= patch.partition and rw.pod_version(p) != patch.template_version
                and v.serving and v.ip):
            out.append(p)
    return out


async def take(memo, namespace: str, policy_name: str, spec: policy.KVCachePolicySpec,
               table: AffinityTable | None, pods: Iterable[Mapping[str, Any]], target: str,
               timeout_s: float | None = None) -> int:
    """Read and keep the own snapshot of each of `pods` (about to restart onto
    `target`) that has none yet, all within `timeout_s` (`READ_TIMEOUT_S`); returns how
    many were kept with prompts. Highest ordinal first (the StatefulSet controller
    restarts that one first), `PODS_IN_FLIGHT` at a time, each pod's answers cut down
    to what it keeps (`keep_own`) as soon as they are in, so what is held meanwhile is
    a few pods' hot lists. A pod read to the end is kept, even empty (its sidecar held
    nothing, or did not answer: it is not read again on every tick); one the deadline
    cut is read again on a later tick, `MAX_TRIES` times in all. Never raises for a
    sidecar's sake."""
    timeout_s = READ_TIMEOUT_S if timeout_s is None else timeout_s
    held = store(memo)
    wanted = sorted((p for p in pods if held.wants((namespace, policy_name, p["metadata"]["name"], target),
                                                     p["metadata"].get("uid", ""))),
                    key=lambda p: -rollout.ordinal(p["metadata"]["name"]))
    if not wanted or spec.rollout.warmup is None:
        return 0
    from kvtier_operator.rollout_warmup_io import pod_budget

    budget = pod_budget(spec).tokens
    pods_gate, hot_gate = asyncio.Semaphore(PODS_IN_FLIGHT), asyncio.Semaphore(HOT_IN_FLIGHT)
    kept: list[str] = []

    async def one(pod: Mapping[str, Any]) -> None:
        v = pod_view(pod)
        key = (namespace, policy_name, v.name, target)
        held.tried(key)
        member = Member(MemberName(v.name), v.ip or "", v.weight, namespace, v.injected_by or "")
        answers: dict[str, list[rw.Prompt]] = {}
        async with pods_gate:
            stats = (await memo.sidecars.fleet_stats({v.name: member})).per_member
            held_tenants = stats[0].tenants if stats else ()
            tenants = rw.tenants_of_pod(table, v.name, v.weight, held_tenants) if table is not None else \
                sorted(held_tenants)
            ask = rw.ask_tokens(budget, len(tenants))

            async def hot(tenant: str) -> None:
                async with hot_gate:
                    got = await memo.sidecars.hot(member, tenant, ask, timeout_s)
                # `hot` refuses an answer naming another tenant: a tenant's ids stay its own.
                if got is not None and got.prefixes:
                    answers[tenant] = [rw.Prompt(tuple(p.token_ids), p.frequency) for p in got.prefixes]
            await asyncio.gather(*(hot(t) for t in tenants))
        chosen = rw.keep_own(answers, budget, spec.block_size)
        snap = Snapshot(pod["metadata"].get("uid", ""), time.monotonic(),
                        {t: tuple((array("q", p.tokens), p.frequency) for p in ps) for t, ps in chosen.items()})
        if held.put(key, snap) and chosen:
            kept.append(v.name)

    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*(one(p) for p in wanted))
    except TimeoutError:
        log.info("own-sidecar snapshots of %s/%s cut at %.1fs: the pods not read are tried again on the next "
                 "tick, or warm from the other homes", namespace, policy_name, timeout_s)
    if kept:
        log.info("own-sidecar snapshots of %s/%s for %s: %d of %d pods (%d token ids held in all)", namespace,
                 policy_name, target, len(kept), len(wanted), held.tokens)
    return len(kept)


async def before_patch(memo, body: dict[str, Any], spec: policy.KVCachePolicySpec,
                       patch: rollout.WorkloadPatch, pods: Iterable[Mapping[str, Any]]) -> int:
    """`rollout_reconcile`'s hook, before it patches the partition (and on every tick of
    a rollout in flight): snapshot the pods `patch` moves onto the target."""
    if not spec.rollout.warms:
        return 0
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    moving = due(pods, patch)
    if not moving:
        return 0
    try:
        table = publish.read_table(await memo.kube.read_config_map(namespace, names.affinity_config_map(name)))
        return await take(memo, namespace, name, spec, table, moving, patch.template_version)
    except Exception as exc:  # noqa: BLE001 - a snapshot is an optimisation: the step goes on without it
        log.warning("own-sidecar snapshots of %s/%s not taken: %s", namespace, name, exc)
        return 0


def own_prompts(memo, namespace: str, policy_name: str, pod: Mapping[str, Any]) -> dict[str, list[rw.Prompt]] | None:
    """The snapshot kept for `pod` (now on its target version) from before it restarted;
    None if there is none."""
    target = rw.pod_version(pod)
    if target is None:
        return None
    snap = store(memo).get((namespace, policy_name, pod["metadata"]["name"], target))
    if snap is None or snap.uid == pod["metadata"].get("uid"):
        return None  # none, or taken of this very pod (not before its restart)
    return snap.for_tenants()


def used(memo, namespace: str, policy_name: str, pod: Mapping[str, Any]) -> None:
    """The pod's warm-up is over: its snapshot is not needed again."""
    target = rw.pod_version(pod)
    if target is not None:
        store(memo).drop((namespace, policy_name, pod["metadata"]["name"], target))
