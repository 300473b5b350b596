"""Deleting a policy mid-rollout: before its finalizer goes, the workload returns to one
consistent version — the STABLE one, `status.version`, which the whole fleet served
before the rollout began — with partition 0, and the handler waits (bounded) until
every pod runs it. Without this a deleted policy would leave a StatefulSet half-rolled
forever (template at the target version, partition mid-way, pods on two versions),
with no controller left to finish or undo it.

    settle(workload, stable)   pure: the patch that rolls the workload back, or None
    settle_pair(pair, ...)     pure: a Deployment pair's writes back to the stable one
    settle_workload(...)       the delete handler's step: wait for the injection webhook,
                               patch, Event, wait for pods

A Deployment rolls as a stable/canary pair (`deployment_pair`): the stable Deployment
grows back to the fleet size first, and the canary `<name>-kvtier-canary` is deleted
only once the stable one has that many ready pods, so no moment serves fewer replicas.

The rollback recreates pods, so, like a rollout step, it waits until this operator's
injection webhook serves (`webhook_gate`): an operator restarted to finish a deletion
would otherwise recreate them in its first seconds without their sidecar.

Rolling back rather than forward: the target version never passed its recovery check,
and the stable version is what every pod ran (and every cache was warm for) before.
"""
from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from typing import Any, Awaitable, Callable

import kopf

from kvtier import policy

from kvtier_operator import deployment_pair, events, names, rollout, webhook_gate
from kvtier_operator.rollout_reconcile import workload_patch

log = logging.getLogger("kvtier.operator.teardown")

# How long the finalizer waits for the pods to converge before letting the policy go
# anyway (with a Warning): a stuck pod must not pin a deleted policy forever.
SETTLE_TIMEOUT_S = 600.0
# Between checks while the StatefulSet controller restarts pods.
SETTLE_POLL_S = 2.0
EventFn = Callable[[str, str, str], None]
WebhookServing = Callable[[], Awaitable[bool]]  # webhook_gate.serving, bound to the operator's memo


def settle(workload: rollout.Workload, stable: str | None) -> rollout.WorkloadPatch | None:
    """The patch that returns the workload to `stable` on every pod; None when it is
    already consistent (no rollout in flight) or no stable version is known."""
    if stable is None:
        return None
    if workload.template_version == stable and workload.partition == 0:
        return None
    return rollout.WorkloadPatch(template_version=stable, partition=0)


def settle_pair(pair: deployment_pair.Pair, stable_version: str | None,
                stable: dict[str, Any]) -> deployment_pair.Writes | None:
    """The writes that hand a Deployment pair back to its stable side: stable at the
    fleet size on `stable_version`, then the canary deleted. None: no canary is left."""
    if pair.canary is None:
        return None
    version = stable_version or pair.stable.version or ""
    return deployment_pair.converge(pair, rollout.WorkloadPatch(template_version=version, partition=0),
                                    in_flight=False, stable=stable)


def pods_off(versions: dict[str, str | None], stable: str) -> list[str]:
    """Pods not (yet) on the stable version."""
    return sorted(name for name, v in versions.items() if v != stable)


async def settle_workload(kube, body: dict[str, Any], event: EventFn, webhook_serving: WebhookServing,
                          now: Callable[[], float] = time.time) -> None:
    """Roll the policy's StatefulSet back to the stable version and wait until its pods
    run it; raises kopf.TemporaryError to be called again while the injection webhook
    is not serving yet and while the pods converge."""
    meta = body["metadata"]
    try:
        pol = policy.parse_policy(body)
    except ValueError:
        return  # an unreadable policy never drove a rollout
    ref, stable = pol.spec.workload_ref, (pol.status.version if pol.status else None)
    if ref is None or stable is None:
        return
    namespace = meta["namespace"]
    if ref.kind == "Deployment":
        await _settle_deployment_pair(kube, body, ref.name, stable, webhook_serving, event)
        return
    if ref.kind != "StatefulSet":
        return
    sts = await kube.read_stateful_set(namespace, ref.name)
    if sts is None:
        return
    spec = sts.get("spec") or {}
    template = ((spec.get("template") or {}).get("metadata") or {}).get("annotations") or {}
    partition = ((spec.get("updateStrategy") or {}).get("rollingUpdate") or {}).get("partition") or 0
    workload = rollout.Workload(int(spec.get("replicas", 1)), template.get(names.WEIGHTS_VERSION_ANNOTATION),
                                int(partition))
    patch = settle(workload, stable)
    if patch is not None:
        await _wait_for_webhook(webhook_serving, meta, f"StatefulSet {ref.name}", event, now)
        await kube.patch_stateful_set(namespace, ref.name, workload_patch(patch))
        event("Normal", "RolloutAbandoned",
              f"policy deleted mid-rollout: StatefulSet {ref.name} rolled back to the stable version {stable} "
              f"(template was {workload.template_version}, partition {workload.partition})")
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    pods = await kube.list_pods(namespace, ",".join(f"{k}={v}" for k, v in sorted(labels.items())))
    versions = {p["metadata"]["name"]: (p["metadata"].get("annotations") or {}).get(names.WEIGHTS_VERSION_ANNOTATION)
                for p in pods if not p["metadata"].get("deletionTimestamp")}
    off = pods_off(versions, stable)
    ready = sum(1 for p in pods if not p["metadata"].get("deletionTimestamp"))
    if not off and ready >= workload.replicas:
        return
    waited = now() - _deleted_at(meta)
    if waited > SETTLE_TIMEOUT_S:
        event("Warning", "RolloutNotSettled", f"pods {', '.join(off) or '(missing replicas)'} still not on {stable} "
                                              f"after {SETTLE_TIMEOUT_S:.0f}s; releasing the policy anyway")
        return
    raise kopf.TemporaryError(f"waiting for StatefulSet {ref.name} to return to {stable}: "
                              f"{len(off)} pods off it, {ready}/{workload.replicas} present", delay=SETTLE_POLL_S)


async def _wait_for_webhook(webhook_serving: WebhookServing, meta: dict[str, Any], what: str,
                            event: EventFn, now: Callable[[], float]) -> None:
    """Raise kopf.TemporaryError (retried soon) while the injection webhook does not
    serve; past SETTLE_TIMEOUT_S the rollback goes ahead anyway, with a Warning."""
    if await webhook_serving():
        return
    if now() - _deleted_at(meta) > SETTLE_TIMEOUT_S:
        event("Warning", "WebhookNotServing", f"the injection webhook did not serve within {SETTLE_TIMEOUT_S:.0f}s; "
                                              f"rolling {what} back anyway: its recreated pods may lack the sidecar")
        return
    raise kopf.TemporaryError(f"rolling {what} back waits for this operator's injection webhook to serve",
                              delay=webhook_gate.RETRY_DELAY_S)


async def _settle_deployment_pair(kube, body: dict[str, Any], name: str, stable_version: str,
                                  webhook_serving: WebhookServing, event: EventFn) -> None:
    """Scale the stable Deployment back to the fleet, then delete the canary; raises
    kopf.TemporaryError to be called again until the canary is gone (bounded)."""
    meta = body["metadata"]
    namespace = meta["namespace"]
    stable = await kube.read_deployment(namespace, name)
    if stable is None:
        return
    canary_name = deployment_pair.canary_name(name)
    pair = deployment_pair.pair_of(stable, await kube.read_deployment(namespace, canary_name))
    writes = settle_pair(pair, stable_version, stable)
    if writes is None:
        return
    await _wait_for_webhook(webhook_serving, meta, f"Deployment {name}", event, time.time)
    # Exactly once however many ticks the hand-back takes (named by the policy's uid).
    await kube.create_event_once(events.once(
        body, "rollout-abandoned", "Normal", "RolloutAbandoned",
        f"policy deleted mid-rollout: Deployment {canary_name} ({pair.canary.replicas if pair.canary else 0} "
        f"replicas on {pair.canary.version if pair.canary else '-'}) is removed and {name} returns to "
        f"{pair.fleet} replicas on the stable version {stable_version}"))
    if writes.stable is not None:
        await kube.patch_deployment(namespace, name, writes.stable)
    if writes.canary is not None:
        await kube.patch_deployment(namespace, canary_name, writes.canary)
    if writes.canary_delete:
        await kube.delete_deployment(namespace, canary_name)
        return
    waited = time.time() - _deleted_at(meta)
    if waited > SETTLE_TIMEOUT_S:
        await kube.create_event_once(events.once(
            body, "rollout-not-settled", "Warning", "RolloutNotSettled",
            f"Deployment {name} has {pair.stable.ready}/{pair.fleet} ready pods after {SETTLE_TIMEOUT_S:.0f}s; "
            f"deleting {canary_name} and releasing the policy anyway"))
        await kube.delete_deployment(namespace, canary_name)
        return
    raise kopf.TemporaryError(f"waiting for Deployment {name} to serve {pair.fleet} ready pods before "
                              f"{canary_name} goes: {pair.stable.ready} ready", delay=SETTLE_POLL_S)


def _deleted_at(meta: dict[str, Any]) -> float:
    stamp = meta.get("deletionTimestamp")
    if not stamp:
        return time.time()
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).astimezone(timezone.utc).timestamp()
