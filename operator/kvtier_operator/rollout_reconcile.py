"""One rollout reconcile for a policy with a `workloadRef`: observe the StatefulSet, its
pods' versions (the pod annotation the sidecar's KVTIER_WEIGHTS_VERSION comes from) and
their sidecars' hit counters, ask the pure planner (`rollout.plan`) for the next action,
then write status, patch the workload, post the Event — in that order, so a restart
resumes from status and re-applies at most the same patch.

Only StatefulSets are driven (partition); a Deployment workloadRef gets a condition
saying so. The prometheus recovery source is validated by the CRD but refused here
with a condition (the planner's `RecoverySourceUnsupported`). A pod counts as ready by
the same rule membership uses (`membership.PodView.serving`).
"""
from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Any

import kopf

from kvtier import breakeven, policy

from kvtier_operator import conditions, economics, names, rollout
from kvtier_operator.conditions import Observation
from kvtier_operator.membership import Member, MemberName, pod_view

log = logging.getLogger("kvtier.operator.rollout")


async def reconcile_rollout(kube, sidecars, body: dict[str, Any]) -> rollout.Plan | None:
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    try:
        pol = policy.parse_policy(body)
    except ValueError:
        return None  # spec_changed reports an invalid spec
    spec, status = pol.spec, pol.status or policy.KVCachePolicyStatus()
    ref = spec.workload_ref
    assert ref is not None  # the timer's `when`
    if ref.kind != "StatefulSet":
        await _only_condition(kube, body, status, "WorkloadKindUnsupported",
                              f"workloadRef kind {ref.kind}: this operator rolls out StatefulSets only")
        return None
    sts = await kube.read_stateful_set(namespace, ref.name)
    if sts is None:
        await _only_condition(kube, body, status, "WorkloadNotFound", f"StatefulSet {ref.name} not found")
        return None
    observed = rollout.Observed(
        workload=_workload(sts), pods=await _samples(kube, sidecars, namespace, sts),
        now=datetime.now(timezone.utc).replace(microsecond=0), replica_prefill_tokens_per_s=_replica_tokens_s(spec),
    )
    plan = rollout.plan(spec.rollout, spec.model.weights_version, status.version, status.rollout, status.phase,
                        observed)
    fields = _status_fields(plan, status, meta.get("generation"))
    if fields:
        await kube.patch_status(namespace, name, fields)
    if plan.workload is not None:
        await kube.patch_stateful_set(namespace, ref.name, workload_patch(plan.workload))
    if plan.event is not None:
        kopf.event(body, type=plan.event[0], reason=plan.event[1], message=plan.event[2])
    if plan.kind not in ("idle", "wait", "hold"):
        log.info("rollout of %s/%s: %s", namespace, name, plan.kind)
    return plan


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


async def _samples(kube, sidecars, namespace: str, sts: dict[str, Any]) -> tuple[rollout.PodSample, ...]:
    labels = ((sts.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    owner = sts["metadata"]["name"]
    pods = [p for p in await kube.list_pods(namespace, selector)
            if any(o.get("kind") == "StatefulSet" and o.get("name") == owner
                   for o in p["metadata"].get("ownerReferences") or [])]
    ready = {p["metadata"]["name"]: pod_view(p).serving for p in pods}
    members = {MemberName(n): Member(MemberName(n), p["status"]["podIP"], 1.0)
               for p in pods if ready[(n := p["metadata"]["name"])]}
    stats = {s.member: s for s in (await sidecars.fleet_stats(members)).per_member}
    out = []
    for p in sorted(pods, key=lambda p: p["metadata"]["name"]):
        n = p["metadata"]["name"]
        s = stats.get(n)
        version = (p["metadata"].get("annotations") or {}).get(names.WEIGHTS_VERSION_ANNOTATION)
        out.append(rollout.PodSample(n, version, ready[n], s.lookups if s else None, s.hits if s else None))
    return tuple(out)


def _replica_tokens_s(spec: policy.KVCachePolicySpec) -> float:
    """Prefill tokens/s one replica recomputes at full load (the break-even arithmetic)."""
    shape = economics.resolved_shape(spec.model)
    tflops, _gpu = economics.tflops_per_gpu(spec)
    return 1.0 / breakeven.prefill_s_per_token(shape.active_params or shape.params, tflops, spec.hardware.tp)


def _status_fields(plan: rollout.Plan, status: policy.KVCachePolicyStatus, generation: int | None) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if plan.rollout is not None:
        wire = plan.rollout.wire()
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
            fields["conditions"] = [c.wire() for c in merged]
    return fields


async def _only_condition(kube, body: dict[str, Any], status: policy.KVCachePolicyStatus, reason: str,
                          message: str) -> None:
    obs = Observation(rollout.PROGRESSING, "False", reason, message)
    fields = _status_fields(rollout.Plan("refuse", conditions=(obs,)), status, body["metadata"].get("generation"))
    if fields:
        meta = body["metadata"]
        await kube.patch_status(meta["namespace"], meta["name"], fields)
