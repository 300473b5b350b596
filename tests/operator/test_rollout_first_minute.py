"""A rollout step's new pods in their first minute of traffic (`first_minute`, pure):
windows opened from the sidecars' counters when a pod first serves, closed after the
window, summed per step next to the old version's hit rate, warm and cold apart; and
the planner's history entry and Event carrying the figure."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

from kvtier import policy
from kvtier.policy import Counters, PodWarmup, RolloutRecord, RolloutStatus
from kvtier_operator import first_minute as fm
from kvtier_operator.rollout import Observed, PodSample, Workload, plan, schedule
from test_rollout_warmup_planner import NEW, OLD, spec

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
# canary 1, then 50%, 100% of 4 pods: [1, 2, 4]
SPEC = spec(canaryPods=1, steps=[50, 100], recovery={"minLookups": 1, "threshold": 0.5})
SCHEDULE = schedule(SPEC.rollout, 4)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def status(step: int = 1, **kw) -> RolloutStatus:
    return RolloutStatus(target_version=NEW, step=step, baseline_hit_rate=0.8, step_started_at=T0, **kw)


def old_pods(loaded: int = 900, prompt: int = 1000) -> tuple[PodSample, ...]:
    return (PodSample("llm-0", OLD, True, 50, loaded // 2, prompt // 2),
            PodSample("llm-1", OLD, True, 50, loaded - loaded // 2, prompt - prompt // 2))


def test_a_pods_window_opens_when_it_first_serves_and_closes_with_its_counters_growth():
    warmed = [PodWarmup(pod="llm-3", version=NEW, outcome="Warmed", tokens=384, finished_at=T0)]
    r = status(warmups=warmed)
    # Gated (not Ready): nothing yet, though its warm-up's prefill shows in its counters.
    gated = old_pods() + (PodSample("llm-3", NEW, False, 6, 0, 384),)
    assert fm.observe(r, "RollingOut", gated, SCHEDULE, at(0), 60) == (r, [])
    # Ready: the window opens from the counters now (the warm-up's 384 prompt tokens excluded).
    r1, figs = fm.observe(r, "RollingOut", old_pods() + (PodSample("llm-3", NEW, True, 6, 0, 384),), SCHEDULE,
                          at(1), 60)
    assert figs == [] and len(r1.first_minute_pods) == 1
    w = r1.first_minute_pods[0]
    assert (w.pod, w.step, w.warm, w.started_at, w.start, w.window) == (
        "llm-3", 1, True, at(1), Counters(lookups=6, loaded_tokens=0, prompt_tokens=384), None)
    # Not a minute yet: nothing changes.
    serving = old_pods() + (PodSample("llm-3", NEW, True, 20, 300, 784),)
    assert fm.observe(r1, "RollingOut", serving, SCHEDULE, at(60), 60) == (r1, [])
    # A minute: closed, and the step (one pod added) summed up.
    r2, [f] = fm.observe(r1, "RollingOut", serving, SCHEDULE, at(61), 60)
    assert r2.first_minute_pods == [] and r2.first_minutes == [f]
    assert (f.step, f.pods, f.warm_pods, f.cold_pods, f.lookups, f.loaded_tokens, f.prompt_tokens) == (
        1, 1, 1, 0, 14, 300, 400)
    assert (f.hit_rate, f.warm_hit_rate, f.cold_hit_rate) == (0.75, 0.75, None)
    assert (f.baseline_hit_rate, f.baseline_source) == (0.9, "oldPods")  # the old pods' 900/1000 now
    assert (f.started_at, f.measured_at, f.window_s, f.pod_names) == (at(1), at(61), 60, ["llm-3"])
    assert fm.text(f) == ("step 1's 1 new pods in their first 60s of traffic: hit rate 0.7500 vs 0.9000 "
                          "(the old version's pods now) (0.83x) over 14 lookups; 1 warm, 0 cold")
    # Measured once: later ticks neither reopen nor repeat it.
    later = old_pods() + (PodSample("llm-3", NEW, True, 90, 2000, 2400),)
    assert fm.observe(r2, "RollingOut", later, SCHEDULE, at(200), 60) == (r2, [])


def test_a_step_waits_for_all_its_pods_unless_the_rollout_moved_past_it():
    r = status(step=2)
    two = (PodSample("llm-0", OLD, True, 10, 80, 100), PodSample("llm-1", OLD, True, 10, 80, 100),
           PodSample("llm-2", NEW, True, 0, 0, 0), PodSample("llm-3", NEW, True, 0, 0, 0))
    # Step 2 adds one pod, but both new pods come up during it: both are its.
    r1, _ = fm.observe(r, "RollingOut", two, SCHEDULE, at(0), 10)
    assert sorted((w.pod, w.step, w.warm) for w in r1.first_minute_pods) == [
        ("llm-2", 2, False), ("llm-3", 2, False)]
    grown = two[:2] + (PodSample("llm-2", NEW, True, 5, 10, 100), PodSample("llm-3", NEW, True, 5, 30, 100))
    r2, [f] = fm.observe(r1, "RollingOut", grown, SCHEDULE, at(10), 10)
    assert (f.pods, f.cold_pods, f.hit_rate, f.cold_hit_rate, f.baseline_hit_rate) == (2, 2, 0.2, 0.2, 0.8)
    assert "(warm" not in fm.text(f)

    # One pod of a two-pod step: it waits for the other ...
    r = status(step=3)
    first = two[:2] + (PodSample("llm-1", NEW, True, 0, 0, 0),)
    r1, _ = fm.observe(r, "RollingOut", (two[0], first[2]), SCHEDULE, at(0), 10)
    grown = (two[0], PodSample("llm-1", NEW, True, 4, 40, 50), PodSample("llm-2", NEW, False, 0, 0, 0))
    r2, figs = fm.observe(r1, "RollingOut", grown, SCHEDULE, at(10), 10)
    assert figs == [] and r2.first_minute_pods[0].window == Counters(lookups=4, loaded_tokens=40, prompt_tokens=50)
    # ... and a completed rollout sums it up with what it has (no old pods: the rollout's baseline).
    done = (PodSample("llm-1", NEW, True, 9, 90, 100), PodSample("llm-2", NEW, True, 0, 0, 0))
    r3, [f] = fm.observe(r2, "Ready", done, SCHEDULE, at(11), 10)
    assert (f.step, f.pods, f.hit_rate, f.baseline_hit_rate, f.baseline_source) == (3, 1, 0.8, 0.8, "rolloutStart")
    assert r3.first_minute_pods == []  # and llm-2, Ready only after completion, is not measured
    assert fm.observe(r3, "Ready", done, SCHEDULE, at(30), 10) == (r3, [])


def test_a_restarted_sidecar_reopens_the_window_and_a_pod_gone_is_dropped():
    r1, _ = fm.observe(status(), "RollingOut", old_pods() + (PodSample("llm-3", NEW, True, 10, 50, 100),),
                       SCHEDULE, at(0), 60)
    reset = old_pods() + (PodSample("llm-3", NEW, True, 2, 0, 20),)
    r2, figs = fm.observe(r1, "RollingOut", reset, SCHEDULE, at(70), 60)
    assert figs == [] and (r2.first_minute_pods[0].started_at, r2.first_minute_pods[0].start.lookups) == (at(70), 2)
    # A rollback: the pod back on the old version, its window gone with it, no figure.
    back = old_pods() + (PodSample("llm-3", OLD, True, 0, 0, 0),)
    r3, figs = fm.observe(r2, "RolledBack", back, SCHEDULE, at(200), 60)
    assert figs == [] and r3.first_minute_pods == [] and r3.first_minutes == []
    # No rollout, or an unanswered sidecar: nothing.
    assert fm.observe(None, "Ready", back, SCHEDULE, at(0)) == (None, [])
    silent = old_pods() + (PodSample("llm-3", NEW, True),)
    assert fm.observe(status(), "RollingOut", silent, SCHEDULE, at(0)) == (status(), [])


def test_the_figure_goes_into_the_steps_history_entry_written_before_or_after_it():
    entry = RolloutRecord(version=NEW, step=1, outcome="recovered", hit_rate=0.7, time=at(5))
    older = RolloutRecord(version=NEW, step=1, outcome="rolledBack", hit_rate=0.0, time=at(-3600))
    r1, _ = fm.observe(status(step=2, history=[older, entry]), "RollingOut",
                       old_pods() + (PodSample("llm-3", NEW, True, 0, 0, 0),), SCHEDULE, at(0), 60)
    # The step advanced before its minute was over (llm-3 came up in step 1 here: make it so).
    r1 = r1.model_copy(update={"first_minute_pods": [w.model_copy(update={"step": 1})
                                                     for w in r1.first_minute_pods]})
    r2, [f] = fm.observe(r1, "RollingOut", old_pods() + (PodSample("llm-3", NEW, True, 8, 80, 100),), SCHEDULE,
                         at(60), 60)
    assert r2.history[0].first_minute is None  # an earlier rollout's entry
    assert r2.history[1].first_minute == f.model_copy(update={"pod_names": []})

    # Known before the step ends: the planner writes it into the entry and the Event.
    s = status(step=1, first_minutes=[f])
    pods = old_pods() + (PodSample("llm-3", NEW, True, 100, 800, 1000),)
    advanced = plan(SPEC.rollout, NEW, OLD, s, "RollingOut", Observed(Workload(4, NEW, 3), pods, at(90), 1000.0))
    assert advanced.kind == "advance"
    assert advanced.rollout.history[-1].first_minute == fm.for_history(f)
    assert fm.text(f) in advanced.event[2] and fm.text(f) in advanced.rollout.history[-1].message
    assert advanced.rollout.first_minutes == [f]
    wire = advanced.rollout.k8s_json()
    assert wire["history"][-1]["firstMinute"]["hitRate"] == 0.8 and wire["firstMinutes"][0]["podNames"] == ["llm-3"]
    assert policy.RolloutStatus.model_validate(wire) == advanced.rollout


def test_warm_pods_are_those_whose_warm_up_prefilled_something_for_this_version():
    ws = [PodWarmup(pod="a", version=NEW, outcome="Warmed", tokens=1, finished_at=T0),
          PodWarmup(pod="b", version=NEW, outcome="Warmed", tokens=0, finished_at=T0),
          PodWarmup(pod="c", version=NEW, outcome="WarmupTimedOut", tokens=64, finished_at=T0),
          PodWarmup(pod="d", version=OLD, outcome="Warmed", tokens=64, finished_at=T0),
          PodWarmup(pod="e", version=NEW, outcome="WarmupFailed", tokens=0, finished_at=T0)]
    assert fm.warm_pods(ws, NEW) == {"a", "c"}


def test_the_plugins_status_shows_each_steps_first_minute():
    from kvtier_operator.kubectl_plugin import status_lines

    f = fm.figure(1, [policy.PodFirstMinute(pod="llm-3", step=1, warm=True, started_at=T0, start=Counters(),
                                            window=Counters(lookups=9, loaded_tokens=45, prompt_tokens=50))],
                  old_pods(), None, at(60), 60)
    body = {"metadata": {"namespace": "ns", "name": "llm"}, "spec": {},
            "status": {"rollout": status(first_minutes=[f]).k8s_json()}}
    assert ("  first minute step  1: hit rate 0.9000 vs baseline 0.9000, 1 warm / 0 cold pods, 9 lookups in 60s"
            in status_lines(body))


def test_pods_measuring_are_those_with_an_open_window_not_yet_overdue():
    """What a Deployment pair's hand-back waits for before its canary goes: open windows
    only, and none opened two windows ago or more (a pod whose counters stopped answering
    holds nothing up)."""
    assert fm.measuring(None, at(0), 60) == set()
    r1, _ = fm.observe(status(), "RollingOut", old_pods() + (PodSample("llm-3", NEW, True, 6, 0, 384),), SCHEDULE,
                       at(1), 60)
    assert fm.measuring(r1, at(2), 60) == {"llm-3"}
    assert fm.measuring(r1, at(120), 60) == {"llm-3"}
    assert fm.measuring(r1, at(121), 60) == set()  # overdue
    # Closed (a minute of traffic): no longer measuring.
    r2, [_] = fm.observe(r1, "Ready", old_pods() + (PodSample("llm-3", NEW, True, 20, 300, 784),), SCHEDULE,
                         at(61), 60)
    assert fm.measuring(r2, at(62), 60) == set()
