"""Warm-before-ready, the I/O (the decisions are `rollout_warmup`'s, pure).

On every rollout tick (`reconcile`, under the policy's status lock) each gated pod of
the policy is released or warmed. A warm-up runs as a task of its own, so the tick
stays short: it takes the pod's own snapshot (`rollout_snapshot`: its own sidecar's
hot list, read before the partition moved past it; first source of each tenant it
holds) and reads the tenants' hottest prefixes from the old version's sidecars
(`SidecarClient.hot`, authenticated like every control call), picks the best across
the pod's tenants within its budget (`rollout_warmup.plan`), replays them as prompts
through the new pod's engine — POST http://<podIP>:<enginePort>/v1/completions with
`{"model", "prompt": [token ids], "max_tokens": 1, "cache_salt": <tenant>,
"kv_transfer_params": {"kvtier": {"purpose": "warmup"}}}` (`warmup_request`), the salt
the connector reads the tenant from — so the engine prefills them and its sidecar
stores their KV under the new version. The `kv_transfer_params` marker
(`names.warmup_kv_transfer_params`) travels with the request to the connector and on
to the sidecar's lookup: the warm-up's lookups (misses by design) are counted apart
and never in the new version's hit rate (`kvtier_warmup_lookups_total`, not
`kvtier_lookups_total`) (most valuable first, a few in flight;
after `MAX_ENGINE_FAILURES` refusals with nothing warmed it gives up). Within the
policy's budget and deadline; then the outcome is recorded in `status.rollout.warmups` (and an Event), and
the gate released, in that order: a restart in between warms the pod again, which its
engine answers from its cache.

Never stuck: a warm-up that fails or runs out of time releases the gate; one whose pod
left the rollout (a rollback, a superseded target) is cancelled and the gate released
at once; a restarted operator warms again the pods whose gate is still closed; a
deleted policy releases every gate of its pods (`release_all`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from datetime import datetime, timezone
from typing import Any

import aiohttp

from kvtier import policy

from kvtier_operator import deployment_pair, economics, events, names, publish, rollout_snapshot
from kvtier_operator import rollout_warmup as rw
from kvtier_operator.membership import Member, MemberName, pod_view

log = logging.getLogger("kvtier.operator.warmup")

COMPLETIONS_PATH = "/v1/completions"
# One source sidecar's answer: small and local, like stats.
HOT_TIMEOUT_S = 5.0
# Sources asked per tenant: its first two old homes (their prefixes are merged).
SOURCES_PER_TENANT = 2
# Requests in flight per warm-up: to the sources' sidecars, and prompts to the engine
# (an engine batches concurrent prefills; a few keep it busy without crowding it).
HOT_IN_FLIGHT = 8
PREFILLS_IN_FLIGHT = 4


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _tasks(memo, namespace: str, policy_name: str) -> dict[str, asyncio.Task]:
    """This process's warm-ups of one policy, by pod uid (`memo.warmups`)."""
    everything = memo.get("warmups")
    if everything is None:
        everything = memo["warmups"] = {}
    return everything.setdefault((namespace, policy_name), {})


async def stop_all(memo) -> None:
    """The operator is stopping: its warm-ups end (a successor warms those pods again),
    and no tick starts another (the HTTP session is about to close: a warm-up started
    now would fail at once and release its pod cold)."""
    memo["warmups_stopped"] = True
    for tasks in (memo.get("warmups") or {}).values():
        for uid in list(tasks):
            await _cancel(tasks, uid)


async def _policy_pods(kube, namespace: str, policy_name: str) -> list[dict[str, Any]]:
    return await kube.list_pods(namespace, f"{names.INJECTED_LABEL}={names.injected_label_value(policy_name)}")


async def reconcile(memo, body: dict[str, Any], status: policy.KVCachePolicyStatus | None = None) -> None:
    """One pass over the policy's gated pods: release or start warming each (see
    `rollout_warmup.decide`); cancel warm-ups whose pod no longer needs one."""
    if memo.get("warmups_stopped"):
        return  # the operator is stopping: its successor decides
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    try:
        spec = policy.KVCachePolicySpec.model_validate(body["spec"])
    except ValueError:
        spec = None
    if status is None:
        try:
            status = policy.KVCachePolicyStatus.model_validate(body.get("status") or {})
        except ValueError:
            status = policy.KVCachePolicyStatus()
    r = status.rollout
    in_flight = r is not None and r.target_version is not None and status.phase in ("RollingOut", "Paused")
    tasks = _tasks(memo, namespace, name)
    pods = await _policy_pods(memo.kube, namespace, name)
    warming: set[str] = set()
    for pod in pods:
        uid = pod["metadata"]["uid"]
        d = rw.decide(pod, warms=spec is not None and spec.rollout.warms, in_flight=in_flight,
                      target=r.target_version if r else None, old=status.version)
        if d.kind == "warm" and spec is not None:
            warming.add(uid)
            if uid not in tasks:
                log.info("warming %s/%s before it takes traffic (budget %d tokens, %s)", namespace,
                         pod["metadata"]["name"], pod_budget(spec).tokens, spec.rollout.warmup.timeout)
                tasks[uid] = asyncio.create_task(_warm_pod(memo, body, spec, status.version, pod),
                                                 name=f"warm-{namespace}/{pod['metadata']['name']}")
        elif d.kind == "wait":
            warming.add(uid)
        elif d.kind == "release":
            await _cancel(tasks, uid)
            await _release(memo.kube, pod, d.reason, d.message)
    # Finished; or the pod is gone or no longer to be warmed (a rollback): stop now.
    for uid in [u for u, t in tasks.items() if u not in warming or t.done()]:
        await _cancel(tasks, uid)


async def release_all(memo, namespace: str, policy_name: str, reason: str = rw.POLICY_DELETED) -> int:
    """Release the gate of every pod of the policy (it is being deleted): nothing may
    wait on a warm-up no operator will run. Returns how many were released."""
    tasks = _tasks(memo, namespace, policy_name)
    count = 0
    for pod in await _policy_pods(memo.kube, namespace, policy_name):
        await _cancel(tasks, pod["metadata"]["uid"])
        if rw.gated(pod) and not rw.released(pod):
            count += await _release(memo.kube, pod, reason, f"policy {policy_name} is being deleted: released")
    for uid in list(tasks):
        await _cancel(tasks, uid)
    (memo.get("warmups") or {}).pop((namespace, policy_name), None)
    rollout_snapshot.store(memo).drop_policy(namespace, policy_name)
    return count


async def _cancel(tasks: dict[str, asyncio.Task], uid: str) -> None:
    task = tasks.pop(uid, None)
    if task is not None and not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _release(kube, pod: dict[str, Any], reason: str, text: str) -> bool:
    meta = pod["metadata"]
    done = await kube.patch_pod_condition(meta["namespace"], meta["name"], meta["uid"],
                                          rw.condition(reason, text, _now()))
    if done:
        log.info("readiness gate %s of %s/%s released: %s", rw.GATE, meta["namespace"], meta["name"], text)
    return done


@dataclasses.dataclass(slots=True)
class _Progress:
    """A warm-up's running count (kept when the deadline cuts it short)."""

    tokens: int = 0
    prompts: int = 0
    failed: int = 0
    failures_in_a_row: int = 0
    warmed_tenants: set[str] = dataclasses.field(default_factory=set)
    tenants: int = 0
    engine_error: str = ""
    source_error: str = ""

    def tally(self, timed_out: bool) -> rw.Tally:
        return rw.Tally(tokens=self.tokens, prompts=self.prompts, failed_prompts=self.failed,
                        tenants=len(self.warmed_tenants), cold_tenants=max(0, self.tenants - len(self.warmed_tenants)),
                        timed_out=timed_out, engine_error=self.engine_error, source_error=self.source_error)


def pod_budget(spec: policy.KVCachePolicySpec) -> rw.Budget:
    """The policy's maxTokens capped by the capacity estimate (`rollout_warmup.budget`)."""
    warmup = spec.rollout.warmup
    assert warmup is not None
    return rw.budget(warmup.max_tokens, warmup.timeout_s, economics.replica_prefill_tokens_per_s(spec))


async def _warm_pod(memo, body: dict[str, Any], spec: policy.KVCachePolicySpec, old: str | None,
                    pod: dict[str, Any]) -> None:
    warmup = spec.rollout.warmup
    assert warmup is not None
    budget = pod_budget(spec)
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    started = time.monotonic()
    progress = _Progress()
    timed_out = False
    try:
        async with asyncio.timeout(warmup.timeout_s):
            await _warm(memo, namespace, name, spec, old, pod, progress, budget.tokens)
    except TimeoutError:
        timed_out = True
    except Exception as exc:  # noqa: BLE001 - whatever broke, the gate is released below
        log.exception("warm-up of %s/%s failed", namespace, pod["metadata"]["name"])
        progress.engine_error = progress.engine_error or f"{type(exc).__name__}: {exc}"
        progress.failed = max(progress.failed, 1)
    if memo.get("warmups_stopped"):
        return  # stopped under it (the session closed): the gate stays for the successor
    seconds = time.monotonic() - started
    tally = progress.tally(timed_out)
    reason = rw.outcome(tally)
    text = rw.message(tally, reason, budget.tokens, seconds) + f" (budget: {rw.budget_text(budget, warmup.timeout_s)})"
    await _record(memo, body, pod, tally, reason, text[:1024], budget, seconds)
    if (metrics := memo.get("rollout_metrics")) is not None:
        metrics.warmed(namespace, name, reason, tally.tokens)
    rollout_snapshot.used(memo, namespace, name, pod)
    await _release(memo.kube, pod, reason, text)


async def _warm(memo, namespace: str, policy_name: str, spec: policy.KVCachePolicySpec, old: str | None,
                pod: dict[str, Any], progress: _Progress, budget: int) -> None:
    warmup = spec.rollout.warmup
    assert warmup is not None
    pod_name = pod["metadata"]["name"]
    table = publish.read_table(await memo.kube.read_config_map(namespace, names.affinity_config_map(policy_name)))
    members: dict[str, Member] = {}  # every serving pod but this one; those on the old version first
    old_names: list[str] = []
    joining = 0  # a Deployment pair's canary pods not serving yet, this one included
    for p in await _policy_pods(memo.kube, namespace, policy_name):
        v = pod_view(p)
        if v.serving and v.name != pod_name:
            members[v.name] = Member(MemberName(v.name), v.ip or "", v.weight, namespace, v.injected_by or "")
            if rw.pod_version(p) == old:
                old_names.append(v.name)
        elif deployment_pair.is_canary(p) and not v.serving and not v.deleting:
            joining += 1
    # A canary pod's step then scales the stable Deployment (the serving pods on the old
    # version) down by as many pods as it adds: their tenants may land on this pod, and
    # only its own engine can warm them (their old homes hold the old version's blocks).
    leaving = joining if deployment_pair.is_canary(pod) else 0
    # The pod's own hot list from before it restarted: first source of each tenant in it.
    own = rollout_snapshot.own_prompts(memo, namespace, policy_name, pod) or {}
    stats = await memo.sidecars.fleet_stats(members)
    if not members and not own:
        progress.source_error = "no other pod serving to read the tenants' prefixes from"
    elif members and not stats.per_member and not own:
        progress.source_error = f"none of the {len(members)} serving sidecars answered"
    holders: dict[str, list[str]] = {}
    for s in stats.per_member:
        for t in s.tenants:
            holders.setdefault(t, []).append(s.member)
    weight = pod_view(pod).weight
    known = set(holders) | set(own)
    # The tenants it serves (or may gain) and their weights, in one pass over the table.
    weights = rw.home_weights(table, pod_name, weight, known, leaving, old_names) if table is not None else {}
    tenants = sorted(weights) if table is not None else sorted(known)
    progress.tenants = len(tenants)
    ask = rw.ask_tokens(budget, len(tenants))
    gate = asyncio.Semaphore(HOT_IN_FLIGHT)

    async def prompts_of(tenant: str) -> list[rw.Prompt]:
        mine = own.get(tenant)  # this tenant's only: a snapshot is kept per tenant
        answers = []
        for source in rw.sources(table, tenant, pod_name, old_names, holders.get(tenant, []),
                                 members)[:SOURCES_PER_TENANT - (mine is not None)]:
            async with gate:
                hot = await memo.sidecars.hot(members[source], tenant, ask, HOT_TIMEOUT_S)
            if hot is not None:
                answers.append([rw.Prompt(tuple(p.token_ids), p.frequency) for p in hot.prefixes])
        if not answers and mine is None:
            progress.source_error = progress.source_error or f"no source answered for tenant {tenant}"
        return rw.tenant_prompts(mine, answers, weights.get(tenant, 1.0), spec.block_size)

    ranked = dict(zip(tenants, await asyncio.gather(*(prompts_of(t) for t in tenants))))
    # Each tenant's weight is in its prompts' frequencies (`tenant_prompts`).
    queue = rw.plan({t: (1.0, ranked[t]) for t in tenants}, budget, spec.block_size)
    url = f"http://{pod['status']['podIP']}:{warmup.engine_port}{COMPLETIONS_PATH}"
    model = warmup.served_model_name or spec.model.id
    # A prompt that reuses an earlier one's prefix waits for it: the engine then finds
    # that prefix cached instead of computing it twice side by side.
    finished = [asyncio.Event() for _ in queue]
    pending = iter(enumerate(queue))

    async def worker() -> None:
        for i, item in pending:  # shared: each prompt is taken by one worker
            try:
                if progress.failures_in_a_row >= rw.MAX_ENGINE_FAILURES and not progress.prompts:
                    return  # the engine is down or refusing: WarmupFailed, without the whole deadline
                if item.after is not None:
                    await finished[item.after].wait()
                if await _prefill(memo.http, url, model, item.tenant, item.prompt, progress):
                    progress.tokens += item.new_tokens
                    progress.prompts += 1
                    progress.warmed_tenants.add(item.tenant)
            finally:
                finished[i].set()

    await asyncio.gather(*(worker() for _ in range(PREFILLS_IN_FLIGHT)))


def warmup_request(model: str, tenant: str, tokens) -> dict[str, Any]:
    """The completion request that prefills one prompt on the engine being warmed,
    marked as the warm-up (`kv_transfer_params`) so it is not counted as traffic."""
    return {"model": model, "prompt": list(tokens), "max_tokens": 1, "cache_salt": tenant,
            names.KV_TRANSFER_PARAMS_FIELD: names.warmup_kv_transfer_params()}


async def _prefill(http: aiohttp.ClientSession, url: str, model: str, tenant: str, prompt: rw.Prompt,
                   progress: _Progress) -> bool:
    body = warmup_request(model, tenant, prompt.tokens)
    try:
        async with http.post(url, json=body) as resp:
            if 200 <= resp.status < 300:
                await resp.read()
                progress.failures_in_a_row = 0
                return True
            progress.engine_error = f"HTTP {resp.status} {(await resp.text())[:160]}"
    except (aiohttp.ClientError, ValueError) as exc:
        progress.engine_error = f"{type(exc).__name__}: {exc}"[:200]
    progress.failed += 1
    progress.failures_in_a_row += 1
    return False


async def _record(memo, body: dict[str, Any], pod: dict[str, Any], tally: rw.Tally, reason: str, text: str,
                  budget: rw.Budget, seconds: float) -> None:
    """The pod's outcome into status.rollout.warmups (newest kept) and an Event, under
    the policy's status lock (the rollout tick writes status.rollout too)."""
    from kvtier_operator.registry import PolicyKey

    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    record = policy.PodWarmup(
        pod=pod["metadata"]["name"], version=rw.pod_version(pod) or "", outcome=reason, tokens=tally.tokens,
        prompts=tally.prompts, tenants=tally.tenants, cold_tenants=tally.cold_tenants, budget_tokens=budget.tokens,
        capacity_tokens=budget.capacity_tokens,
        seconds=round(seconds, 2), finished_at=datetime.now(timezone.utc).replace(microsecond=0), message=text)
    try:
        async with memo.policies.lock(PolicyKey(namespace, name)):
            current = await memo.kube.read_policy(namespace, name)
            if current is None:
                return
            rollout = (current.get("status") or {}).get("rollout") or {}
            kept = [w for w in rollout.get("warmups") or [] if w.get("pod") != record.pod]
            warmups = (kept + [record.k8s_json()])[-policy.MAX_WARMUPS:]
            await memo.kube.patch_status(namespace, name, {"rollout": {"warmups": warmups}})
        kind = "Normal" if reason == rw.WARMED else "Warning"
        await memo.kube.create_event_once(events.once(current, f"warm/{pod['metadata']['uid']}", kind,
                                                      f"Pod{reason}", f"pod {record.pod}: {text}"))
    except Exception as exc:  # noqa: BLE001 - the record is for people; the gate must still be released
        log.warning("warm-up record of %s/%s not written: %s", namespace, pod["metadata"]["name"], exc)
