"""One rollout reconcile for a policy with a `workloadRef`: observe the StatefulSet, its
pods' versions (the pod annotation the sidecar's KVTIER_WEIGHTS_VERSION comes from) and
their sidecars' hit counters, ask the pure planner (`rollout.plan`) for the next action,
then post the step's Event (under a deterministic name, so it is posted exactly once),
write status, patch the workload — in that order, so a restart resumes from status,
re-applies at most the same patch and neither loses nor repeats the Event
(`crashpoints` kills the process after each of these in tests).

A StatefulSet is driven by partition; a Deployment by a stable/canary pair
(`deployment_pair`: the planner sees the same workload shape, the pair converges to
each patch without a zero-ready window). With the prometheus or alarm recovery source, a measurement is taken when
one is due (`analysis.due`): the templated query or the alerts API, through
`prom_client`, whose every failure is a `Probe(error=...)` the planner calls
inconclusive. A person's request (annotation kvtier.io/rollout-request) goes to the
planner too. A pod counts as ready by the same rule membership uses
(`membership.PodView.serving`).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

from kvtier import policy

from kvtier_operator import (analysis, conditions, crashpoints, deployment_pair, economics, events,
                             first_minute, names, prom_client, rollout)
from kvtier_operator.conditions import Observation
from kvtier_operator.membership import Member, MemberName, pod_view

log = logging.getLogger("kvtier.operator.rollout")


Snapshot = Callable[[dict[str, Any], policy.KVCachePolicySpec, rollout.WorkloadPatch, list[dict[str, Any]]],
                    Awaitable[Any]]
"""A hook run before the StatefulSet's partition is patched (and on every tick of a
rollout in flight) with the workload's pods: `rollout_snapshot.before_patch` reads the
own sidecar of each pod the patch restarts, for its warm-up (bounded in time)."""


async def reconcile_rollout(kube, sidecars, body: dict[str, Any], http=None,
                            first_minute_s: float = first_minute.WINDOW_S,
                            snapshot: Snapshot | None = None) -> rollout.Plan | None:
    """The applied plan, with `status`/`steps`/`threshold` filled for the metrics;
    `http`: the aiohttp session analysis asks Prometheus or Alertmanager through;
    `first_minute_s`: the window of the new pods' first-minute hit rate (`first_minute`);
    `snapshot`: run before a StatefulSet's pods are moved onto the target (`Snapshot`)."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    try:
        pol = policy.parse_policy(body)
    except ValueError:
        return None  # spec_changed reports an invalid spec
    spec, status = pol.spec, pol.status or policy.KVCachePolicyStatus()
    ref = spec.workload_ref
    assert ref is not None  # the timer's `when`
    pair: deployment_pair.Pair | None = None
    if ref.kind == "Deployment":
        target = await kube.read_deployment(namespace, ref.name)
        if target is not None:
            canary = await kube.read_deployment(namespace, deployment_pair.canary_name(ref.name))
            pair = deployment_pair.pair_of(target, canary)
    else:
        target = await kube.read_stateful_set(namespace, ref.name)
    if target is None:
        await _only_condition(kube, body, status, "WorkloadNotFound", f"{ref.kind} {ref.name} not found")
        return None
    workload = pair.workload if pair is not None else _workload(target)
    now = datetime.now(timezone.utc).replace(microsecond=0)
    pods = await _workload_pods(kube, namespace, target, ref.kind)
    observed = rollout.Observed(
        workload=workload, pods=await _samples(sidecars, namespace, pods),
        now=now, replica_prefill_tokens_per_s=economics.replica_prefill_tokens_per_s(spec),
        probe=await _probe(http, spec, status, namespace, name, now),
        request=(meta.get("annotations") or {}).get(names.ROLLOUT_REQUEST_ANNOTATION),
    )
    # The new pods' first minute of traffic: windows opened and closed, steps summed
    # up; the planner then sees (and writes into the step's history entry) the figures.
    counted, figures = first_minute.observe(status.rollout, status.phase, observed.pods,
                                            rollout.schedule(spec.rollout, workload.replicas), now, first_minute_s)
    counted_changed = counted != status.rollout
    status = status.model_copy(update={"rollout": counted})
    plan = rollout.plan(spec.rollout, spec.model.weights_version, status.version, status.rollout, status.phase,
                        observed)
    if plan.kind == "start" and spec.rollout.recovery.source == "prometheus" and http is not None:
        # The baseline from the same query, for the version the fleet runs now.
        old = workload.template_version if workload.template_version != spec.model.weights_version else status.version
        observed = dataclasses.replace(observed, baseline_probe=await _query(http, spec, namespace, name, old or ""))
        plan = rollout.plan(spec.rollout, spec.model.weights_version, status.version, status.rollout, status.phase,
                            observed)
    if plan.rollout is None and counted_changed:
        plan = dataclasses.replace(plan, rollout=counted)
    for figure in figures:  # each step's figure once, named by the step and its pods
        await kube.create_event_once(events.once(
            body, f"first-minute/{counted.target_version}/{figure.step}/{','.join(figure.pod_names)}", "Normal",
            "RolloutFirstMinute", first_minute.text(figure)))
    if plan.event is not None:
        # First, under a name derived from what happened: a crash after it and the
        # re-planned step find it posted (409) instead of losing or repeating it.
        await kube.create_event_once(step_event(body, plan))
        crashpoints.reached("rollout-event-posted")
    fields = _status_fields(plan, status, meta.get("generation"))
    if fields:
        await kube.patch_status(namespace, name, fields)
        crashpoints.reached("rollout-status-written")
    if pair is not None:
        in_flight = (plan.phase or status.phase) in ("RollingOut", "Paused")
        canaries = {p["metadata"]["name"] for p in pods if deployment_pair.is_canary(p)}
        measuring = bool(first_minute.measuring(counted, now, first_minute_s) & canaries)
        await _converge_pair(kube, namespace, ref.name, target, pair, plan.workload, in_flight, measuring)
    else:
        moving = plan.workload or rollout.WorkloadPatch(workload.template_version or "", workload.partition)
        if (snapshot is not None and moving.template_version == spec.model.weights_version
                and (plan.phase or status.phase) in ("RollingOut", "Paused")):
            # Before the controller restarts them: their own sidecars hold their tenants' prefixes.
            await snapshot(body, spec, moving, pods)
        if plan.workload is not None:
            await kube.patch_stateful_set(namespace, ref.name, workload_patch(plan.workload))
            crashpoints.reached("rollout-workload-patched")
    if plan.kind not in ("idle", "wait", "hold"):
        log.info("rollout of %s/%s: %s", namespace, name, plan.kind)
    after = status.model_copy(update={"phase": plan.phase or status.phase, "rollout": plan.rollout or status.rollout})
    return dataclasses.replace(plan, status=after, steps=len(rollout.schedule(spec.rollout, workload.replicas)),
                               threshold=spec.rollout.recovery.threshold)


async def _converge_pair(kube, namespace: str, name: str, stable: dict[str, Any], pair: deployment_pair.Pair,
                         patch: rollout.WorkloadPatch | None, in_flight: bool, measuring: bool = False) -> None:
    """Deployment pair: every tick, not only when the plan changed, because a shrink
    waits for the other side's ready pods, and a hand-back for the canary's pods' first
    minute (`deployment_pair.converge`)."""
    if patch is None:
        if pair.canary is None:
            return
        patch = rollout.WorkloadPatch(pair.workload.template_version or "", pair.workload.partition)
    writes = deployment_pair.converge(pair, patch, in_flight, stable, measuring)
    canary = deployment_pair.canary_name(name)
    if writes.canary_create is not None:
        await kube.create_deployment(namespace, writes.canary_create)
    if writes.canary is not None:
        await kube.patch_deployment(namespace, canary, writes.canary)
    if writes.stable is not None:
        await kube.patch_deployment(namespace, name, writes.stable)
    if writes.canary_delete:
        await kube.delete_deployment(namespace, canary)


async def _probe(http, spec: policy.KVCachePolicySpec, status: policy.KVCachePolicyStatus, namespace: str,
                 name: str, now: datetime) -> analysis.Probe | None:
    """This tick's look at the new version, when the source is not the sidecars, a
    rollout is in flight and a measurement is due; None otherwise."""
    rec, r = spec.rollout.recovery, status.rollout
    if (rec.source == "sidecar" or http is None or r is None or r.target_version is None
            or status.phase not in ("RollingOut", "Paused") or not analysis.due(rec, r.analysis, now)):
        return None
    if rec.source == "alarm":
        assert rec.alarm is not None
        return await prom_client.firing(http, rec.alarm.url, rec.alarm.api, rec.alarm.alert_name,
                                        {"namespace": namespace, "policy": name, "version": r.target_version})
    return await _query(http, spec, namespace, name, r.target_version)


async def _query(http, spec: policy.KVCachePolicySpec, namespace: str, name: str, version: str) -> analysis.Probe:
    rec = spec.rollout.recovery
    assert rec.prometheus is not None
    expr = analysis.render_query(rec.prometheus.query, namespace=namespace, policy=name, version=version,
                                 window=rec.analysis_window, min_lookups=rec.min_lookups)
    return await prom_client.query_value(http, rec.prometheus.url, expr)


def step_event(body: dict[str, Any], plan: rollout.Plan) -> dict[str, Any]:
    """The step's Event, named by (policy, target version, step, history length,
    reason): a re-planned step after a crash has the same name; a later rollout to the
    same target (after a rollback grew the history) has another."""
    kind, reason, message = plan.event
    r = plan.rollout
    # A plan without rollout status (a rejected request) is named by its message.
    happening = (f"{r.target_version}/{r.step}/{len(r.history)}/{r.handled_request}" if r is not None
                 else message)
    return events.once(body, happening, kind, reason, message)


def workload_patch(patch: rollout.WorkloadPatch) -> dict[str, Any]:
    """Template version and partition in one write: a template change with a stale
    partition would restart every pod at once."""
    return {"spec": {
        "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": patch.partition}},
        "template": {"metadata": {"annotations": {names.WEIGHTS_VERSION_ANNOTATION: patch.template_version}}},
    }}


def _workload(sts: dict[str, Any]) -> rollout.Workload:
    spec = sts.get("spec") or {}
    annotations = ((spec.get("template") or {}).get("metadata") or {}).get("annotations") or {}
    partition = ((spec.get("updateStrategy") or {}).get("rollingUpdate") or {}).get("partition") or 0
    return rollout.Workload(int(spec.get("replicas", 1)), annotations.get(names.WEIGHTS_VERSION_ANNOTATION),
                            int(partition))


async def _workload_pods(kube, namespace: str, workload: dict[str, Any],
                         kind: str = "StatefulSet") -> list[dict[str, Any]]:
    """The workload's pods: a StatefulSet's own; for a Deployment, every pod its selector
    matches (its ReplicaSets' and the canary's, whose selector only adds the track label)."""
    labels = ((workload.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    owner = workload["metadata"]["name"]
    return [p for p in await kube.list_pods(namespace, selector)
            if kind == "Deployment" or any(o.get("kind") == "StatefulSet" and o.get("name") == owner
                                           for o in p["metadata"].get("ownerReferences") or [])]


async def _samples(sidecars, namespace: str, pods: list[dict[str, Any]]) -> tuple[rollout.PodSample, ...]:
    """Each pod's sample: its version, readiness and its sidecar's counters."""
    ready = {p["metadata"]["name"]: pod_view(p).serving for p in pods}
    members = {MemberName(n): Member(MemberName(n), p["status"]["podIP"], 1.0, namespace,
                                     (p["metadata"].get("annotations") or {}).get(names.INJECTED_ANNOTATION, ""))
               for p in pods if ready[(n := p["metadata"]["name"])]}
    stats = {s.member: s for s in (await sidecars.fleet_stats(members)).per_member}
    out = []
    for p in sorted(pods, key=lambda p: p["metadata"]["name"]):
        n = p["metadata"]["name"]
        s = stats.get(n)
        version = (p["metadata"].get("annotations") or {}).get(names.WEIGHTS_VERSION_ANNOTATION)
        out.append(rollout.PodSample(n, version, ready[n], s.lookups, s.loaded_tokens, s.prompt_tokens) if s
                   else rollout.PodSample(n, version, ready[n]))
    return tuple(out)


def _status_fields(plan: rollout.Plan, status: policy.KVCachePolicyStatus, generation: int | None) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if plan.rollout is not None:
        wire = plan.rollout.k8s_json()
        # A merge patch keeps keys it does not name: clear the ones the plan emptied.
        fields["rollout"] = {**{f.alias or k: None for k, f in policy.RolloutStatus.model_fields.items()
                                if (f.alias or k) not in wire}, **wire}
    if plan.phase is not None and plan.phase != status.phase:
        fields["phase"] = plan.phase
    if plan.version is not None and plan.version != status.version:
        fields["version"] = plan.version
    if plan.conditions:
        merged = conditions.merge(status.conditions, list(plan.conditions), generation)
        if merged != status.conditions:
            fields["conditions"] = [c.k8s_json() for c in merged]
    return fields


async def _only_condition(kube, body: dict[str, Any], status: policy.KVCachePolicyStatus, reason: str,
                          message: str) -> None:
    obs = Observation(rollout.PROGRESSING, "False", reason, message)
    fields = _status_fields(rollout.Plan("refuse", conditions=(obs,)), status, body["metadata"].get("generation"))
    if fields:
        meta = body["metadata"]
        await kube.patch_status(meta["namespace"], meta["name"], fields)
