"""A rollout step's new pods in their first minute of traffic: pure. The figure the
rollout history records per step (issue #24: with warm-before-ready, a new pod's first
minute should hit nearly as often as the old version; cold, it hits ~never).

Per tick (`observe`, before the planner), from the workload's pods as the rollout sees
them (`rollout.PodSample`: Ready, version, sidecar counters since the pod started):

    a pod on the target version, serving, with counters, not yet measured, while the
    rollout is in flight                  -> a window opens: its counters now, the step
                                             it came up in, and whether its warm-up
                                             prefilled anything (warm)
    its window open for >= `window_s`     -> closed: the counters' growth over it
    counters below the start (its sidecar
      restarted)                          -> the window opens again from now
    the pod gone, or off the target       -> dropped (a rollback, a deleted pod)
    every window of a step closed, and the step's pods all measured (as many as the
      schedule added at that step), or the rollout past that step
                                          -> the step's `FirstMinute`: loaded over prompt
                                             tokens summed over its pods (warm and cold
                                             apart too), next to the old version's hit
                                             rate then (its pods' counters; with none
                                             left, the rollout's baseline); its windows
                                             dropped, the pods named in it

The figure goes into `status.rollout.firstMinutes`, into the step's history entry (the
planner attaches it when it writes the entry; one written before the figure gets it
here), and into an Event of its own (`text`). The hit figure is the one the recovery
check reads: tokens the engine loaded from kvtier over the prompt tokens it looked up.
Traffic only: the warm-up's requests are in none of these counters (the sidecar counts
them apart, `kvtier_warmup_*`: they miss by design and would say nothing of the new
version), and were an older engine to count them as traffic, they came before the pod
served, so before its window opened.
Level-based: everything lives in status, so a restarted operator closes the same windows.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from kvtier.policy import (MAX_FIRST_MINUTE_PODS, MAX_HISTORY, Counters, FirstMinute, PodFirstMinute, PodWarmup,
                           RolloutRecord, RolloutStatus)

from kvtier_operator.options import FIRST_MINUTE_S

if TYPE_CHECKING:
    from kvtier_operator.rollout import PodSample

# The window: a pod's first minute of traffic (the operator's --first-minute-s, whose
# default this is, shortens it for tests).
WINDOW_S = FIRST_MINUTE_S
RATE_DIGITS = 4
IN_FLIGHT = ("RollingOut", "Paused")
# History entries a figure is attached to after the fact: those that end a step (a
# pause or a resume does not).
_STEP_ENDS = ("recovered", "completed", "promoted", "caughtUp", "rolledBack", "aborted")


def rate(loaded: int, prompt: int) -> float | None:
    return round(loaded / prompt, RATE_DIGITS) if prompt else None


def warm_pods(warmups: Iterable[PodWarmup], version: str) -> set[str]:
    """Pods of `version` whose warm-before-ready prefilled at least one prompt."""
    return {w.pod for w in warmups if w.version == version and w.tokens > 0}


def _counters(p: "PodSample") -> Counters | None:
    if p.lookups is None:
        return None
    return Counters(lookups=p.lookups, loaded_tokens=p.loaded_tokens or 0, prompt_tokens=p.prompt_tokens or 0)


def _behind(now: Counters, start: Counters) -> bool:
    return (now.lookups < start.lookups or now.loaded_tokens < start.loaded_tokens
            or now.prompt_tokens < start.prompt_tokens)


def _growth(now: Counters, start: Counters) -> Counters:
    return Counters(lookups=now.lookups - start.lookups, loaded_tokens=now.loaded_tokens - start.loaded_tokens,
                    prompt_tokens=now.prompt_tokens - start.prompt_tokens)


def observe(r: RolloutStatus | None, phase: str | None, pods: Sequence["PodSample"], schedule: Sequence[int],
            now: datetime, window_s: float = WINDOW_S) -> tuple[RolloutStatus | None, list[FirstMinute]]:
    """`r` with this tick's windows opened and closed and the steps whose figure is
    complete summed up (see the module doc); and those new figures, for their Events."""
    if r is None or r.target_version is None:
        return r, []
    target = r.target_version
    on_target = {p.name: p for p in pods if p.version == target}
    windows: list[PodFirstMinute] = []
    for w in r.first_minute_pods:
        p = on_target.get(w.pod)
        if p is None:
            continue  # gone, or back on the old version
        c = _counters(p)
        if w.window is None and c is not None:
            if _behind(c, w.start):
                w = w.model_copy(update={"started_at": now, "start": c})
            elif (now - w.started_at).total_seconds() >= window_s:
                w = w.model_copy(update={"window": _growth(c, w.start)})
        windows.append(w)
    measured = {n for f in r.first_minutes for n in f.pod_names} | {w.pod for w in windows}
    if phase in IN_FLIGHT:
        warm = warm_pods(r.warmups, target)
        step = max(r.step, 1)
        for name in sorted(on_target):
            p = on_target[name]
            c = _counters(p)
            if name in measured or not p.ready or c is None or len(windows) >= MAX_FIRST_MINUTE_PODS:
                continue
            windows.append(PodFirstMinute(pod=name, step=step, warm=name in warm, started_at=now, start=c))
    figures = list(r.first_minutes)
    new: list[FirstMinute] = []
    done_steps = {f.step for f in figures}
    for step in sorted({w.step for w in windows} - done_steps):
        mine = [w for w in windows if w.step == step]
        if any(w.window is None for w in mine):
            continue
        expected = _added(schedule, step)
        moved_on = phase not in IN_FLIGHT or r.step > step
        if len(mine) < expected and not moved_on and len(windows) < MAX_FIRST_MINUTE_PODS:
            continue
        old = [p for p in pods if p.version != target]
        new.append(figure(step, mine, old, r.baseline_hit_rate, now, window_s))
        windows = [w for w in windows if w.step != step]
    if not new and windows == list(r.first_minute_pods):
        return r, []
    figures = (figures + new)[-MAX_HISTORY:]
    history = attach(r.history, target, new)
    return r.model_copy(update={"first_minute_pods": windows, "first_minutes": figures, "history": history}), new


def measuring(r: RolloutStatus | None, now: datetime, window_s: float = WINDOW_S) -> set[str]:
    """Pods whose first-minute window is open and not overdue (opened less than two
    windows ago: a pod whose counters stopped answering does not hold anything up). A
    Deployment pair's hand-back keeps the canary while its pods are among them, so the
    last step's figure is measured on the pods that step brought up."""
    if r is None:
        return set()
    return {w.pod for w in r.first_minute_pods
            if w.window is None and (now - w.started_at).total_seconds() < 2 * window_s}


def _added(schedule: Sequence[int], step: int) -> int:
    """New-version pods the schedule adds at `step` (1-based); a step past the schedule adds none."""
    if not 1 <= step <= len(schedule):
        return 0
    return schedule[step - 1] - (schedule[step - 2] if step > 1 else 0)


def figure(step: int, windows: Sequence[PodFirstMinute], old_pods: Sequence["PodSample"], baseline: float | None,
           now: datetime, window_s: float) -> FirstMinute:
    """One step's figure from its pods' closed windows: summed tokens, warm and cold
    apart, and the old version's hit rate now (its pods' counters), else `baseline`."""
    def total(ws: Iterable[PodFirstMinute]) -> Counters:
        ws = [w.window for w in ws if w.window is not None]
        return Counters(lookups=sum(c.lookups for c in ws), loaded_tokens=sum(c.loaded_tokens for c in ws),
                        prompt_tokens=sum(c.prompt_tokens for c in ws))

    every, warm, cold = total(windows), total(w for w in windows if w.warm), total(w for w in windows if not w.warm)
    answered = [p for p in old_pods if p.lookups is not None]
    old_loaded, old_prompt = sum(p.loaded_tokens or 0 for p in answered), sum(p.prompt_tokens or 0 for p in answered)
    if old_prompt:
        base, source = rate(old_loaded, old_prompt), "oldPods"
    else:
        base, source = (None, None) if baseline is None else (round(baseline, RATE_DIGITS), "rolloutStart")
    n_warm = sum(w.warm for w in windows)
    return FirstMinute(
        step=step, window_s=window_s, pods=len(windows), warm_pods=n_warm, cold_pods=len(windows) - n_warm,
        lookups=every.lookups, loaded_tokens=every.loaded_tokens, prompt_tokens=every.prompt_tokens,
        hit_rate=rate(every.loaded_tokens, every.prompt_tokens),
        warm_hit_rate=rate(warm.loaded_tokens, warm.prompt_tokens),
        cold_hit_rate=rate(cold.loaded_tokens, cold.prompt_tokens), baseline_hit_rate=base, baseline_source=source,
        started_at=min(w.started_at for w in windows), measured_at=now, pod_names=sorted(w.pod for w in windows))


def attach(history: Sequence[RolloutRecord], version: str, figures: Iterable[FirstMinute]) -> list[RolloutRecord]:
    """The history with each figure on its step's entry, when one was written already:
    the newest entry ending that step of `version`, if written after its pods came up
    (an older one is an earlier rollout's)."""
    out = list(history)
    for f in figures:
        for i in range(len(out) - 1, -1, -1):
            h = out[i]
            if h.version == version and h.step == f.step and h.outcome in _STEP_ENDS:
                if h.first_minute is None and h.time >= f.started_at:
                    out[i] = h.model_copy(update={"first_minute": for_history(f)})
                break
    return out


def for_history(f: FirstMinute) -> FirstMinute:
    """The figure as a history entry carries it (without the pods' names)."""
    return f.model_copy(update={"pod_names": []})


def of_step(r: RolloutStatus | None, step: int) -> FirstMinute | None:
    if r is None:
        return None
    return next((f for f in reversed(r.first_minutes) if f.step == step), None)


def text(f: FirstMinute) -> str:
    """The figure in words, for the step's Event and history message."""
    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.4f}"

    ratio = (f" ({f.hit_rate / f.baseline_hit_rate:.2f}x)" if f.hit_rate is not None and f.baseline_hit_rate
             else "")
    where = {"oldPods": "the old version's pods now", "rolloutStart": "the rollout's baseline"}.get(
        f.baseline_source or "", "no baseline")
    parts = [f"step {f.step}'s {f.pods} new pods in their first {f.window_s:g}s of traffic: hit rate "
             f"{fmt(f.hit_rate)} vs {fmt(f.baseline_hit_rate)} ({where}){ratio} over {f.lookups} lookups; "
             f"{f.warm_pods} warm, {f.cold_pods} cold"]
    if f.warm_pods and f.cold_pods:
        parts.append(f" (warm {fmt(f.warm_hit_rate)}, cold {fmt(f.cold_hit_rate)})")
    return "".join(parts)
