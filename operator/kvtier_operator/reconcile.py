"""The two reconcilers the handlers call, kept out of the kopf decorators so each step
reads top to bottom:

- `reconcile_spec`: sidecar ConfigMap + tier verdicts + conditions (create/update/resume)
- `reconcile_membership`: members (+ leavers) -> plan -> warm-ups -> publish ->
  release the leavers -> status + Event

A leaver is a published member whose pod stopped serving (deleted, or not Ready) while
its sidecar still answers stats with `draining: true`, or answers at all while the pod
is being deleted (a native sidecar drains only once the engine has exited): it is
planned out of the new epoch, but its moved tenants' new homes warm from it first (it
held them), falling back to a surviving old home; once the epoch is published it is
told it may go (`POST /cache/drain/done`; one not draining yet ends its drain once idle).

Both are idempotent: run twice on the same world they write nothing the second time.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable

import kopf
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from kvtier import policy
from kvtier.sidecar_config import SidecarConfig
from kvtier.affinity import AffinityTable, load_imbalance, plan_membership_change

from kvtier_operator import (arena_memory, conditions, conflicts, crashpoints, economics, epoch, events, membership, names,
                             netpol, publish, sidecar_render, warmup)
from kvtier_operator.kube import Kube
from kvtier_operator.registry import PolicyState
from kvtier_operator.sidecar_client import FleetStats, SidecarClient

# 256 bits of key for the peer handshake's HMAC-SHA256.
PEER_SECRET_BYTES = 32
log = logging.getLogger("kvtier.operator")

# Rollout phases belong to the rollout controller; membership never overwrites them.
_ROLLOUT_PHASES = {"RollingOut", "Paused", "RolledBack"}
EventFn = Callable[[str, str, str], None]  # (type, reason, message)


def _status(body: dict[str, Any]) -> policy.KVCachePolicyStatus:
    try:
        return policy.KVCachePolicyStatus.model_validate(body.get("status") or {})
    except ValueError:
        return policy.KVCachePolicyStatus()


async def reconcile_spec(kube: Kube, body: dict[str, Any], event: EventFn,
                         access: netpol.SidecarAccess | None = None) -> dict[str, Any]:
    """Render the sidecar config (and, given `access`, the NetworkPolicy guarding the
    sidecars' ports) and the tier verdicts. Returns the status fields to set."""
    meta = body["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation")
    try:
        spec = policy.KVCachePolicySpec.model_validate(body.get("spec") or {})
    except ValueError as exc:
        raise kopf.PermanentError(f"spec is invalid: {exc}") from exc
    old = _status(body)

    measured = _measured_nvme(old) if spec.tiers.nvme.mode != "off" else None
    tiers, observed = economics.verdicts(spec, measured)
    _post_verdict_changes(old, tiers, event)
    fields: dict[str, Any] = {"observedGeneration": generation, "tiers": [v.k8s_json() for v in tiers]}
    failure = await _write_sidecar_config(kube, body, spec, fields)
    if spec.tiers.peer.enabled:
        await kube.create_secret_if_absent(_adopted(peer_secret(name, namespace), body))
    if access is not None:
        cfg = SidecarConfig()  # the ports the webhook injects
        await kube.apply_network_policy(_adopted(netpol.sidecar_network_policy(
            name, namespace, spec.selector, cfg.http_port, cfg.peer_port, access), body))
    if failure is None:
        observed += [conditions.Observation("SidecarConfigRendered", "True", "Rendered",
                                            f"ConfigMap {fields['sidecarConfigMap']} digest {fields['sidecarConfigHash']}"),
                     conditions.Observation("Degraded", "False", "AsExpected")]
    else:
        reason, message = failure
        observed += [conditions.Observation("SidecarConfigRendered", "False", reason, message),
                     conditions.Observation("Degraded", "True", reason, message)]
        before = conditions.find(old.conditions, "Degraded")
        if before is None or before.message != message:
            event("Warning", reason, message)
    fields["conditions"] = [c.k8s_json() for c in conditions.merge(old.conditions, observed, generation)]
    if old.version is None:
        fields["version"] = spec.model.weights_version
    if old.phase is None:
        fields["phase"] = "Pending"
    return fields


# API answers that mean "this ConfigMap can never be written as it is": retrying won't help.
_REJECTED_STATUSES = (400, 413, 422)


async def _write_sidecar_config(kube: Kube, body: dict[str, Any], spec: policy.KVCachePolicySpec,
                                fields: dict[str, Any]) -> tuple[str, str] | None:
    """Render and write the sidecar ConfigMap, adding its name and digest to `fields`;
    (reason, message) when it cannot be rendered or the API refuses it for good (the
    policy is Degraded until its spec changes; other API errors raise and kopf retries)."""
    meta = body["metadata"]
    try:
        rendered = sidecar_render.render(spec)
    except sidecar_render.ConfigTooLarge as exc:
        return "SidecarConfigTooLarge", str(exc)
    except ValidationError as exc:  # a spec the CRD admits but the sidecar could not run
        return "SidecarConfigInvalid", "the sidecar config would be invalid: " + sidecar_render.errors_text(exc)
    cm = sidecar_render.config_map(meta["name"], meta["namespace"], rendered)
    kopf.adopt(cm, owner=body)
    try:
        await kube.apply_config_map(cm)
    except ApiException as exc:
        if exc.status not in _REJECTED_STATUSES:
            raise
        return "SidecarConfigRejected", f"the API server refused ConfigMap {cm['metadata']['name']}: {exc.status} {_api_reason(exc)}"
    fields.update(sidecarConfigMap=cm["metadata"]["name"], sidecarConfigHash=rendered.digest)
    return None


def _api_reason(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body).get("message", exc.reason))[:512]
    except (TypeError, ValueError):
        return str(exc.reason)


def _post_verdict_changes(old: policy.KVCachePolicyStatus, tiers: list[policy.TierVerdict], event: EventFn) -> None:
    before = {v.tier: v.verdict for v in old.tiers}
    after = {v.tier: v.verdict for v in tiers}
    if before != after:
        changes = ", ".join(f"{t} {before.get(t, '-')}->{v}" for t, v in after.items() if before.get(t) != v)
        event("Normal", "TierVerdict", f"{changes} (break-even {tiers[0].break_even_gbps:.2f} GB/s)")


def _measured_nvme(status: policy.KVCachePolicyStatus) -> float | None:
    return next((v.measured_gbps for v in status.tiers if v.tier == "nvme" and v.measured_gbps), None)


def _nvme_remeasured(spec: policy.KVCachePolicySpec, old: policy.KVCachePolicyStatus, stats) -> float | None:
    """The fleet's new NVMe measurement when it differs from the one the verdicts in
    status were computed with (None: nothing to recompute)."""
    if spec.tiers.nvme.mode == "off" or stats.nvme_gbps is None:
        return None
    measured = round(stats.nvme_gbps, 3)
    return None if measured == _measured_nvme(old) else measured


async def reconcile_membership(
    kube: Kube,
    sidecars: SidecarClient,
    namespace: str,
    name: str,
    views: list[membership.PodView],
    state: PolicyState,
    event: EventFn,
    policies: list[conflicts.PolicyRef] | None = None,
) -> None:
    """Bring the published affinity table in line with the ready members (see module doc).
    `policies`: the namespace's policies, for overlapping selectors (`conflicts`)."""
    body = await kube.read_policy(namespace, name)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return
    old_status = _status(body)
    try:
        spec = sidecar_render.carried_out(body["spec"])
    except sidecar_render.BrokenPolicy as exc:
        await _report_broken(kube, body, views, state, event, policies or [], exc)
        return
    state.broken = None
    this = conflicts.PolicyRef(name, body["metadata"].get("creationTimestamp") or "", spec.selector)
    refs = [p for p in policies or [] if p.name != name] + [this]
    labelled = [conflicts.PodLabels(v.name, dict(v.labels), v.injected_by) for v in views]
    overlap = conflicts.observation(this, conflicts.overlaps(this, labelled, refs))
    foreign = conflicts.foreign_observation(conflicts.foreign(this, labelled, refs))
    views = [v for v in views if conflicts.owner(dict(v.labels), v.injected_by, refs) == name]
    members = membership.members(views, spec.selector)
    missing = membership.uninjected(views, spec.selector)
    published_cm = await kube.read_config_map(namespace, names.affinity_config_map(name))
    published = publish.read_table(published_cm)
    base = epoch.with_knobs(published or epoch.empty_table(spec, old_status.epoch or 0), spec)

    candidates = membership.leaving(views, spec.selector, published.members if published else ())
    terminating = {v.name for v in views if v.deleting}
    leavers, leaver_stats = await sidecars.draining(candidates, terminating) if candidates else ({}, [])
    stats = await sidecars.fleet_stats(members)
    if leaver_stats:  # a leaver's tenants move too: the planner must know them
        stats = FleetStats(stats.per_member + tuple(leaver_stats))
    tenants = sorted(set(stats.tenants))
    measured = _nvme_remeasured(spec, old_status, stats)
    # An assignment over no tenants is no help to the planner (and trips its row reuse).
    current = state.assignment if state.assignment is not None and state.assignment.tenants else None
    plan = plan_membership_change(
        base, membership.weights(members), tenants, current=current, homes=spec.affinity.homes
    )
    state.assignment = plan.assignment
    decision = epoch.decide_epoch(published, base, plan)
    table, new_epoch = decision.table, decision.new_epoch

    if new_epoch:
        state.redis_behind = not await _warm_then_publish(kube, sidecars, body, spec, members, plan, table, leavers)
    else:
        if published_cm and _addresses_stale(published_cm, members):
            await kube.apply_config_map(_adopted(publish.affinity_config_map(name, namespace, table, members), body))
        url = await redis_url(kube, namespace, spec)
        # Level-based: a Redis that missed an epoch catches up.
        state.redis_behind = bool(url) and not await publish.ensure_redis(url, namespace, name, table, members,
                                                                          spec.redis.cluster)
        if _stale_journal(body, table.epoch):  # a crash after the publish left it behind
            await kube.patch_annotations(namespace, name, {names.PENDING_EPOCH_ANNOTATION: None})

    if leavers:  # the published table no longer names them: they may go
        await sidecars.release(leavers)

    fields = _membership_status(name, old_status, members, table, plan, stats, new_epoch)
    observed = [conditions.Observation("AffinityPublished", "True", "Published",
                                       f"epoch {table.epoch}, {len(members)} members, {len(tenants)} known tenants"),
                overlap, foreign, _injection_observation(missing, old_status, event, membership.skipped(views, spec.selector, name)),
                _sidecars_running_observation(membership.stuck_sidecars(views, spec.selector), old_status, event),
                await _dram_fit_observation(kube, spec, views, old_status, event)]
    fields.update(uninjectedPods=len(missing), uninjectedPodNames=missing[:MAX_UNINJECTED_NAMED])
    before = conditions.find(old_status.conditions, overlap.type)
    if overlap.status == "True" and (before is None or before.message != overlap.message):
        event("Warning", "SelectorConflict", overlap.message)
    if measured is not None:
        tiers, tier_observations = economics.verdicts(spec, measured)
        fields["tiers"] = [v.k8s_json() for v in tiers]
        observed += tier_observations
        _post_verdict_changes(old_status, tiers, event)
    fields["conditions"] = [c.k8s_json() for c in conditions.merge(
        old_status.conditions, observed, body["metadata"].get("generation"))]
    epoch_changed = new_epoch or (old_status.epoch or 0) < table.epoch
    if epoch_changed:
        # Before the status write, named by the epoch: a crash between the two re-posts
        # it (409, kept once) instead of losing it behind a status that already agrees.
        await kube.create_event_once(events.once(body, f"epoch/{table.epoch}", "Normal", "EpochChanged",
                                                 _epoch_message(table, plan, len(tenants))))
        crashpoints.reached("membership-event-posted")
    await kube.patch_status(namespace, name, fields)
    if epoch_changed:
        crashpoints.reached("membership-status-written")
    log.info("membership of %s/%s reconciled: epoch %d, %d members, new epoch: %s",
             namespace, name, table.epoch, len(members), new_epoch)


async def _dram_fit_observation(kube: Kube, spec: policy.KVCachePolicySpec, views: list[membership.PodView],
                                old: policy.KVCachePolicyStatus, event: EventFn) -> conditions.Observation:
    """DramFits: can each node the selected pods run on hold one sidecar (arena plus
    headroom) in its allocatable memory, and can each pod not scheduled yet land on
    some node its nodeSelector matches? False names each node too small and each such
    pod, with numbers."""
    node_names = membership.nodes(views, spec.selector)
    allocatable = {n: a for n in node_names if (a := await kube.node_allocatable_memory(n)) is not None}
    pending = await _candidate_nodes(kube, membership.unscheduled(views, spec.selector))
    message = arena_memory.fit_message(arena_memory.node_fits(spec, allocatable),
                                       arena_memory.pending_fits(spec, pending))
    if message is None:
        need = arena_memory.sidecar_memory_bytes(spec)
        return conditions.Observation("DramFits", "True", "Fits",
                                      f"{len(allocatable)} node(s) the pods run on each hold the sidecar's {need} bytes")
    before = conditions.find(old.conditions, "DramFits")
    if before is None or before.message != message:
        event("Warning", "DramDoesNotFit", message)
    return conditions.Observation("DramFits", "False", "NodeTooSmall", message)


async def _candidate_nodes(kube: Kube, unscheduled: dict[str, tuple[tuple[str, str], ...]]) -> dict[str, dict[str, int]]:
    """Per unscheduled pod, the allocatable memory of the nodes its nodeSelector matches
    (one node LIST per distinct nodeSelector: a workload's pods share theirs)."""
    by_selector: dict[tuple[tuple[str, str], ...], dict[str, int]] = {}
    for node_selector in set(unscheduled.values()):
        label_selector = ",".join(f"{k}={v}" for k, v in node_selector)
        try:
            by_selector[node_selector] = await kube.nodes_allocatable_memory(label_selector)
        except ApiException as exc:  # advisory: never let it stop the membership pass
            log.warning("cannot list nodes %r for DramFits: %s %s", label_selector, exc.status, exc.reason)
            by_selector[node_selector] = {}
    return {pod: by_selector[node_selector] for pod, node_selector in unscheduled.items()}


# Pods named in status and in the condition; the count covers the rest.
MAX_UNINJECTED_NAMED = 20
# Pods named with their reasons in SidecarsRunning (each reason up to 300 characters).
MAX_STUCK_NAMED = 3


def _named(pods: list[str]) -> str:
    return ", ".join(pods[:MAX_UNINJECTED_NAMED]) + (f" and {len(pods) - MAX_UNINJECTED_NAMED} more"
                                                     if len(pods) > MAX_UNINJECTED_NAMED else "")


def _injection_observation(missing: list[str], old: policy.KVCachePolicyStatus, event: EventFn,
                           skipped: dict[str, str] | None = None) -> conditions.Observation:
    """SidecarsInjected: False while selected pods run without the sidecar (an Event when
    that starts or the set changes), so a webhook outage — or a policy whose sidecar
    config was invalid when they were created (`skipped`: pod -> why) — is never silent."""
    if not missing:
        return conditions.Observation("SidecarsInjected", "True", "AllInjected", "every selected pod runs the sidecar")
    skipped = {p: why for p, why in (skipped or {}).items() if p in missing}
    unreachable = [p for p in missing if p not in skipped]
    parts = []
    if skipped:
        parts.append(f"{len(skipped)} selected pods were admitted without the sidecar because this policy could not "
                     f"be carried out ({next(iter(skipped.values()))}): {_named(list(skipped))}; fix the policy, "
                     "then delete them or restart the workload to inject it")
    if unreachable:
        parts.append(f"{len(unreachable)} selected pods run without the sidecar (created while the injection webhook "
                     f"was unreachable): {_named(unreachable)}; delete them or restart the workload to inject it")
    message = "; ".join(parts)
    reason = "PolicyNotCarriedOut" if skipped else "PodsWithoutSidecar"
    if old.uninjected_pod_names != missing[:MAX_UNINJECTED_NAMED] or old.uninjected_pods != len(missing):
        event("Warning", reason, message)
    return conditions.Observation("SidecarsInjected", "False", reason, message)


def _sidecars_running_observation(stuck: dict[str, str], old: policy.KVCachePolicyStatus,
                                  event: EventFn) -> conditions.Observation:
    """SidecarsRunning: False names each selected pod whose injected sidecar cannot run
    and why, in kubelet's words (an image missing from the node, a crash loop): the pod
    serves without kvtier until it is fixed, and the policy says so instead of waiting.
    A Warning event when the story changes."""
    if not stuck:
        return conditions.Observation("SidecarsRunning", "True", "Running",
                                      "no selected pod's sidecar is stuck")
    shown = list(stuck.items())[:MAX_STUCK_NAMED]
    more = f" and {len(stuck) - len(shown)} more" if len(stuck) > len(shown) else ""
    message = (f"{len(stuck)} selected pods' sidecar cannot run, so they serve without kvtier: "
               + "; ".join(f"{pod}: {why}" for pod, why in shown) + more
               + "; check that the sidecar image (the chart's sidecar.image) is on the nodes or pullable, "
                 "and the sidecar's log")
    before = conditions.find(old.conditions, "SidecarsRunning")
    if before is None or before.message != message:
        event("Warning", "SidecarNotRunning", message)
    return conditions.Observation("SidecarsRunning", "False", "SidecarNotRunning", message)


async def _report_broken(kube: Kube, body: dict[str, Any], views: list[membership.PodView], state: PolicyState,
                         event: EventFn, policies: list[conflicts.PolicyRef],
                         problem: sidecar_render.BrokenPolicy) -> None:
    """A policy that cannot be carried out publishes nothing: its status says why (its
    own condition when the spec no longer parses; `reconcile_spec` reports a sidecar
    config it cannot render) and counts the pods admitted without the sidecar. Logged
    once per distinct problem; written only when the status would change."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    if state.broken != str(problem):
        log.warning("policy %s/%s cannot be carried out: %s; selected pods are admitted without the sidecar",
                    namespace, name, problem)
        state.broken = str(problem)
    old = _status(body)
    try:
        selector = policy.LabelSelector.model_validate((body.get("spec") or {}).get("selector") or {})
    except ValueError:
        selector = None  # selects nothing
    owned = [] if selector is None else [v for v in views if conflicts.owner(
        dict(v.labels), v.injected_by, [p for p in policies if p.name != name]
        + [conflicts.PolicyRef(name, meta.get("creationTimestamp") or "", selector)]) == name]
    missing = membership.uninjected(owned, selector) if selector is not None else []
    skipped = membership.skipped(owned, selector, name) if selector is not None else {}
    observed = [_injection_observation(missing, old, event, skipped)]
    if problem.reason == "SpecInvalid":
        observed.append(conditions.Observation("Degraded", "True", problem.reason, str(problem)))
    fields: dict[str, Any] = {"uninjectedPods": len(missing), "uninjectedPodNames": missing[:MAX_UNINJECTED_NAMED],
                              "conditions": [c.k8s_json() for c in conditions.merge(old.conditions, observed,
                                                                                  meta.get("generation"))]}
    current = body.get("status") or {}
    if any(current.get(k) != v for k, v in fields.items()):
        await kube.patch_status(namespace, name, fields)


async def _warm_then_publish(kube, sidecars, body, spec, members, plan, table, leavers=None) -> bool:
    """Warm moved tenants on their new homes (from a leaver first), journaled, then
    publish the new epoch. False: Redis (when configured) did not take it."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    digest = warmup.members_digest(members)
    journal = warmup.PendingEpoch.from_json((meta.get("annotations") or {}).get(names.PENDING_EPOCH_ANNOTATION))
    if journal is None or not journal.matches(table.epoch, digest):
        journal = warmup.PendingEpoch(table.epoch, digest)
    # Peer tier off: sidecars cannot pull from each other, so moved tenants start cold.
    moves = plan.moves if spec.tiers.peer.enabled else []
    leavers = leavers or {}
    warm_plan = warmup.plan(moves, members, spec.affinity.warm_max_bytes_int, leavers)
    todo = journal.remaining(warm_plan.requests)
    if todo:
        writer = _JournalWriter(kube, namespace, name, journal)
        deadline = time.monotonic() + spec.affinity.warm_timeout_s
        try:
            await writer.write()
            crashpoints.reached("membership-journal-written")
            await sidecars.warm_all(todo, {**leavers, **members}, spec.affinity.warm_timeout_s,
                                    ref_prefix=journal.ref_prefix, on_done=writer.done)
            crashpoints.reached("membership-warmed")
            # A leaver that did not answer: warm from the surviving old home instead
            # (its own refs: the sidecar remembers the failed job under the first ones).
            retry = [r.from_fallback() for r in todo if r.key not in journal.done and r.fallback]
            if retry and time.monotonic() < deadline:
                await sidecars.warm_all(retry, members, deadline - time.monotonic(),
                                        ref_prefix=f"{journal.ref_prefix}/fallback", on_done=writer.done)
        finally:
            await writer.close()
        log.info("epoch %s: %d/%d warm-ups done, %d tenants cold", table.epoch,
                 len(journal.done), len(warm_plan.requests), len(warm_plan.cold_tenants))
    await kube.apply_config_map(_adopted(publish.affinity_config_map(name, namespace, table, members), body))
    crashpoints.reached("membership-table-published")
    redis_ok = True
    url = await redis_url(kube, namespace, spec)
    if url:
        redis_ok = await publish.publish_redis(url, namespace, name, table, members, spec.redis.cluster)
        crashpoints.reached("membership-redis-published")
    await kube.patch_annotations(namespace, name, {names.PENDING_EPOCH_ANNOTATION: None})
    crashpoints.reached("membership-journal-cleared")
    return redis_ok


def _stale_journal(body: dict[str, Any], published_epoch: int) -> bool:
    """A warm-up journal for an epoch already published (or older): nothing left to resume."""
    raw = (body["metadata"].get("annotations") or {}).get(names.PENDING_EPOCH_ANNOTATION)
    journal = warmup.PendingEpoch.from_json(raw)
    return raw is not None and (journal is None or journal.epoch <= published_epoch)


def peer_secret(name: str, namespace: str) -> dict[str, Any]:
    """The policy's peer secret, random, made once: the sidecars' peer handshake key.
    Rotate it by replacing the Secret's data; sidecars accept old and new for
    `peer_secret_overlap_s` (see docs/SECURITY.md)."""
    import base64
    import os

    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": names.peer_secret(name), "namespace": namespace,
                         "labels": {names.POLICY_LABEL: name, names.COMPONENT_LABEL: "peer-secret"}},
            "data": {names.PEER_SECRET_KEY: base64.b64encode(os.urandom(PEER_SECRET_BYTES).hex().encode()).decode()}}


async def redis_url(kube: Kube, namespace: str, spec: policy.KVCachePolicySpec) -> str | None:
    """The policy's Redis URL: `redis.url`, or the key of the Secret `redis.secretRef`
    names (read each time, so a rotated password is picked up); None without Redis or
    when the Secret cannot be read (publication then degrades to the ConfigMap)."""
    if spec.redis is None:
        return None
    if spec.redis.url:
        return spec.redis.url
    ref = spec.redis.secret_ref
    return await kube.read_secret_key(namespace, ref.name, ref.key) if ref else None


class _JournalWriter:
    """Keeps the warm-up journal annotation up to date as warm-ups finish: each one is
    written soon after it finishes (one write in flight at a time, so a burst of
    finishes coalesces into one patch), and whatever is left is written on close, even
    when the reconcile is being cancelled."""

    def __init__(self, kube: Kube, namespace: str, name: str, journal: warmup.PendingEpoch):
        self.kube, self.namespace, self.name, self.journal = kube, namespace, name, journal
        self._written: set[str] = set(journal.done)
        self._dirty = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    def done(self, key: str) -> None:
        self.journal.done.add(key)
        self._dirty.set()

    async def write(self) -> None:
        snapshot = set(self.journal.done)
        await self.kube.patch_annotations(self.namespace, self.name,
                                          {names.PENDING_EPOCH_ANNOTATION: self.journal.to_json()})
        self._written = snapshot

    async def _run(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            await self.write()

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        if self.journal.done != self._written:
            await self.write()


def _membership_status(name, old, members, table, plan, stats, new_epoch) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "memberCount": len(members),
        "members": [f"{n}={m.ip}" for n, m in members.items()],
        "epoch": table.epoch,
        "affinityConfigMap": names.affinity_config_map(name),
        "knownTenants": len(stats.tenants),
    }
    if new_epoch:
        fields["movedTenants"] = len(plan.moves) if plan.changed else 0
    if stats.hit_rate is not None:
        fields["fleetHitRate"] = round(stats.hit_rate, 4)
    if old.phase not in _ROLLOUT_PHASES:
        fields["phase"] = "Ready" if members else "Pending"
    return {k: v for k, v in fields.items() if v is not None}


def _epoch_message(table: AffinityTable, plan, known: int) -> str:
    parts = [f"epoch {table.epoch}: {len(table.members)} members"]
    if plan.joined:
        parts.append(f"joined {', '.join(plan.joined)}")
    if plan.left:
        parts.append(f"left {', '.join(plan.left)}")
    parts.append(f"{len(plan.moves)} of {known} known tenants moved")
    if plan.assignment.tenants and table.members:
        parts.append(f"max/mean home load {load_imbalance(plan.assignment, table):.2f}")
    return "; ".join(parts)


def _addresses_stale(cm: dict[str, Any], members: dict[str, membership.Member]) -> bool:
    import json

    try:
        current = json.loads((cm.get("data") or {}).get(names.ADDRESSES_KEY, "{}"))
    except ValueError:
        return True
    return current != publish.addresses(members)


def _adopted(body: dict[str, Any], owner: dict[str, Any]) -> dict[str, Any]:
    kopf.adopt(body, owner=owner)
    return body
