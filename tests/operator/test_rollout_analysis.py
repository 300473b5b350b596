"""Rollout analysis for the prometheus and alarm sources (pure): measurements, limits,
verdicts, and the planner acting on them — no data or an unreachable Prometheus pauses
(never rolls back) and resumes by itself; a firing alarm rolls back at once."""
from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest

from kvtier.policy import AnalysisStatus, Recovery, Rollout, RolloutStatus
from kvtier_operator import analysis, rollout
from kvtier_operator.analysis import Probe
from kvtier_operator.rollout import Observed, PodSample, Workload, WorkloadPatch
from test_rollout_planner import NEW, OLD, REPLICA_TOKENS_S, T0, sample

URL = "http://127.0.0.1:9090"


def prom_spec(**kw) -> Rollout:
    rec = Recovery(threshold=0.8, window="20s", min_lookups=10, source="prometheus", interval="5s", count=2,
                   prometheus={"url": URL}, **kw)
    return Rollout(canary_pods=1, steps=[50, 100], recovery=rec)


def alarm_spec(**kw) -> Rollout:
    rec = Recovery(window="20s", min_lookups=10, source="alarm", interval="5s", count=2,
                   alarm={"url": URL}, **kw)
    return Rollout(canary_pods=1, steps=[50, 100], recovery=rec)


def obs(seconds: float, probe: Probe | None, lookups: int = 50, hits: int = 40, baseline_probe=None) -> Observed:
    pods = tuple(sample(f"llm-{i}", v, True, lookups, hits) for i, v in enumerate([OLD] * 3 + [NEW]))
    return Observed(Workload(4, NEW, 3), pods, T0 + timedelta(seconds=seconds), REPLICA_TOKENS_S,
                    probe=probe, baseline_probe=baseline_probe)


def rolling(a: AnalysisStatus | None = None, paused: str | None = None) -> RolloutStatus:
    return RolloutStatus(target_version=NEW, step=1, baseline_hit_rate=0.5, step_started_at=T0, analysis=a,
                         paused_reason=paused)


def test_query_placeholders_are_filled_for_the_version_judged():
    q = analysis.render_query('x{namespace="{{namespace}}",policy="{{policy}}",version="{{version}}"}'
                              "[{{window}}] >= {{minLookups}}",
                              namespace="ns", policy="llm", version=NEW, window="1m", min_lookups=40)
    assert q == f'x{{namespace="ns",policy="llm",version="{NEW}"}}[1m] >= 40'
    default = analysis.render_query(prom_spec().recovery.prometheus.query, namespace="ns", policy="llm",
                                    version=NEW, window="1m", min_lookups=40)
    assert "{{" not in default and f'version="{NEW}"' in default and ">= 40" in default


def test_measurements_classify_values_missing_data_and_errors():
    assert analysis.measure_hit_rate(Probe(value=0.45), 0.4, False).result == "successful"
    assert analysis.measure_hit_rate(Probe(value=0.1), 0.4, False).result == "pending"
    assert analysis.measure_hit_rate(Probe(value=0.1), 0.4, True).result == "failed"
    assert analysis.measure_hit_rate(Probe(), 0.4, True).result == "inconclusive"
    assert analysis.measure_hit_rate(Probe(value=float("nan")), 0.4, True).result == "inconclusive"
    assert analysis.measure_hit_rate(Probe(error="refused"), 0.4, True).result == "error"
    assert analysis.measure_alarm(Probe(firing=("since t",)), "A", NEW, 100, 10).result == "failed"
    assert analysis.measure_alarm(Probe(), "A", NEW, 9, 10).result == "inconclusive"
    assert analysis.measure_alarm(Probe(pending=("since t",)), "A", NEW, 100, 10).result == "inconclusive"
    assert analysis.measure_alarm(Probe(), "A", NEW, 10, 10).result == "successful"
    # Blind is not silent: an alerts API that could not be read is an error, never a pass.
    assert analysis.measure_alarm(Probe(error="refused"), "A", NEW, 100, 10).result == "error"


def test_alerts_match_by_name_state_and_labels_in_both_apis():
    labels = {"namespace": "ns", "policy": "llm", "version": NEW}
    prom = [{"labels": {"alertname": "KVTierHitRateDrop", **labels}, "state": "firing", "activeAt": "t1", "value": "0"},
            {"labels": {"alertname": "KVTierHitRateDrop", **labels, "version": OLD}, "state": "firing"},
            {"labels": {"alertname": "KVTierHitRateDrop", **labels}, "state": "pending"}]
    assert analysis.matching_alerts(prom, "KVTierHitRateDrop", labels) == ("since t1, value 0",)
    assert analysis.matching_alerts(prom, "KVTierHitRateDrop", labels, states=("pending",)) == ("since ?",)
    am = [{"labels": {"alertname": "KVTierHitRateDrop", **labels}, "status": {"state": "active"}, "startsAt": "t2"}]
    assert analysis.matching_alerts(am, "KVTierHitRateDrop", labels) == ("since t2",)
    assert analysis.matching_alerts(am, "Other", labels) == ()


def test_measurement_is_due_once_per_interval():
    rec = prom_spec().recovery
    assert analysis.due(rec, None, T0)
    a = AnalysisStatus(measured_at=T0)
    assert not analysis.due(rec, a, T0 + timedelta(seconds=4)) and analysis.due(rec, a, T0 + timedelta(seconds=5))


def test_prometheus_source_starts_from_the_querys_baseline_of_the_old_version():
    o = Observed(Workload(4, OLD, 0), tuple(sample(f"llm-{i}", OLD, True, 100, 10) for i in range(4)), T0,
                 REPLICA_TOKENS_S, baseline_probe=Probe(value=0.61234))
    p = rollout.plan(prom_spec(), NEW, OLD, None, "Ready", o)
    assert p.kind == "start" and p.rollout.baseline_hit_rate == 0.6123


def test_prometheus_source_advances_after_count_successes_with_the_numbers():
    first = rollout.plan(prom_spec(), NEW, OLD, rolling(), "RollingOut", obs(5, Probe(value=0.45)))
    assert first.kind == "wait" and first.rollout.analysis.successes == 1 and first.rollout.current_hit_rate == 0.45
    second = rollout.plan(prom_spec(), NEW, OLD, first.rollout, "RollingOut", obs(10, Probe(value=0.5)))
    assert second.kind == "advance" and second.workload == WorkloadPatch(NEW, 2)
    assert second.rollout.analysis is None and second.rollout.step == 2
    assert "2/2 successful measurements" in second.event[2] and "hit rate 0.5000 >= 0.4000" in second.event[2]


def test_low_hit_rate_inside_the_window_is_pending_and_after_it_rolls_back():
    p = rollout.plan(prom_spec(), NEW, OLD, rolling(), "RollingOut", obs(5, Probe(value=0.1)))
    assert p.kind == "wait" and p.rollout.analysis.failures == 0 and p.rollout.analysis.last_result == "pending"
    p = rollout.plan(prom_spec(), NEW, OLD, p.rollout, "RollingOut", obs(25, Probe(value=0.1)))
    assert p.kind == "rollback" and p.workload == WorkloadPatch(OLD, 0) and p.phase == "RolledBack"
    assert "hit rate 0.1000 < 0.4000 after the recovery window" in p.event[2]
    assert p.conditions[1].reason == "AnalysisFailed"


def test_failure_limit_one_waits_on_the_first_failed_measurement_and_rolls_back_on_the_second():
    spec = prom_spec(failure_limit=1)
    first = rollout.plan(spec, NEW, OLD, rolling(), "RollingOut", obs(25, Probe(value=0.1)))
    assert first.kind == "wait" and first.workload is None and first.phase is None
    assert first.rollout.analysis.failures == 1 and first.rollout.analysis.last_result == "failed"
    assert first.rollout.step == 1 and not first.rollout.history
    second = rollout.plan(spec, NEW, OLD, first.rollout, "RollingOut", obs(30, Probe(value=0.1)))
    assert second.kind == "rollback" and second.workload == WorkloadPatch(OLD, 0) and second.phase == "RolledBack"
    assert "2 failed measurements (failureLimit 1)" in second.event[2]
    assert second.conditions[1].reason == "AnalysisFailed"


def test_failure_limit_counts_failures_not_in_a_row_and_a_success_between_does_not_reset_them():
    spec = prom_spec(failure_limit=1)  # count 2: the one success between does not pass the step
    status = rolling()
    kinds = []
    for t, value in ((25, 0.1), (30, 0.9), (35, 0.1)):
        p = rollout.plan(spec, NEW, OLD, status, "RollingOut", obs(t, Probe(value=value)))
        kinds.append(p.kind)
        status = p.rollout or status
    assert kinds == ["wait", "wait", "rollback"]


def test_failure_limit_one_with_a_firing_alarm_and_on_failure_pause_pauses_on_the_second_failure():
    base = alarm_spec(failure_limit=1)
    spec = Rollout(canary_pods=base.canary_pods, steps=base.steps, recovery=base.recovery, on_failure="pause")
    fire = Probe(firing=("since t1, value 0",))
    first = rollout.plan(spec, NEW, OLD, rolling(), "RollingOut", obs(2, fire))
    assert first.kind == "wait" and first.rollout.analysis.failures == 1 and first.workload is None
    second = rollout.plan(spec, NEW, OLD, first.rollout, "RollingOut", obs(7, fire))
    assert second.kind == "pause" and second.phase == "Paused" and second.workload is None
    assert second.rollout.paused_reason == "failure" and "failureLimit 1" in second.event[2]


def test_unreachable_prometheus_pauses_past_the_error_limit_and_never_rolls_back():
    spec = prom_spec(consecutive_error_limit=1)
    status, plans = rolling(), []
    for t in (25, 30):  # past the window: a failure would roll back, errors must not
        p = rollout.plan(spec, NEW, OLD, status, "RollingOut", obs(t, Probe(error="connection refused")))
        plans.append(p)
        status = p.rollout or status
    assert [p.kind for p in plans] == ["wait", "pause"]
    pause = plans[-1]
    assert pause.phase == "Paused" and pause.workload is None and pause.rollout.paused_reason == "inconclusive"
    assert pause.conditions[1].reason == "AnalysisInconclusive" and "2 errors in a row" in pause.event[2]
    # Still down: held where it is, counting; back with data: resumed with a fresh window.
    held = rollout.plan(spec, NEW, OLD, pause.rollout, "Paused", obs(35, Probe(error="connection refused")))
    assert held.kind == "hold" and held.rollout.analysis.consecutive_errors == 3 and held.phase is None
    resumed = rollout.plan(spec, NEW, OLD, held.rollout, "Paused", obs(40, Probe(value=0.2)))
    assert resumed.kind == "resume" and resumed.phase == "RollingOut" and resumed.rollout.paused_reason is None
    assert resumed.rollout.step_started_at == T0 + timedelta(seconds=40)
    assert resumed.rollout.analysis.consecutive_errors == 0 and resumed.event[1] == "RolloutResumed"


def test_no_data_past_the_inconclusive_limit_pauses():
    spec = prom_spec(inconclusive_limit=0)
    p = rollout.plan(spec, NEW, OLD, rolling(), "RollingOut", obs(5, Probe()))
    assert p.kind == "pause" and p.rollout.paused_reason == "inconclusive" and "no data" in p.event[2]


def test_a_manual_pause_is_not_resumed_by_data():
    p = rollout.plan(prom_spec(), NEW, OLD, rolling(paused="manual"), "Paused", obs(5, Probe(value=0.9)))
    assert p.kind == "hold" and p.rollout is None


def test_firing_alarm_rolls_back_at_once_with_the_alert_in_the_reason():
    p = rollout.plan(alarm_spec(), NEW, OLD, rolling(), "RollingOut", obs(2, Probe(firing=("since t1, value 0",))))
    assert p.kind == "rollback" and p.workload == WorkloadPatch(OLD, 0)
    assert "alert KVTierHitRateDrop firing" in p.event[2] and "since t1, value 0" in p.event[2]


def test_silent_alarm_advances_only_once_the_new_pods_served_enough_lookups():
    quiet = rollout.plan(alarm_spec(), NEW, OLD, rolling(), "RollingOut", obs(5, Probe(), lookups=3, hits=0))
    assert quiet.kind == "wait" and quiet.rollout.analysis.inconclusives == 1
    a = quiet.rollout
    for t in (10, 15):
        p = rollout.plan(alarm_spec(), NEW, OLD, a, "RollingOut", obs(t, Probe(), lookups=50, hits=0))
        a = p.rollout
    assert p.kind == "advance"


def test_no_probe_this_tick_changes_nothing():
    status = rolling(AnalysisStatus(successes=1, measured_at=T0))
    p = rollout.plan(prom_spec(), NEW, OLD, status, "RollingOut", obs(2, None))
    assert p.kind == "wait" and p.rollout is None and p.workload is None


def test_inconclusive_limit_one_waits_on_the_first_inconclusive_measurement_and_pauses_on_the_second():
    spec = prom_spec(inconclusive_limit=1)
    first = rollout.plan(spec, NEW, OLD, rolling(), "RollingOut", obs(5, Probe()))
    assert first.kind == "wait" and first.rollout.analysis.inconclusives == 1
    second = rollout.plan(spec, NEW, OLD, first.rollout, "RollingOut", obs(10, Probe()))
    assert second.kind == "pause" and second.rollout.paused_reason == "inconclusive"
    assert "2 inconclusive measurements (inconclusiveLimit 1)" in second.event[2]


def test_a_step_with_no_measurement_yet_says_so():
    verdict = analysis.judge(prom_spec().recovery, AnalysisStatus(), new_pods_ready=False)
    assert verdict == analysis.Verdict("continue", "0/2 successful, 0 failed, 0 inconclusive; last: none yet")


def test_an_alert_is_found_behind_alerts_that_do_not_match():
    labels = {"namespace": "ns", "policy": "llm", "version": NEW}
    alerts = [{"labels": {"alertname": "Other", **labels}, "state": "firing"},
              {"labels": {"alertname": "KVTierHitRateDrop", **labels, "version": OLD}, "state": "firing"},
              {"labels": {"alertname": "KVTierHitRateDrop", **labels}, "state": "pending"},
              {"labels": {"alertname": "KVTierHitRateDrop", **labels}, "state": "firing", "activeAt": "t3"}]
    assert analysis.matching_alerts(alerts, "KVTierHitRateDrop", labels) == ("since t3",)


def test_probes_and_measurements_are_values():
    for value, name in ((Probe(value=0.5), "value"), (analysis.Measurement("successful", 0.5, "ok"), "message"),
                        (analysis.Verdict("pass", "ok"), "reason")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, name, None)


def test_a_hit_rate_at_the_bar_passes_and_values_keep_four_decimals():
    assert analysis.measure_hit_rate(Probe(value=0.4), 0.4, True).result == "successful"
    m = analysis.measure_hit_rate(Probe(value=0.123456), 0.1, False)
    assert m.value == pytest.approx(0.1235, abs=1e-9) and "hit rate 0.1235 >= 0.1000" == m.message


def test_long_alert_lists_and_messages_are_cut_to_the_status_bound():
    many = tuple(f"since t{i}, value 0" for i in range(200))
    assert len(analysis.measure_alarm(Probe(firing=many), "A", NEW, 100, 10).message) == 1024
    assert len(analysis.measure_alarm(Probe(pending=many), "A", NEW, 100, 10).message) == 1024
    long = analysis.Measurement("error", None, "x" * 2000)
    assert len(analysis.tally(None, long, T0).message) == 1024


# --- a person's controls (kvtier.io/rollout-request) -------------------------------------


def requested(request: str, status: RolloutStatus, phase: str, seconds: float = 5) -> rollout.Plan:
    o = obs(seconds, None)
    o = Observed(o.workload, o.pods, o.now, REPLICA_TOKENS_S, request=request)
    return rollout.plan(prom_spec(), NEW, OLD, status, phase, o)


def test_promote_skips_the_wait_once_and_is_remembered():
    p = requested("promote/1", rolling(), "RollingOut")
    assert p.kind == "advance" and p.rollout.step == 2 and p.workload == WorkloadPatch(NEW, 2)
    assert p.rollout.handled_request == "promote/1" and p.rollout.history[-1].outcome == "promoted"
    again = requested("promote/1", p.rollout, "RollingOut")
    assert again.kind != "advance"  # the same request is not acted on twice


def test_abort_rolls_back_now_and_retry_starts_over():
    p = requested("abort/1", rolling(), "RollingOut")
    assert p.kind == "rollback" and p.phase == "RolledBack" and p.workload == WorkloadPatch(OLD, 0)
    assert p.rollout.history[-1].outcome == "aborted" and p.conditions[1].reason == "Aborted"
    o = Observed(Workload(4, OLD, 0), tuple(sample(f"llm-{i}", OLD, True, 100, 80) for i in range(4)), T0,
                 REPLICA_TOKENS_S, request="retry/2")
    r = rollout.plan(prom_spec(), NEW, OLD, p.rollout, "RolledBack", o)
    assert r.kind == "start" and r.phase == "RollingOut" and r.workload == WorkloadPatch(NEW, 3)
    assert "retried by request" in r.event[2] and r.rollout.handled_request == "retry/2"
    assert [h.outcome for h in r.rollout.history] == ["aborted"]


def test_pause_holds_and_resume_restarts_the_window():
    p = requested("pause/1", rolling(), "RollingOut")
    assert p.kind == "pause" and p.rollout.paused_reason == "manual" and p.workload is None
    r = requested("resume/2", p.rollout, "Paused", seconds=30)
    assert r.kind == "resume" and r.phase == "RollingOut" and r.rollout.step_started_at == T0 + timedelta(seconds=30)


def test_requests_that_do_not_apply_are_rejected_with_a_reason_and_change_nothing():
    p = requested("retry/1", rolling(), "RollingOut")
    assert p.kind == "refuse" and p.workload is None and p.phase is None
    assert "only a rolled-back rollout" in p.event[2] and p.rollout.handled_request == "retry/1"
    assert requested("jump/1", rolling(), "RollingOut").event[1] == "RolloutRequestRejected"
    assert "not paused" in requested("resume/1", rolling(), "RollingOut").event[2]
