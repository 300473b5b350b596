"""The rollout planner (pure): exact steps, baselines, recovery bar, rollback and pause,
and invariants under hypothesis: it never advances without recovery, and a failed
rollout with onFailure rollback leaves no pod on the new version."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policy import Recovery as RecoverySpec
from kvtier.policy import Rollout, RolloutStatus
from kvtier_operator import rollout
from kvtier_operator.rollout import Observed, PodSample, Workload, WorkloadPatch

OLD = "sha256:" + "1" * 64
NEW = "sha256:" + "2" * 64
T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)
REPLICA_TOKENS_S = 1000.0


def spec(**kw) -> Rollout:
    recovery = RecoverySpec(threshold=0.8, window="20s", min_lookups=100)
    return Rollout(canary_pods=1, steps=[50, 100], recovery=recovery).model_copy(update=kw)


PROMPT_TOKENS = 64  # each lookup's prompt tokens (the hit figure's denominator)


def sample(name: str, version: str, ready: bool, lookups: int, hits: int) -> PodSample:
    """A pod whose engine looked up `lookups` prompts of PROMPT_TOKENS and loaded the
    equivalent of `hits` whole prompts from kvtier: its hit rate (loaded over prompt
    tokens) is hits / lookups."""
    return PodSample(name, version, ready, lookups, hits * PROMPT_TOKENS, lookups * PROMPT_TOKENS)


def pods(versions: list[str], lookups: int = 0, hits: int = 0, ready: bool = True) -> tuple[PodSample, ...]:
    return tuple(sample(f"llm-{i}", v, ready, lookups, hits) for i, v in enumerate(versions))


def observed(template: str, partition: int, versions: list[str], now: datetime = T0, replicas: int = 4,
             lookups: int = 0, hits: int = 0) -> Observed:
    return Observed(Workload(replicas, template, partition), pods(versions, lookups, hits), now, REPLICA_TOKENS_S)


def rolling(step: int = 1, baseline: float | None = 0.5, started: datetime = T0) -> RolloutStatus:
    return RolloutStatus(target_version=NEW, step=step, baseline_hit_rate=baseline, step_started_at=started)


def test_schedule_is_canary_then_rounded_up_percentages_ending_at_the_fleet():
    assert rollout.schedule(Rollout(), 4) == [1, 1, 2, 4]  # default: 1 canary, 10%, 50%, 100%
    assert rollout.schedule(Rollout(), 44) == [1, 5, 22, 44]
    assert rollout.schedule(Rollout(canary_pods=0, steps=[25, 100]), 10) == [3, 10]
    assert rollout.schedule(Rollout(canary_pods=5), 3) == [3, 3, 3, 3]


def test_start_records_the_old_pods_baseline_and_moves_the_highest_ordinal_pod():
    p = rollout.plan(spec(), NEW, OLD, None, "Ready", observed(OLD, 0, [OLD] * 4, lookups=200, hits=150))
    assert p.kind == "start"
    assert p.workload == WorkloadPatch(NEW, 3)
    assert p.phase == "RollingOut" and p.version == OLD
    assert p.rollout.target_version == NEW and p.rollout.step == 1 and p.rollout.canary_percent == 25
    assert p.rollout.baseline_hit_rate == 0.75 and p.rollout.step_started_at == T0
    # 1 cold pod x 0.75 of its prefill tokens were hits x 1000 tokens/s per replica.
    assert p.rollout.expected_cold_prefill_tokens_per_s == 750.0
    assert p.event[1] == "RolloutStarted" and "baseline hit rate 0.7500 over 800 lookups" in p.event[2]
    assert "expected cold-cache prefill up to 750 tokens/s" in p.event[2]


def test_steady_fleet_on_the_target_is_idle():
    assert rollout.plan(spec(), OLD, OLD, None, "Ready", observed(OLD, 0, [OLD] * 4)).kind == "idle"
    assert rollout.plan(spec(), OLD, OLD, None, "Ready", observed(OLD, 0, [OLD] * 4)).workload is None


def test_waits_while_new_pods_are_below_the_bar():
    # baseline 0.5 x threshold 0.8 = 0.4 needed; 0.3 observed over 150 lookups.
    obs = observed(NEW, 3, [OLD] * 3 + [NEW], now=T0 + timedelta(seconds=10), lookups=150, hits=45)
    p = rollout.plan(spec(), NEW, OLD, rolling(), "RollingOut", obs)
    assert p.kind == "wait" and p.workload is None
    assert p.rollout.current_hit_rate == 0.3 and p.rollout.step == 1


def test_not_enough_lookups_is_not_recovery_even_at_a_perfect_hit_rate():
    obs = observed(NEW, 3, [OLD] * 3 + [NEW], now=T0 + timedelta(seconds=5), lookups=99, hits=99)
    assert rollout.plan(spec(), NEW, OLD, rolling(), "RollingOut", obs).kind == "wait"


def test_recovered_step_advances_to_the_next_partition_and_records_history():
    obs = observed(NEW, 3, [OLD] * 3 + [NEW], now=T0 + timedelta(seconds=12), lookups=100, hits=40)
    p = rollout.plan(spec(), NEW, OLD, rolling(), "RollingOut", obs)
    assert p.kind == "advance"
    assert p.workload == WorkloadPatch(NEW, 2)
    assert p.rollout.step == 2 and p.rollout.canary_percent == 50
    assert p.rollout.step_started_at == T0 + timedelta(seconds=12)
    # one more pod restarts cold: 1 x 0.5 x 1000.
    assert p.rollout.expected_cold_prefill_tokens_per_s == 500.0
    [record] = p.rollout.history
    assert (record.step, record.outcome, record.hit_rate, record.version) == (1, "recovered", 0.4, NEW)


def test_a_step_is_judged_on_the_pods_it_restarted_not_on_earlier_recovered_ones():
    # Step 2 restarted llm-2; llm-3 (the canary) recovered long ago.
    samples = (sample("llm-0", OLD, True, 0, 0), sample("llm-1", OLD, True, 0, 0),
               sample("llm-2", NEW, True, 0, 0), sample("llm-3", NEW, True, 1000, 900))
    obs = Observed(Workload(4, NEW, 2), samples, T0 + timedelta(seconds=3), REPLICA_TOKENS_S)
    p = rollout.plan(spec(), NEW, OLD, rolling(step=2), "RollingOut", obs)
    assert p.kind == "wait" and p.rollout is None  # llm-2: no lookups yet, so no hit rate
    assert rollout.ordinal("llm-12") == 12 and rollout.ordinal("engine") == -1


def test_a_step_waits_for_its_pods_to_be_ready_on_the_new_version():
    obs = observed(NEW, 2, [OLD] * 3 + [NEW], now=T0 + timedelta(seconds=3), lookups=500, hits=500)
    assert rollout.plan(spec(), NEW, OLD, rolling(step=2), "RollingOut", obs).kind == "wait"


def test_last_step_recovered_completes_and_moves_the_serving_version():
    obs = observed(NEW, 0, [NEW] * 4, now=T0 + timedelta(seconds=3), lookups=100, hits=50)
    p = rollout.plan(spec(), NEW, OLD, rolling(step=3), "RollingOut", obs)
    assert p.kind == "complete" and p.version == NEW and p.phase == "Ready"
    assert p.workload == WorkloadPatch(NEW, 0)
    assert p.rollout.history[-1].outcome == "completed" and p.rollout.canary_percent == 100


def test_window_over_without_recovery_rolls_every_pod_back_and_says_why():
    obs = observed(NEW, 2, [OLD] * 2 + [NEW] * 2, now=T0 + timedelta(seconds=20), lookups=300, hits=30)
    p = rollout.plan(spec(), NEW, OLD, rolling(step=2), "RollingOut", obs)
    assert p.kind == "rollback" and p.phase == "RolledBack"
    assert p.workload == WorkloadPatch(OLD, 0)
    assert p.event[0] == "Warning" and p.event[1] == "RolledBack"
    assert ("step 2: 2/2 new pods ready; hit rate 0.1000 over 300 lookups did not reach 0.8 x baseline 0.5000 = 0.4000 "
            "(min 100 lookups) within 20s") in p.event[2]
    assert p.rollout.history[-1].outcome == "rolledBack" and p.rollout.history[-1].step == 2
    assert {c.type: c.status for c in p.conditions} == {"RolloutProgressing": "False", "RolledBack": "True"}


def test_on_failure_pause_holds_the_fleet_where_it_is():
    obs = observed(NEW, 3, [OLD] * 3 + [NEW], now=T0 + timedelta(seconds=25))
    p = rollout.plan(spec(on_failure="pause"), NEW, OLD, rolling(), "RollingOut", obs)
    assert p.kind == "pause" and p.phase == "Paused" and p.workload is None
    held = rollout.plan(spec(on_failure="pause"), NEW, OLD, p.rollout, "Paused", obs)
    assert held.kind == "hold" and held.workload is None


def test_rolled_back_target_is_not_retried_and_the_rollback_is_kept_applied():
    done = rolling(step=2)
    obs = observed(NEW, 2, [OLD] * 4)  # someone re-applied the new template: undo it
    p = rollout.plan(spec(), NEW, OLD, done, "RolledBack", obs)
    assert p.kind == "hold" and p.workload == WorkloadPatch(OLD, 0)
    assert rollout.plan(spec(), NEW, OLD, done, "RolledBack", observed(OLD, 0, [OLD] * 4)).workload is None


def test_setting_the_version_back_mid_rollout_rolls_back_as_requested():
    obs = observed(NEW, 3, [OLD] * 3 + [NEW], now=T0 + timedelta(seconds=1))
    p = rollout.plan(spec(), OLD, OLD, rolling(), "RollingOut", obs)
    assert p.kind == "rollback" and p.phase == "Ready" and p.workload == WorkloadPatch(OLD, 0)


def test_restart_mid_step_reapplies_the_same_partition_never_another():
    # Status says step 2 but the operator died before patching the workload.
    obs = observed(NEW, 3, [OLD] * 3 + [NEW], now=T0 + timedelta(seconds=1))
    p = rollout.plan(spec(), NEW, OLD, rolling(step=2), "RollingOut", obs)
    assert p.kind == "wait" and p.workload == WorkloadPatch(NEW, 2) and p.rollout is None


def test_interrupted_completion_only_resets_the_partition():
    p = rollout.plan(spec(), NEW, NEW, rolling(step=3), "Ready", observed(NEW, 1, [NEW] * 4))
    assert p.kind == "idle" and p.workload == WorkloadPatch(NEW, 0) and p.version is None


def test_unversioned_template_is_refused_with_a_condition():
    p = rollout.plan(spec(), NEW, OLD, None, "Ready", observed(None, 0, [None] * 4))  # type: ignore[arg-type]
    assert p.kind == "refuse" and p.conditions[0].reason == "WorkloadUnversioned" and p.workload is None


def test_a_fleet_back_from_zero_all_on_the_target_moves_the_rollout_to_its_last_step_with_a_fresh_window():
    later = T0 + timedelta(seconds=15)
    back = observed(NEW, 3, [NEW] * 4, now=later, lookups=10, hits=0)  # the controller promoted its revision
    p = rollout.plan(spec(), NEW, OLD, rolling(step=1), "RollingOut", back)
    assert p.kind == "catchUp" and p.workload == WorkloadPatch(NEW, 0)  # the partition the last step has
    assert p.rollout.step == 3 and p.rollout.step_started_at == later and p.rollout.canary_percent == 100
    assert p.rollout.history[-1].outcome == "caughtUp" and p.rollout.history[-1].step == 1
    assert p.phase is None and p.version is None  # still rolling out: nothing is promoted without recovery
    assert [(c.type, c.reason) for c in p.conditions] == [("RolloutProgressing", "FleetCaughtUp")]
    assert p.event[:2] == ("Warning", "RolloutCaughtUp")


def test_after_catching_up_the_hit_rate_alarm_still_rolls_every_pod_back():
    caught = rollout.plan(spec(), NEW, OLD, rolling(step=1), "RollingOut",
                          observed(NEW, 3, [NEW] * 4, lookups=10, hits=0)).rollout
    cold = observed(NEW, 0, [NEW] * 4, now=T0 + timedelta(seconds=300), lookups=500, hits=0)  # past the window
    p = rollout.plan(spec(), NEW, OLD, caught, "RollingOut", cold)
    assert p.kind == "rollback" and p.workload == WorkloadPatch(OLD, 0) and p.phase == "RolledBack"


def test_after_catching_up_recovery_completes_the_rollout():
    caught = rollout.plan(spec(), NEW, OLD, rolling(step=1), "RollingOut",
                          observed(NEW, 3, [NEW] * 4, lookups=10, hits=0)).rollout
    warm = observed(NEW, 0, [NEW] * 4, now=T0 + timedelta(seconds=10), lookups=500, hits=450)
    p = rollout.plan(spec(), NEW, OLD, caught, "RollingOut", warm)
    assert p.kind == "complete" and p.version == NEW


def test_pods_on_the_target_only_as_far_as_the_step_put_them_are_no_catch_up():
    p = rollout.plan(spec(), NEW, OLD, rolling(step=1), "RollingOut",
                     observed(NEW, 3, [OLD] * 3 + [NEW], lookups=10, hits=0))
    assert p.kind == "wait"


# --- invariants -------------------------------------------------------------------------


def converge(workload: Workload, patch: WorkloadPatch | None, versions: list[str]) -> tuple[Workload, list[str]]:
    """What the StatefulSet controller does with a patch: pods with ordinal >= partition
    take the template's version, the others keep theirs."""
    if patch is not None:
        workload = Workload(workload.replicas, patch.template_version, patch.partition)
    out = [workload.template_version if i >= workload.partition else v for i, v in enumerate(versions)]
    return workload, out


ticks = st.lists(st.tuples(st.integers(0, 400), st.floats(0, 1), st.integers(1, 15)), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(replicas=st.integers(1, 12), canary=st.integers(0, 3), ticks=ticks, pause=st.booleans(),
       baseline_hits=st.integers(0, 100))
def test_never_advances_without_recovery_and_never_leaves_a_failed_fleet_half_rolled(
        replicas, canary, ticks, pause, baseline_hits):
    rspec = spec(canary_pods=canary, steps=[30, 100], on_failure="pause" if pause else "rollback")
    workload, versions = Workload(replicas, OLD, 0), [OLD] * replicas
    status, phase, serving, now = None, "Ready", OLD, T0
    for i, (lookups, rate, dt_s) in enumerate(ticks):
        now += timedelta(seconds=dt_s)
        sampled = tuple(sample(f"llm-{j}", v, True, lookups if v == NEW or i == 0 else 0,
                                 int((rate if v == NEW else baseline_hits / 100) * (lookups if v == NEW or i == 0 else 0)))
                        for j, v in enumerate(versions))
        p = rollout.plan(rspec, NEW, serving, status, phase, Observed(workload, sampled, now, REPLICA_TOKENS_S))
        if p.kind in ("advance", "complete"):
            new = [s for s in sampled if s.version == NEW]
            counts = rollout.schedule(rspec, replicas)
            low = replicas - counts[status.step - 1]
            high = replicas - (counts[status.step - 2] if status.step > 1 else 0)
            judged = [s for s in new if low <= int(s.name.split("-")[1]) < high] or new
            lk, loaded = sum(s.lookups for s in judged), sum(s.loaded_tokens for s in judged)
            prompt = sum(s.prompt_tokens for s in judged)
            needed = rspec.recovery.threshold * (status.baseline_hit_rate or 0.0)
            assert lk >= rspec.recovery.min_lookups and prompt and loaded >= needed * prompt
            assert sum(s.ready for s in new) >= rollout.schedule(rspec, replicas)[status.step - 1]
        if p.workload is not None:
            assert 0 <= p.workload.partition <= replicas
        workload, versions = converge(workload, p.workload, versions)
        status = p.rollout or status
        phase = p.phase or phase
        serving = p.version or serving
        if p.kind == "rollback":
            assert versions == [OLD] * replicas and workload.template_version == OLD
        if phase == "RolledBack":
            assert versions == [OLD] * replicas
        if p.kind == "complete":
            assert versions == [NEW] * replicas and serving == NEW


def test_scaled_to_zero_mid_rollout_holds_the_step_and_restarts_its_clock_instead_of_rolling_back():
    later = T0 + timedelta(seconds=300)  # far past the 20s window
    p = rollout.plan(spec(), NEW, OLD, rolling(step=2), "RollingOut", observed(NEW, 2, [], now=later, replicas=0))
    assert p.kind == "hold" and p.workload is None and p.event is None
    assert p.rollout.step == 2 and p.rollout.step_started_at == later
    assert [(c.type, c.reason) for c in p.conditions] == [("RolloutProgressing", "ScaledToZero")]
    # Scaled back up: the step is judged from the restarted clock, so it waits, not rolls back.
    back = observed(NEW, 2, [OLD] * 2 + [NEW] * 2, now=later + timedelta(seconds=5), lookups=10, hits=0)
    resumed = rollout.plan(spec(), NEW, OLD, p.rollout, "RollingOut", back)
    assert resumed.kind == "wait" and [c.reason for c in resumed.conditions] == ["WaitingForRecovery"]
