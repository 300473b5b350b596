"""Weights-version rollout planning: pure. Given the policy's rollout spec, its status
and what the workload and its pods look like now, decide the one next action.

    steady ──(spec version != template version)──> start: baseline = old pods' hit rate,
      ^                                             template := new, partition := R - n1
      |                                                   |
      |          ┌──────────── wait <───────────┐         v
      |          v                              |     step k (n_k new pods)
      |   n_k new pods ready, and the pods step k restarted have hit rate
      |   >= threshold x baseline over >= minLookups lookups?
      |          | yes                          | no, window not over
      |          v                              |
      |   k < last: advance (partition := R - n_{k+1}, history += recovered)
      +── k = last: complete (partition := 0, status.version := new)
                 window over without recovery:
                   onFailure rollback -> template := old, partition := 0 (every pod old)
                   onFailure pause    -> hold where it is, for a person to decide

Level-based and restart-safe: everything the planner needs is in the policy's status
(`status.version` is the old version, `status.rollout` the step and its clock) and in
the workload itself, and the workload a step wants is derived from status every time.
The handler writes status before it patches the workload, so an operator that dies
between the two re-applies the same patch on its next tick and never a different one.

StatefulSet semantics the plan relies on: with `rollingUpdate.partition = p`, the
controller moves the pods with ordinal >= p to the current template (highest first)
and leaves the others on their revision; with the template back on the old version
and partition 0, every pod converges to the old version (a pod already there is not
restarted: its revision matches).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from kvtier.policy import MAX_HISTORY, KVCachePolicyStatus, Rollout, RolloutRecord, RolloutStatus

from kvtier_operator import analysis, first_minute, names
from kvtier_operator import rollout_warmup as rw
from kvtier_operator.conditions import Observation

PROGRESSING = "RolloutProgressing"
ROLLED_BACK = "RolledBack"
DEGRADED = "RolloutDegraded"
REQUEST = "RolloutRequest"  # the last kvtier.io/rollout-request: accepted or rejected
# status.rollout.history is bounded by the CRD: keep the newest.
HISTORY_KEPT = MAX_HISTORY
# Hit rates in status and messages: four decimals are plenty and keep writes quiet.
RATE_DIGITS = 4

ActionKind = Literal["idle", "start", "wait", "advance", "complete", "rollback", "pause", "hold", "refuse", "resume",
                     "catchUp"]


@dataclass(frozen=True, slots=True)
class PodSample:
    """One pod of the workload as the operator sees it now, from its sidecar's counters
    since the pod (and so its cache) started; None: no answer. The hit rate is
    `loaded_tokens` (prompt tokens the pod's engine loaded from kvtier, as it reported
    them) over `prompt_tokens` (those it looked up); `lookups` is the sample size. All
    three are traffic's: the sidecar counts the rollout's warm-up requests apart
    (`kvtier_warmup_*`), so a warmed pod's warm-up misses — cold by design — never hold
    its step under the bar, nor make an alarm's silence look sampled."""

    name: str
    version: str | None
    ready: bool
    lookups: int | None = None
    loaded_tokens: int | None = None
    prompt_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Workload:
    """The serving workload's rollout knobs: replicas, the pod template's weights
    version, and the StatefulSet partition (pods with ordinal >= partition are new)."""

    replicas: int
    template_version: str | None
    partition: int


@dataclass(frozen=True, slots=True)
class WorkloadPatch:
    template_version: str
    partition: int


@dataclass(frozen=True, slots=True)
class Observed:
    workload: Workload
    pods: tuple[PodSample, ...]
    now: datetime
    # Recompute capacity of one replica (break-even arithmetic): what cold pods must
    # absorb for every prefill token that used to be a hit.
    replica_prefill_tokens_per_s: float = 0.0
    # prometheus/alarm sources: this tick's look at the new version (None: not due),
    # and, when a rollout may start, the prometheus query for the old version.
    probe: analysis.Probe | None = None
    baseline_probe: analysis.Probe | None = None
    # A person's request (annotation kvtier.io/rollout-request: "<action>[/<id>]"),
    # acted on once: status.rollout.handledRequest remembers the last one.
    request: str | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    """The next action. `rollout`/`phase`/`version` are the status fields to write
    (None: leave as is); `workload` the patch to apply after them (None: none)."""

    kind: ActionKind
    rollout: RolloutStatus | None = None
    phase: str | None = None
    version: str | None = None
    workload: WorkloadPatch | None = None
    conditions: tuple[Observation, ...] = ()
    event: tuple[str, str, str] | None = None  # (type, reason, message)
    # Filled by the handler after it applied the plan, for the operator's metrics.
    status: "KVCachePolicyStatus | None" = None
    steps: int = 0
    threshold: float = 0.0


@dataclass(frozen=True, slots=True)
class Tally:
    """Pods' counters summed: lookups (the sample size) and the hit figure's tokens."""

    lookups: int
    loaded_tokens: int
    prompt_tokens: int

    @property
    def rate(self) -> float | None:
        return round(self.loaded_tokens / self.prompt_tokens, RATE_DIGITS) if self.prompt_tokens else None


@dataclass(frozen=True, slots=True)
class StepRecovery:
    """New-version pods' hit rate against the bar of one step."""

    tally: Tally
    needed: float

    @property
    def lookups(self) -> int:
        return self.tally.lookups

    @property
    def hit_rate(self) -> float | None:
        return self.tally.rate

    def recovered(self, min_lookups: int) -> bool:
        t = self.tally
        return t.lookups >= min_lookups and t.prompt_tokens > 0 and t.loaded_tokens >= self.needed * t.prompt_tokens


@dataclass(slots=True)
class _Ctx:
    spec: Rollout
    target: str
    serving: str | None
    status: RolloutStatus | None
    phase: str | None
    observed: Observed
    schedule: list[int] = field(default_factory=list)


# --- arithmetic ------------------------------------------------------------------------


def schedule(spec: Rollout, replicas: int) -> list[int]:
    """New-version pod counts per step: the canary pods, then each percentage of the
    fleet rounded up (never fewer than the step before); the last step is the fleet."""
    counts = [min(spec.canary_pods, replicas)] if spec.canary_pods > 0 else []
    for percent in spec.steps:
        counts.append(max(counts[-1] if counts else 0, -(-replicas * percent // 100)))
    return counts


def hit_rate(pods: tuple[PodSample, ...] | list[PodSample]) -> Tally:
    """Lookups, loaded and prompt tokens summed over the pods that answered."""
    answered = [p for p in pods if p.lookups is not None]
    return Tally(sum(p.lookups or 0 for p in answered), sum(p.loaded_tokens or 0 for p in answered),
                 sum(p.prompt_tokens or 0 for p in answered))


def step_pods(new_pods: list[PodSample], counts: list[int], step: int, replicas: int) -> list[PodSample]:
    """The pods a step is judged on: those it restarted (ordinals [R - n_k, R - n_k-1)),
    whose caches are the cold ones; pods recovered in earlier steps would only dilute
    them. A step that restarts none (same count as the one before) is judged on all."""
    low, high = replicas - counts[step - 1], replicas - (counts[step - 2] if step > 1 else 0)
    fresh = [p for p in new_pods if low <= ordinal(p.name) < high]
    return fresh or new_pods


def ordinal(pod_name: str) -> int:
    """A StatefulSet pod's ordinal: the number after its last '-' (-1 if none)."""
    tail = pod_name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def cold_prefill_tokens_per_s(new_pods: int, baseline: float | None, replica_tokens_per_s: float) -> float:
    """Expected extra prefill on the restarted pods at full load: every token that was a
    hit on them (baseline hit rate) is recomputed until their caches refill."""
    return round(new_pods * (baseline or 0.0) * replica_tokens_per_s, 1)


# --- the planner ----------------------------------------------------------------------


def plan(
    spec: Rollout,
    target: str,
    serving: str | None,
    status: RolloutStatus | None,
    phase: str | None,
    observed: Observed,
) -> Plan:
    """The next action for the rollout towards `target` (spec.model.weightsVersion);
    `serving` is status.version, `status`/`phase` the policy's status as last written."""
    ctx = _Ctx(spec, target, serving, status, phase, observed, schedule(spec, observed.workload.replicas))
    in_flight = status is not None and status.target_version is not None and phase in ("RollingOut", "Paused")
    request = observed.request
    if request and request != (status.handled_request if status else None):
        return _handled(ctx, request, _request(ctx, request.split("/", 1)[0], in_flight))
    if in_flight:
        assert status is not None and status.target_version is not None
        if target == serving:
            return _rollback(ctx, f"spec.model.weightsVersion set back to {serving}", requested=True)
        if target != status.target_version:
            return _start(ctx, superseding=status.target_version)
        if phase == "Paused":
            if status.paused_reason == "inconclusive" and observed.probe is not None:
                return _evaluate_inconclusive_pause(ctx)
            return _hold(ctx, _step_patch(ctx, status.step))
        if observed.workload.replicas == 0:
            return _scaled_to_zero(ctx)
        if _fleet_ahead_of_step(ctx):
            return _catch_up(ctx)
        if spec.recovery.source != "sidecar":
            return _evaluate_analysis(ctx)
        return _evaluate(ctx)
    if phase == "RolledBack" and status is not None and status.target_version == target:
        return _hold(ctx, WorkloadPatch(serving or target, 0))
    template = observed.workload.template_version
    if template is None:
        return _refuse(ctx, "WorkloadUnversioned",
                       f"the workload's pod template has no {names.WEIGHTS_VERSION_ANNOTATION} annotation; "
                       f"set it to the version its pods serve (e.g. {serving}) to enable rollouts")
    if template != target:
        return _start(ctx)
    return _steady(ctx)


REQUESTS = ("promote", "abort", "retry", "pause", "resume")


def _request(ctx: _Ctx, action: str, in_flight: bool) -> Plan:
    """A person's promote / abort / retry / pause / resume, as Argo Rollouts' controls:
    promote skips the current step's wait, abort rolls back now, retry restarts a
    rolled-back target, pause holds, resume goes on with a fresh window."""
    status = ctx.status
    if action not in REQUESTS:
        return _rejected(ctx, action, f"unknown action; use one of {', '.join(REQUESTS)}")
    if action == "retry":
        if ctx.phase == "RolledBack" and status is not None and status.target_version == ctx.target:
            return _start(ctx, retry=True)
        return _rejected(ctx, action, "only a rolled-back rollout of the current target can be retried")
    if not in_flight:
        return _rejected(ctx, action, "no rollout in flight")
    assert status is not None
    step = _clamped_step(ctx, status.step)
    rate = status.current_hit_rate
    if action == "abort":
        return _rollback(ctx, f"step {step}: aborted by request", observed_rate=rate, cause="Aborted",
                         outcome="aborted")
    if action == "promote":
        evidence = f"promoted by request at step {step} (hit rate {_fmt(rate)})"
        resumed = ctx.status.model_copy(update={"paused_reason": None}) if ctx.phase == "Paused" else None
        c = ctx if resumed is None else _Ctx(ctx.spec, ctx.target, ctx.serving, resumed, "RollingOut", ctx.observed,
                                              ctx.schedule)
        if step == len(ctx.schedule):
            return _complete_with(c, rate, evidence)
        plan = _advance_with(c, step, rate, evidence, outcome="promoted")
        return Plan(plan.kind, rollout=plan.rollout, phase="RollingOut", workload=plan.workload,
                    conditions=plan.conditions + (Observation(DEGRADED, "False", "Promoted", evidence),),
                    event=plan.event)
    if action == "pause":
        if ctx.phase == "Paused":
            return _rejected(ctx, action, "already paused")
        return _pause_with(ctx, step, rate, f"step {step}: paused by request", "manual", status.analysis)
    if ctx.phase != "Paused":
        return _rejected(ctx, action, "not paused")
    message = f"resumed {status.target_version} at step {step} by request; the step's recovery window restarts"
    rollout = status.model_copy(update={
        "paused_reason": None, "step_started_at": ctx.observed.now, "analysis": None,
        "history": _appended(status.history, _record(ctx, step, "resumed", rate, message))})
    return Plan("resume", rollout=rollout, phase="RollingOut",
                conditions=(Observation(PROGRESSING, "True", "Resumed", message),
                            Observation(DEGRADED, "False", "Resumed", message)),
                event=("Normal", "RolloutResumed", message))


def _rejected(ctx: _Ctx, action: str, why: str) -> Plan:
    message = f"rollout request {action!r} ignored: {why} (phase {ctx.phase})"
    return Plan("refuse", conditions=(Observation(REQUEST, "False", "Rejected", message),),
                event=("Warning", "RolloutRequestRejected", message))


def _handled(ctx: _Ctx, request: str, plan: Plan) -> Plan:
    """The plan with the request recorded as handled (acted on once), and the
    RolloutRequest condition naming it, accepted or rejected."""
    base = plan.rollout or ctx.status or RolloutStatus()
    rollout = base.model_copy(update={"handled_request": request[:128]})
    conds = plan.conditions
    if not any(c.type == REQUEST for c in conds):
        conds += (Observation(REQUEST, "True", "Accepted", f"rollout request {request}: {plan.kind}"),)
    else:
        conds = tuple(c if c.type != REQUEST else Observation(c.type, c.status, c.reason, f"{c.message} [{request}]")
                      for c in conds)
    return Plan(plan.kind, rollout=rollout, phase=plan.phase, version=plan.version, workload=plan.workload,
                conditions=conds, event=plan.event)


def _steady(ctx: _Ctx) -> Plan:
    """Fleet on the target: finish an interrupted completion (partition back to 0) and
    leave a terminal rollout phase once the spec names the serving version again."""
    w = ctx.observed.workload
    patch = WorkloadPatch(ctx.target, 0) if w.partition != 0 else None
    version = ctx.target if ctx.serving != ctx.target else None
    phase = "Ready" if ctx.phase in ("RollingOut", "Paused", "RolledBack") else None
    if patch is None and version is None and phase is None:
        return Plan("idle")
    return Plan("idle", phase=phase, version=version, workload=patch)


def _start(ctx: _Ctx, superseding: str | None = None, retry: bool = False) -> Plan:
    w = ctx.observed.workload
    # The old version is what the fleet runs now (mid-rollout: what it ran before).
    old = ctx.serving if superseding else (w.template_version or ctx.serving)
    old_pods = [p for p in ctx.observed.pods if p.version != ctx.target]
    old_tally = hit_rate(old_pods)
    lookups, baseline = old_tally.lookups, old_tally.rate
    probe = ctx.observed.baseline_probe
    if ctx.spec.recovery.source == "prometheus" and probe is not None and probe.value is not None:
        baseline = round(probe.value, RATE_DIGITS)  # the query's own view of the old version
    n = ctx.schedule[0]
    rollout = RolloutStatus(
        target_version=ctx.target, step=1, canary_percent=_percent(n, w.replicas), baseline_hit_rate=baseline,
        step_started_at=ctx.observed.now,
        expected_cold_prefill_tokens_per_s=cold_prefill_tokens_per_s(n, baseline, ctx.observed.replica_prefill_tokens_per_s),
        history=list(ctx.status.history) if ctx.status else [],
    )
    why = f"superseding {superseding}; " if superseding else ("retried by request; " if retry else "")
    message = (f"rolling out {ctx.target} from {old}: {why}baseline hit rate {_fmt(baseline)} over {lookups} lookups; "
               f"{_step_text(ctx, 1, rollout)}")
    return Plan("start", rollout=rollout, phase="RollingOut", version=old,
                workload=WorkloadPatch(ctx.target, w.replicas - n),
                conditions=(Observation(PROGRESSING, "True", "StepStarted", message),
                            Observation(ROLLED_BACK, "False", "RollingOut", f"rolling out {ctx.target}")),
                event=("Normal", "RolloutStarted", message))


def _evaluate(ctx: _Ctx) -> Plan:
    status = ctx.status
    assert status is not None and status.step_started_at is not None
    step = _clamped_step(ctx, status.step)
    n = ctx.schedule[step - 1]
    new_pods = [p for p in ctx.observed.pods if p.version == ctx.target]
    ready = sum(p.ready for p in new_pods)
    rec = StepRecovery(hit_rate(step_pods(new_pods, ctx.schedule, step, ctx.observed.workload.replicas)),
                       ctx.spec.recovery.threshold * (status.baseline_hit_rate or 0.0))
    lookups = rec.lookups
    patch = _step_patch(ctx, step)
    if ready >= n and rec.recovered(ctx.spec.recovery.min_lookups):
        return _complete(ctx, rec) if step == len(ctx.schedule) else _advance(ctx, step, rec)
    elapsed_s = (ctx.observed.now - status.step_started_at).total_seconds()
    if elapsed_s >= ctx.spec.recovery.window_s:
        reason = (f"step {step}: {ready}/{n} new pods ready; hit rate {_fmt(rec.hit_rate)} over {lookups} lookups "
                  f"did not reach {ctx.spec.recovery.threshold} x baseline {_fmt(status.baseline_hit_rate)} = "
                  f"{rec.needed:.4f} (min {ctx.spec.recovery.min_lookups} lookups) within {ctx.spec.recovery.window}")
        if ctx.spec.on_failure == "pause":
            return _pause(ctx, step, rec, reason)
        return _rollback(ctx, reason, observed_rate=rec.hit_rate)
    rollout = status.model_copy(update={"current_hit_rate": rec.hit_rate})
    changed = rollout != status
    needs_patch = _differs(ctx.observed.workload, patch)
    # Always say where the step stands (a merge of an identical condition writes nothing),
    # so a condition from a pause in the judging (ScaledToZero) never outlives it.
    return Plan("wait", rollout=rollout if changed else None, workload=patch if needs_patch else None,
                conditions=(Observation(PROGRESSING, "True", "WaitingForRecovery",
                                        f"step {step}: {ready}/{n} new pods ready, hit rate {_fmt(rec.hit_rate)} over "
                                        f"{lookups} lookups; needs {rec.needed:.4f} over "
                                        f"{ctx.spec.recovery.min_lookups}"),))


def _scaled_to_zero(ctx: _Ctx) -> Plan:
    """No pods to judge: hold the step and keep restarting its clock, so the workload
    scaled back up gets a whole recovery window instead of an instant rollback."""
    status = ctx.status
    assert status is not None
    rollout = status.model_copy(update={"step_started_at": ctx.observed.now})
    return Plan("hold", rollout=rollout,
                conditions=(Observation(PROGRESSING, "True", "ScaledToZero",
                                        f"step {status.step} on hold: the workload has 0 replicas; the step's "
                                        f"recovery window starts again when pods return"),))


def _fleet_ahead_of_step(ctx: _Ctx) -> bool:
    """Every pod of the fleet runs the target, more than the current step put there.
    The StatefulSet controller does this after a scale to zero: with no pods, its
    rolling update is "complete", so it promotes the update revision to current, and
    the returning pods below the partition come back on the target too."""
    status, w = ctx.status, ctx.observed.workload
    assert status is not None
    step = _clamped_step(ctx, status.step)
    on_target = [p for p in ctx.observed.pods if p.version == ctx.target]
    return step < len(ctx.schedule) and len(on_target) >= w.replicas > ctx.schedule[step - 1]


def _catch_up(ctx: _Ctx) -> Plan:
    """The rule for a fleet that came back whole on the target (`_fleet_ahead_of_step`):
    the rollout moves to its last step, which is where the fleet is, with a fresh
    window, and judges it as any last step (recovered: complete; not within the window:
    roll every pod back, or pause). Re-partitioning cannot put the low ordinals back on
    the old version (the controller's current revision is the target now); only a
    rollback could, and it would restart pods whose caches are already refilling."""
    status, w = ctx.status, ctx.observed.workload
    assert status is not None
    step, last = _clamped_step(ctx, status.step), len(ctx.schedule)
    message = (f"all {w.replicas} pods came back on {ctx.target} at step {step} (a scale to zero lets the "
               f"StatefulSet controller promote its update revision): the rollout moves to its last step, "
               f"judged on the hit rate as before")
    record = _record(ctx, step, "caughtUp", status.current_hit_rate, message)
    rollout = status.model_copy(update={
        "step": last, "canary_percent": 100, "step_started_at": ctx.observed.now, "analysis": None,
        "history": _appended(status.history, record),
        "expected_cold_prefill_tokens_per_s": cold_prefill_tokens_per_s(
            w.replicas, status.baseline_hit_rate, ctx.observed.replica_prefill_tokens_per_s),
    })
    return Plan("catchUp", rollout=rollout, workload=_step_patch(ctx, last),
                conditions=(Observation(PROGRESSING, "True", "FleetCaughtUp", message),),
                event=("Warning", "RolloutCaughtUp", message))


def _evaluate_analysis(ctx: _Ctx) -> Plan:
    """prometheus/alarm sources: tally this tick's measurement (if one was due) and act
    on the verdict; the sidecars' counters only feed the numbers shown."""
    status = ctx.status
    assert status is not None and status.step_started_at is not None
    step = _clamped_step(ctx, status.step)
    n = ctx.schedule[step - 1]
    new_pods = [p for p in ctx.observed.pods if p.version == ctx.target]
    ready = sum(p.ready for p in new_pods)
    a, m = status.analysis, _measurement(ctx, step)
    if m is not None:
        a = analysis.tally(a, m, ctx.observed.now)
    verdict = analysis.judge(ctx.spec.recovery, a or analysis.AnalysisStatus(), ready >= n)
    rate = _analysis_rate(ctx, step, m)
    evidence = f"{ready}/{n} new pods ready; {_source_text(ctx)}: {verdict.reason}"
    if verdict.kind == "pass":
        if step == len(ctx.schedule):
            return _complete_with(ctx, rate, evidence)
        return _advance_with(ctx, step, rate, evidence)
    if verdict.kind == "fail":
        reason = f"step {step}: {evidence}"
        if ctx.spec.on_failure == "pause":
            return _pause_with(ctx, step, rate, reason, "failure", a)
        return _rollback(ctx, reason, observed_rate=rate, cause="AnalysisFailed")
    if verdict.kind == "inconclusive":
        return _pause_with(ctx, step, rate, f"step {step}: {evidence}", "inconclusive", a)
    rollout = status.model_copy(update={"current_hit_rate": rate, "analysis": a})
    patch = _step_patch(ctx, step)
    needs_patch = _differs(ctx.observed.workload, patch)
    if rollout == status and not needs_patch:
        return Plan("wait")
    return Plan("wait", rollout=rollout if rollout != status else None, workload=patch if needs_patch else None,
                conditions=(Observation(PROGRESSING, "True", "WaitingForAnalysis", f"step {step}: {evidence}"),))


def _evaluate_inconclusive_pause(ctx: _Ctx) -> Plan:
    """Paused because the source gave no answer: keep asking; the first conclusive
    measurement resumes the step with a fresh window and fresh counts."""
    status = ctx.status
    assert status is not None
    step = _clamped_step(ctx, status.step)
    m = _measurement(ctx, step)
    if m is None or not analysis.conclusive(m):
        a = analysis.tally(status.analysis, m, ctx.observed.now) if m is not None else status.analysis
        rollout = status.model_copy(update={"analysis": a})
        return Plan("hold", rollout=rollout if rollout != status else None,
                    workload=_step_patch(ctx, step) if _differs(ctx.observed.workload, _step_patch(ctx, step)) else None)
    message = (f"resumed {status.target_version} at step {step}: {_source_text(ctx)} answers again "
               f"({m.message}); the step's recovery window restarts")
    record = _record(ctx, step, "resumed", m.value, message)
    rollout = status.model_copy(update={
        "paused_reason": None, "step_started_at": ctx.observed.now, "history": _appended(status.history, record),
        "analysis": analysis.tally(None, m, ctx.observed.now)})
    return Plan("resume", rollout=rollout, phase="RollingOut",
                conditions=(Observation(PROGRESSING, "True", "Resumed", message),
                            Observation(DEGRADED, "False", "Resumed", message)),
                event=("Normal", "RolloutResumed", message))


def _measurement(ctx: _Ctx, step: int) -> analysis.Measurement | None:
    probe, rec = ctx.observed.probe, ctx.spec.recovery
    status = ctx.status
    if probe is None or status is None or status.step_started_at is None:
        return None
    if rec.source == "alarm":
        assert rec.alarm is not None
        lookups = hit_rate(_judged_pods(ctx, step)).lookups
        return analysis.measure_alarm(probe, rec.alarm.alert_name, ctx.target, lookups, rec.min_lookups)
    window_over = (ctx.observed.now - status.step_started_at).total_seconds() >= rec.window_s
    return analysis.measure_hit_rate(probe, rec.threshold * (status.baseline_hit_rate or 0.0), window_over)


def _judged_pods(ctx: _Ctx, step: int) -> list[PodSample]:
    new_pods = [p for p in ctx.observed.pods if p.version == ctx.target]
    return step_pods(new_pods, ctx.schedule, step, ctx.observed.workload.replicas)


def _analysis_rate(ctx: _Ctx, step: int, m: analysis.Measurement | None) -> float | None:
    """The hit rate shown in status: the query's value (prometheus), else the new
    pods' counters as the sidecars report them."""
    if m is not None and m.value is not None:
        return m.value
    if ctx.spec.recovery.source == "prometheus" and ctx.status is not None:
        return ctx.status.current_hit_rate
    return hit_rate(_judged_pods(ctx, step)).rate


def _source_text(ctx: _Ctx) -> str:
    rec = ctx.spec.recovery
    if rec.source == "alarm" and rec.alarm is not None:
        return f"alarm {rec.alarm.alert_name} ({rec.alarm.api} {rec.alarm.url})"
    if rec.source == "prometheus" and rec.prometheus is not None:
        return f"prometheus {rec.prometheus.url}"
    return "sidecars"


def _advance(ctx: _Ctx, step: int, rec: StepRecovery) -> Plan:
    return _advance_with(ctx, step, rec.hit_rate, f"{rec.lookups} lookups, needed {rec.needed:.4f}",
                         f"hit rate {_fmt(rec.hit_rate)} >= {rec.needed:.4f} over {rec.lookups} lookups")


def _advance_with(ctx: _Ctx, step: int, rate: float | None, evidence: str, summary: str | None = None,
                  outcome: str = "recovered") -> Plan:
    status, w = ctx.status, ctx.observed.workload
    assert status is not None
    nxt = step + 1
    n = ctx.schedule[nxt - 1]
    warm = _warm_summary(status) + _first_minute_summary(status, step)
    evidence, summary = evidence + warm, (summary + warm if summary else None)
    record = _record(ctx, step, outcome, rate, evidence)
    rollout = status.model_copy(update={
        "step": nxt, "canary_percent": _percent(n, w.replicas), "current_hit_rate": rate,
        "step_started_at": ctx.observed.now, "history": _appended(status.history, record),
        "expected_cold_prefill_tokens_per_s": cold_prefill_tokens_per_s(
            n - ctx.schedule[step - 1], status.baseline_hit_rate, ctx.observed.replica_prefill_tokens_per_s),
        "analysis": None, "paused_reason": None,
    })
    message = f"step {step} {outcome}: {summary or evidence}; {_step_text(ctx, nxt, rollout)}"
    return Plan("advance", rollout=rollout, workload=WorkloadPatch(ctx.target, w.replicas - n),
                conditions=(Observation(PROGRESSING, "True", "StepStarted", message),),
                event=("Normal", "RolloutStep", message))


def _complete(ctx: _Ctx, rec: StepRecovery) -> Plan:
    return _complete_with(ctx, rec.hit_rate, f"{rec.lookups} lookups, needed {rec.needed:.4f}")


def _complete_with(ctx: _Ctx, rate: float | None, evidence: str) -> Plan:
    status = ctx.status
    assert status is not None
    warm = _warm_summary(status) + _first_minute_summary(status, status.step)
    evidence += warm
    record = _record(ctx, status.step, "completed", rate, evidence)
    rollout = status.model_copy(update={"current_hit_rate": rate, "canary_percent": 100,
                                        "expected_cold_prefill_tokens_per_s": 0.0, "paused_reason": None,
                                        "history": _appended(status.history, record)})
    message = (f"{ctx.target} serves the whole fleet ({ctx.observed.workload.replicas} pods): hit rate "
               f"{_fmt(rate)} vs baseline {_fmt(status.baseline_hit_rate)}{warm}")
    return Plan("complete", rollout=rollout, phase="Ready", version=ctx.target,
                workload=WorkloadPatch(ctx.target, 0),
                conditions=(Observation(PROGRESSING, "False", "Completed", message),),
                event=("Normal", "RolloutCompleted", message))


def _rollback(ctx: _Ctx, reason: str, observed_rate: float | None = None, requested: bool = False,
              cause: str = "HitRateNotRecovered", outcome: str = "rolledBack") -> Plan:
    """Every pod back on the old version: template restored and partition 0, so no pod
    is left on the new version whatever step the rollout had reached."""
    status = ctx.status
    assert status is not None and ctx.serving is not None
    reason += _first_minute_summary(status, _clamped_step(ctx, status.step))
    record = _record(ctx, status.step, outcome, observed_rate, reason)
    rollout = status.model_copy(update={"current_hit_rate": observed_rate, "canary_percent": 0,
                                        "expected_cold_prefill_tokens_per_s": 0.0, "paused_reason": None,
                                        "history": _appended(status.history, record)})
    message = f"rolled back {status.target_version} to {ctx.serving}: {reason}"
    return Plan("rollback", rollout=rollout, phase="Ready" if requested else "RolledBack",
                workload=WorkloadPatch(ctx.serving, 0),
                conditions=(Observation(PROGRESSING, "False", "RolledBack", message),
                            Observation(ROLLED_BACK, "False" if requested else "True",
                                        "Requested" if requested else cause, message)),
                event=("Normal" if requested else "Warning", "RolledBack", message))


def _pause(ctx: _Ctx, step: int, rec: StepRecovery, reason: str) -> Plan:
    return _pause_with(ctx, step, rec.hit_rate, reason, "failure", ctx.status.analysis if ctx.status else None)


# Why a pause happened, as the condition's reason and the message's advice.
_PAUSE_WORDS = {
    "failure": ("HitRateNotRecovered", "onFailure: pause",
                "kubectl kvtier rollout abort (or set spec.model.weightsVersion back to {old}) to roll back, "
                "or promote to go on"),
    "inconclusive": ("AnalysisInconclusive", "analysis inconclusive",
                     "it resumes by itself once the source answers with data; abort or promote to decide now"),
    "manual": ("PausedByRequest", "paused by request", "kubectl kvtier rollout resume to go on"),
}


def _pause_with(ctx: _Ctx, step: int, rate: float | None, reason: str, why: str,
                a: "analysis.AnalysisStatus | None") -> Plan:
    status = ctx.status
    assert status is not None
    cause, label, advice = _PAUSE_WORDS[why]
    record = _record(ctx, step, "paused", rate, reason)
    rollout = status.model_copy(update={"current_hit_rate": rate, "paused_reason": why, "analysis": a,
                                        "history": _appended(status.history, record)})
    message = f"paused {status.target_version} at step {step} ({label}): {reason}; {advice.format(old=ctx.serving)}"
    return Plan("pause", rollout=rollout, phase="Paused",
                conditions=(Observation(PROGRESSING, "False", "Paused", message),
                            Observation(DEGRADED, "True", cause, message)),
                event=("Warning", "RolloutPaused", message))


def _hold(ctx: _Ctx, patch: WorkloadPatch) -> Plan:
    """A terminal state waiting for a person: only keep the workload where it was left."""
    return Plan("hold", workload=patch if _differs(ctx.observed.workload, patch) else None)


def _refuse(ctx: _Ctx, reason: str, message: str) -> Plan:
    return Plan("refuse", conditions=(Observation(PROGRESSING, "False", reason, message),))


# --- helpers ---------------------------------------------------------------------------


def _clamped_step(ctx: _Ctx, step: int) -> int:
    """A recorded step as a 1-based index into the schedule, clamped to it: step 0
    reads as the first step, and a schedule edited shorter mid-rollout as its last."""
    return min(max(step, 1), len(ctx.schedule))


def _step_patch(ctx: _Ctx, step: int) -> WorkloadPatch:
    n = ctx.schedule[_clamped_step(ctx, step) - 1]
    return WorkloadPatch(ctx.target, ctx.observed.workload.replicas - n)


def _differs(w: Workload, patch: WorkloadPatch) -> bool:
    return w.template_version != patch.template_version or w.partition != patch.partition


def _percent(new_pods: int, replicas: int) -> int:
    return round(100 * new_pods / replicas) if replicas else 0


def _step_text(ctx: _Ctx, step: int, rollout: RolloutStatus) -> str:
    n, r = ctx.schedule[step - 1], ctx.observed.workload.replicas
    rec = ctx.spec.recovery
    return (f"step {step}/{len(ctx.schedule)}: {n}/{r} pods ({rollout.canary_percent}%) on the new version, "
            f"expected cold-cache prefill up to {rollout.expected_cold_prefill_tokens_per_s:,.0f} tokens/s; "
            f"recovery: hit rate >= {rec.threshold} x baseline over >= {rec.min_lookups} lookups within {rec.window}"
            + _warm_text(ctx.spec, ctx.observed.replica_prefill_tokens_per_s))


def _warm_summary(status: RolloutStatus) -> str:
    """The rollout's warm-before-ready so far, for the history and the step's Event:
    pods by outcome, prompt tokens prefilled (nothing when no pod was warmed)."""
    mine = [w for w in status.warmups if w.version == status.target_version]
    if not mine:
        return ""
    by = {o: sum(w.outcome == o for w in mine) for o in ("Warmed", "WarmupFailed", "WarmupTimedOut")}
    return (f"; warm-before-ready so far: {by['Warmed']} pods warmed, {by['WarmupFailed']} failed, "
            f"{by['WarmupTimedOut']} timed out, {sum(w.tokens for w in mine):,} prompt tokens prefilled of "
            f"{sum(w.budget_tokens for w in mine):,} budgeted")


def _first_minute_summary(status: RolloutStatus, step: int) -> str:
    """The step's first-minute figure, once its new pods' windows are over."""
    f = first_minute.of_step(status, step)
    return f"; {first_minute.text(f)}" if f is not None else ""


def _warm_text(spec: Rollout, replica_tokens_per_s: float = 0.0) -> str:
    """The step's warm-before-ready budget, for its capacity-event message: the policy's
    maxTokens, or less where the capacity estimate says a new pod's engine cannot
    prefill that much within its deadline (`rollout_warmup.budget`)."""
    w = spec.warmup
    if w is None or not spec.warms:
        return ""
    b = rw.budget(w.max_tokens, w.timeout_s, replica_tokens_per_s)
    return (f"; warm-before-ready: each new pod prefills up to {b.tokens:,} prompt tokens of its tenants' "
            f"hottest prefixes within {w.timeout} before it takes traffic ({rw.budget_text(b, w.timeout_s)})")


def _record(ctx: _Ctx, step: int, outcome: str, rate: float | None, message: str) -> RolloutRecord:
    figure = first_minute.of_step(ctx.status, step)
    return RolloutRecord(version=ctx.target if ctx.status is None else (ctx.status.target_version or ctx.target),
                         step=step, outcome=outcome, hit_rate=rate, time=ctx.observed.now, message=message[:1024],
                         first_minute=first_minute.for_history(figure) if figure is not None else None)


def _appended(history: list[RolloutRecord], record: RolloutRecord) -> list[RolloutRecord]:
    return (list(history) + [record])[-HISTORY_KEPT:]


def _fmt(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate:.4f}"
