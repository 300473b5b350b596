"""kopf side of the weights-version rollout: a timer per policy with a `workloadRef`
that runs `rollout_reconcile.reconcile_rollout` under the policy's status lock, then
the warm-before-ready gates of the policy's pods (`rollout_warmup_io.reconcile`)."""
from __future__ import annotations

import functools
import logging
from typing import Any

import kopf

from kvtier import policy

from kvtier_operator import rollout, rollout_snapshot, rollout_warmup_io, webhook_gate
from kvtier_operator.registry import PolicyKey, PolicyRegistry
from kvtier_operator.rollout_reconcile import reconcile_rollout

POLICY = (policy.GROUP, policy.VERSION, policy.PLURAL)
# The design's "every few seconds": a step's window is minutes, so a few seconds of
# lag on a decision is noise, and stats requests stay rare for the sidecars.
ROLLOUT_INTERVAL_S = 3.0
log = logging.getLogger("kvtier.operator.rollout")


def _has_workload(spec: kopf.Spec, **_: Any) -> bool:
    return bool(spec.get("workloadRef"))


@kopf.timer(*POLICY, id="rollout", interval=ROLLOUT_INTERVAL_S, when=_has_workload)
async def rollout_tick(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    serving = await webhook_gate.serving(memo)
    if not serving:  # a step recreates pods: they need the webhook
        log.info("rollout of %s/%s waits: this operator's injection webhook does not serve yet", namespace, name)
    registry: PolicyRegistry = memo.policies
    async with registry.lock(PolicyKey(namespace, name)):  # one status writer at a time
        body = await memo.kube.read_policy(namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return
        plan = None
        if serving:
            plan = await reconcile_rollout(memo.kube, memo.sidecars, body, memo.http,
                                           memo.options.first_minute_s,
                                           snapshot=functools.partial(rollout_snapshot.before_patch, memo))
            _observe_metrics(memo, namespace, name, plan)
        # Warm-before-ready gates: released or warmed even while no step is taken (a
        # pod must never wait on a webhook for its gate).
        await rollout_warmup_io.reconcile(memo, body, plan.status if plan is not None else None)


def _observe_metrics(memo: kopf.Memo, namespace: str, name: str, plan: rollout.Plan | None) -> None:
    """The operator's /metrics: where the rollout stands after this tick, and its decision."""
    metrics = memo.get("rollout_metrics")
    if metrics is None or plan is None:
        return
    if plan.kind not in ("idle", "wait", "hold"):
        metrics.decided(namespace, name, plan.kind)
    if plan.status is not None:
        metrics.observe(namespace, name, plan.status, plan.steps, plan.threshold)
