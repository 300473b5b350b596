"""The rollout planner's edges (pure): the arithmetic at its rounding points, what a
plan keeps from status, the bounds on what it writes, and which source's figures it
shows. Each test pins a behaviour a mutation run found no other test holding."""
from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest

from kvtier.policy import Rollout, RolloutStatus
from kvtier_operator import rollout
from kvtier_operator.analysis import Probe
from kvtier_operator.rollout import Observed, PodSample, Workload, WorkloadPatch
from test_rollout_analysis import URL, alarm_spec, obs, prom_spec
from test_rollout_planner import NEW, OLD, REPLICA_TOKENS_S, T0, observed, rolling, spec

NEWER = "sha256:" + "3" * 64


def test_a_step_rounds_its_share_of_the_fleet_up_to_whole_pods():
    # 1% of 101 pods is 1.01 pods: the step needs 2, never 1.
    assert rollout.schedule(Rollout(canary_pods=0, steps=[1, 100]), 101) == [2, 101]
    assert rollout.schedule(Rollout(canary_pods=0, steps=[1, 100]), 100) == [1, 100]


def test_pods_that_answered_with_no_tokens_loaded_add_nothing_to_the_hit_figure():
    answered = [PodSample("llm-0", NEW, True, lookups=10, loaded_tokens=0, prompt_tokens=640),
                PodSample("llm-1", NEW, True, lookups=5, loaded_tokens=None, prompt_tokens=None),
                PodSample("llm-2", NEW, True, lookups=None, loaded_tokens=9, prompt_tokens=9),
                PodSample("llm-3", NEW, True, lookups=0, loaded_tokens=0, prompt_tokens=0)]
    t = rollout.hit_rate(answered)
    assert (t.lookups, t.loaded_tokens, t.prompt_tokens) == (15, 0, 640)
    assert t.rate == 0


def test_cold_prefill_estimate_without_a_baseline_is_zero_and_keeps_a_decimal():
    assert rollout.cold_prefill_tokens_per_s(2, None, 1000.0) == 0
    # 1 pod x 0.12346 x 1000 = 123.46 tokens/s, kept to one decimal (not 123, not 123.46).
    assert rollout.cold_prefill_tokens_per_s(1, 0.12346, 1000.0) == pytest.approx(123.5, abs=0.02)


def test_samples_and_patches_are_values():
    # Frozen: hashable and unchangeable, so a plan cannot be edited after it is made.
    a = PodSample("llm-0", NEW, True, 1, 2, 3)
    assert len({a, PodSample("llm-0", NEW, True, 1, 2, 3)}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.ready = False  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        WorkloadPatch(NEW, 0).partition = 3  # type: ignore[misc]
    for cls in (rollout.Workload, rollout.Observed, rollout.Plan, rollout.Tally, rollout.StepRecovery):
        assert cls.__dataclass_params__.frozen, cls  # type: ignore[attr-defined]


def test_a_fleet_already_on_the_target_moves_the_serving_version_even_when_nothing_else_changes():
    # partition 0 and phase Ready: the only thing left to write is status.version.
    p = rollout.plan(spec(), NEW, OLD, None, "Ready", observed(NEW, 0, [NEW] * 4))
    assert (p.kind, p.version, p.workload, p.phase) == ("idle", NEW, None, None)


def test_history_messages_are_cut_to_the_bound_the_crd_allows():
    long_reason = "x" * 3000
    ctx = rollout._Ctx(spec(), NEW, OLD, rolling(), "RollingOut", observed(NEW, 3, [OLD] * 3 + [NEW]),
                       rollout.schedule(spec(), 4))
    record = rollout._record(ctx, 1, "rolledBack", None, long_reason)
    assert len(record.message) == 1024


def test_a_handled_request_is_remembered_at_most_128_characters_long():
    long_request = "pause/" + "r" * 300
    obs_ = observed(NEW, 3, [OLD] * 3 + [NEW], now=T0 + timedelta(seconds=1), lookups=1, hits=0)
    p = rollout.plan(spec(), NEW, OLD, rolling(), "RollingOut", dataclasses.replace(obs_, request=long_request))
    assert p.kind == "pause"
    assert p.rollout.handled_request == long_request[:128]


def test_a_rejected_request_mid_rollout_keeps_the_rollout_status_it_found():
    obs_ = observed(NEW, 3, [OLD] * 3 + [NEW], now=T0 + timedelta(seconds=1), lookups=1, hits=0)
    status = rolling(step=1, baseline=0.5).model_copy(update={"current_hit_rate": 0.25})
    p = rollout.plan(spec(), NEW, OLD, status, "RollingOut", dataclasses.replace(obs_, request="resume/1"))
    assert p.kind == "refuse"
    assert p.rollout.handled_request == "resume/1"
    # Everything else is as it was: the request did not reset the rollout.
    assert p.rollout.model_copy(update={"handled_request": None}) == status


def test_a_rollback_to_the_serving_version_records_the_version_it_leaves():
    # Mid-rollout to NEW, spec set back to OLD: the history names NEW (rolled back), not OLD.
    obs_ = observed(NEW, 3, [OLD] * 3 + [NEW], now=T0 + timedelta(seconds=1))
    p = rollout.plan(spec(), OLD, OLD, rolling(), "RollingOut", obs_)
    assert p.kind == "rollback" and p.phase == "Ready"
    assert p.rollout.history[-1].version == NEW
    assert p.rollout.canary_percent == 0 and p.rollout.expected_cold_prefill_tokens_per_s == 0


def test_a_prometheus_step_without_a_baseline_is_judged_against_a_bar_of_zero():
    status = RolloutStatus(target_version=NEW, step=1, baseline_hit_rate=None, step_started_at=T0)
    p = rollout.plan(prom_spec(), NEW, OLD, status, "RollingOut", obs(6, Probe(value=0.0)))
    assert "hit rate 0.0000 >= 0.0000" in p.conditions[0].message


def test_a_prometheus_step_names_the_server_it_asked():
    p = rollout.plan(prom_spec(), NEW, OLD, rolling(), "RollingOut", obs(6, Probe(value=0.9)))
    assert f"ready; prometheus {URL}: " in p.conditions[0].message
    p = rollout.plan(alarm_spec(), NEW, OLD, rolling(), "RollingOut", obs(6, Probe()))
    assert f"ready; alarm KVTierHitRateDrop (prometheus {URL}): " in p.conditions[0].message


def test_an_alarm_step_shows_the_sidecars_hit_rate_not_the_last_one_written():
    # The alarm source's measurements carry no value: the figure shown is the new
    # pods' own counters (40 of 50 lookups' tokens loaded), not status' stale 0.1.
    status = rolling().model_copy(update={"current_hit_rate": 0.1})
    p = rollout.plan(alarm_spec(), NEW, OLD, status, "RollingOut", obs(6, Probe()))
    assert p.rollout.current_hit_rate == pytest.approx(0.8)


def test_an_inconclusive_pause_without_a_step_clock_holds_instead_of_failing():
    status = RolloutStatus(target_version=NEW, step=1, baseline_hit_rate=0.5, step_started_at=None,
                           paused_reason="inconclusive")
    p = rollout.plan(prom_spec(), NEW, OLD, status, "Paused", obs(6, Probe(value=0.9)))
    assert p.kind == "hold"


def test_a_rollout_names_the_version_it_leaves():
    # Not superseding: the old version is what the template runs (status.version may lag).
    p = rollout.plan(spec(), NEW, None, None, "Ready", observed(OLD, 0, [OLD] * 4))
    assert p.kind == "start" and p.version == OLD and f"rolling out {NEW} from {OLD}:" in p.event[2]
    assert "retried" not in p.event[2] and "superseding" not in p.event[2]
    assert "step 1/3: 1/4 pods (25%) on the new version" in p.event[2]
    # Superseding mid-rollout: the template already runs NEW; the old version is the serving one.
    p = rollout.plan(spec(), NEWER, OLD, rolling(), "RollingOut", observed(NEW, 3, [OLD] * 3 + [NEW]))
    assert p.kind == "start" and p.version == OLD
    assert f"rolling out {NEWER} from {OLD}: superseding {NEW}" in p.event[2]


def test_the_first_step_is_judged_on_its_own_pods_not_on_a_stray_new_one():
    # llm-0 runs NEW too (left from an earlier attempt) with a warm cache; step 1
    # restarted llm-3 only, and llm-3 has not served a lookup yet: wait.
    samples = (PodSample("llm-0", NEW, True, 1000, 900 * 64, 1000 * 64), PodSample("llm-1", OLD, True, 0, 0, 0),
               PodSample("llm-2", OLD, True, 0, 0, 0), PodSample("llm-3", NEW, True, 0, 0, 0))
    o = Observed(Workload(4, NEW, 3), samples, T0 + timedelta(seconds=3), REPLICA_TOKENS_S)
    assert rollout.plan(spec(), NEW, OLD, rolling(), "RollingOut", o).kind == "wait"


def test_a_sidecar_step_without_a_baseline_needs_a_hit_rate_of_zero():
    o = observed(NEW, 3, [OLD] * 3 + [NEW], now=T0 + timedelta(seconds=3), lookups=5, hits=0)
    p = rollout.plan(spec(), NEW, OLD, rolling(baseline=None), "RollingOut", o)
    assert p.kind == "wait" and "needs 0.0000 over 100" in p.conditions[0].message


def test_a_request_is_named_in_the_condition_that_answers_it_and_nowhere_else():
    obs_ = observed(NEW, 3, [OLD] * 3 + [NEW], now=T0 + timedelta(seconds=1), lookups=1, hits=0)
    accepted = rollout.plan(spec(), NEW, OLD, rolling(), "RollingOut", dataclasses.replace(obs_, request="pause/7"))
    by_type = {c.type: c for c in accepted.conditions}
    assert (by_type[rollout.REQUEST].status, by_type[rollout.REQUEST].reason) == ("True", "Accepted")
    assert by_type[rollout.REQUEST].message == "rollout request pause/7: pause"
    assert not any("[pause/7]" in c.message for c in accepted.conditions)
    assert by_type[rollout.PROGRESSING].reason == "Paused"
    rejected = rollout.plan(spec(), NEW, OLD, rolling(), "RollingOut", dataclasses.replace(obs_, request="resume/8"))
    [cond] = rejected.conditions
    assert (cond.type, cond.status, cond.reason) == (rollout.REQUEST, "False", "Rejected")
    assert cond.message.endswith("[resume/8]")


def test_a_recorded_step_zero_reads_as_the_first_step():
    o = observed(NEW, 3, [OLD] * 3 + [NEW], now=T0 + timedelta(seconds=12), lookups=100, hits=40)
    p = rollout.plan(spec(), NEW, OLD, rolling(step=0), "RollingOut", o)
    assert p.kind == "advance" and p.rollout.step == 2 and p.workload == WorkloadPatch(NEW, 2)


def test_observations_without_a_prefill_capacity_expect_no_cold_prefill():
    o = Observed(Workload(4, OLD, 0), tuple(observed(OLD, 0, [OLD] * 4, lookups=10, hits=5).pods), T0)
    p = rollout.plan(spec(), NEW, OLD, None, "Ready", o)
    assert p.kind == "start" and p.rollout.expected_cold_prefill_tokens_per_s == 0


def test_a_completed_rollout_expects_no_more_cold_prefill():
    o = observed(NEW, 0, [NEW] * 4, now=T0 + timedelta(seconds=3), lookups=100, hits=50)
    p = rollout.plan(spec(), NEW, OLD, rolling(step=3), "RollingOut", o)
    assert p.kind == "complete" and p.rollout.expected_cold_prefill_tokens_per_s == 0


def test_an_alarm_step_counts_only_the_new_pods_lookups():
    # The old pods served plenty; the canary 5 < minLookups 10: silence means nothing yet.
    pods_ = tuple(PodSample(f"llm-{i}", v, True, n, n * 32, n * 64)
                  for i, (v, n) in enumerate([(OLD, 500)] * 3 + [(NEW, 5)]))
    o = Observed(Workload(4, NEW, 3), pods_, T0 + timedelta(seconds=6), REPLICA_TOKENS_S, probe=Probe())
    p = rollout.plan(alarm_spec(), NEW, OLD, rolling(), "RollingOut", o)
    assert p.kind == "wait" and p.rollout.analysis.last_result == "inconclusive" and p.rollout.analysis.successes == 0


def test_leaving_a_rolled_back_phase_once_the_fleet_serves_the_spec_again():
    p = rollout.plan(spec(), OLD, OLD, None, "RolledBack", observed(OLD, 0, [OLD] * 4))
    assert (p.kind, p.phase, p.version, p.workload) == ("idle", "Ready", None, None)


def test_lookups_without_prompt_tokens_never_count_as_recovery():
    # No baseline: the bar is 0; 100 lookups that carried no prompt tokens are no evidence.
    samples = (PodSample("llm-0", OLD, True, 0, 0, 0), PodSample("llm-1", OLD, True, 0, 0, 0),
               PodSample("llm-2", OLD, True, 0, 0, 0), PodSample("llm-3", NEW, True, 100, 0, 0))
    o = Observed(Workload(4, NEW, 3), samples, T0 + timedelta(seconds=3), REPLICA_TOKENS_S)
    assert rollout.plan(spec(), NEW, OLD, rolling(baseline=None), "RollingOut", o).kind == "wait"


def test_a_rollout_of_a_fleet_scaled_to_zero_starts_at_zero_percent():
    p = rollout.plan(spec(), NEW, OLD, None, "Ready", Observed(Workload(0, OLD, 0), (), T0, REPLICA_TOKENS_S))
    assert p.kind == "start" and p.rollout.canary_percent == 0


def test_a_one_pod_fleet_is_judged_at_its_step_not_caught_up():
    # Schedule [1, 1, 1, 1]: the one pod on the target is exactly what step 1 put there.
    o = Observed(Workload(1, NEW, 0), (PodSample("llm-0", NEW, True, 5, 0, 320),), T0 + timedelta(seconds=3),
                 REPLICA_TOKENS_S)
    p = rollout.plan(Rollout(recovery=spec().recovery), NEW, OLD, rolling(), "RollingOut", o)
    assert p.kind == "wait"


def test_a_measurement_at_the_end_of_the_window_counts_the_window_as_over():
    # window 20s: at exactly 20 s a value under the bar is a failure, not "pending".
    p = rollout.plan(prom_spec(), NEW, OLD, rolling(), "RollingOut", obs(20, Probe(value=0.1)))
    assert p.kind == "rollback"


def test_recovery_needs_prompt_tokens_but_one_is_enough():
    tally = rollout.Tally(lookups=100, loaded_tokens=1, prompt_tokens=1)
    assert rollout.StepRecovery(tally, 0.5).recovered(100)
    assert not rollout.StepRecovery(rollout.Tally(100, 0, 0), 0.0).recovered(100)


def test_an_inconclusive_pause_puts_the_workload_back_where_its_step_wants_it():
    status = rolling().model_copy(update={"paused_reason": "inconclusive"})
    off = Observed(Workload(4, NEW, 4), obs(6, None).pods, T0 + timedelta(seconds=6), REPLICA_TOKENS_S,
                   probe=Probe())
    p = rollout.plan(prom_spec(), NEW, OLD, status, "Paused", off)
    assert p.kind == "hold" and p.workload == WorkloadPatch(NEW, 3)
    on = dataclasses.replace(off, workload=Workload(4, NEW, 3))
    p = rollout.plan(prom_spec(), NEW, OLD, status, "Paused", on)
    assert p.kind == "hold" and p.workload is None


def test_an_empty_fleet_has_an_empty_schedule_of_counts():
    assert rollout.schedule(Rollout(canary_pods=0, steps=[50, 100]), 0) == [0, 0]


def test_a_one_pod_fleets_first_step_is_the_whole_fleet_in_percent():
    p = rollout.plan(Rollout(recovery=spec().recovery), NEW, OLD, None, "Ready",
                     Observed(Workload(1, OLD, 0), (PodSample("llm-0", OLD, True, 5, 0, 320),), T0))
    assert p.kind == "start" and p.rollout.canary_percent == 100


def test_a_fleet_back_whole_on_the_target_before_the_last_step_catches_up():
    # Schedule [1, 1, 2, 4], step 3 (2 pods): all 4 pods came back on NEW.
    o = observed(NEW, 2, [NEW] * 4, now=T0 + timedelta(seconds=3), lookups=1, hits=0)
    assert rollout.plan(Rollout(recovery=spec().recovery), NEW, OLD, rolling(step=3), "RollingOut", o).kind == "catchUp"


def test_an_analysis_step_counts_only_new_pods_as_ready_and_puts_the_workload_back():
    pods_ = tuple(PodSample(f"llm-{i}", v, v == OLD, 50, 40 * 64, 50 * 64)
                  for i, v in enumerate([OLD] * 3 + [NEW]))
    o = Observed(Workload(4, NEW, 3), pods_, T0 + timedelta(seconds=6), REPLICA_TOKENS_S, probe=Probe(value=0.9))
    from kvtier.policy import AnalysisStatus

    one_passed = rolling().model_copy(update={"analysis": AnalysisStatus(successes=1)})
    p = rollout.plan(prom_spec(), NEW, OLD, one_passed, "RollingOut", o)
    assert p.kind == "wait"  # the second success, but the canary is not ready: no pass
    ready = dataclasses.replace(o, pods=pods_[:3] + (dataclasses.replace(pods_[3], ready=True),))
    assert rollout.plan(prom_spec(), NEW, OLD, one_passed, "RollingOut", ready).kind == "advance"
    # Nothing to measure and nothing changed, but the workload is off its step: patch it back.
    status = rolling().model_copy(update={"current_hit_rate": 0.8})
    off = Observed(Workload(4, NEW, 4), obs(1, None).pods, T0 + timedelta(seconds=1), REPLICA_TOKENS_S)
    p = rollout.plan(prom_spec(), NEW, OLD, status, "RollingOut", off)
    assert p.kind == "wait" and p.workload == WorkloadPatch(NEW, 3)


def test_a_sidecar_pause_keeps_the_analysis_it_found():
    from kvtier.policy import AnalysisStatus

    a = AnalysisStatus(successes=1)
    status = rolling().model_copy(update={"analysis": a})
    o = observed(NEW, 3, [OLD] * 3 + [NEW], now=T0 + timedelta(seconds=25), lookups=150, hits=0)
    p = rollout.plan(spec(on_failure="pause"), NEW, OLD, status, "RollingOut", o)
    assert p.kind == "pause" and p.rollout.analysis == a
