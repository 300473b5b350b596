"""The operator's rollout metrics (pure): series exist exactly while a rollout is in
flight, carry the policy's namespace and the target version, and count decisions."""
from __future__ import annotations

from datetime import datetime, timezone

from prometheus_client.parser import text_string_to_metric_families

from kvtier.policy import KVCachePolicyStatus, RolloutStatus
from kvtier_operator.metrics import RolloutMetrics

T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)
NEW = "sha256:" + "2" * 64


def parsed(m: RolloutMetrics) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(m.render().decode())}


def rolling(phase: str = "RollingOut") -> KVCachePolicyStatus:
    return KVCachePolicyStatus(phase=phase, rollout=RolloutStatus(
        target_version=NEW, step=2, canary_percent=50, baseline_hit_rate=0.9, current_hit_rate=0.5,
        step_started_at=T0))


def test_in_flight_rollout_is_exported_with_its_numbers():
    m = RolloutMetrics()
    m.observe("ns", "llm", rolling(), steps=3, threshold=0.8)
    m.decided("ns", "llm", "advance")
    got = parsed(m)
    labels = {"namespace": "ns", "policy": "llm", "target_version": NEW}
    assert [(s.labels, s.value) for s in got["kvtier_rollout_step"]] == [(labels, 2.0)]
    assert got["kvtier_rollout_recovery_bar"][0].value == 0.72
    assert got["kvtier_rollout_step_started_timestamp_seconds"][0].value == T0.timestamp()
    phases = {s.labels["phase"]: s.value for s in got["kvtier_rollout_phase"]}
    assert phases == {"RollingOut": 1.0, "Paused": 0.0}
    [decision] = [s for s in got["kvtier_rollout_decisions"] if s.name == "kvtier_rollout_decisions_total"]
    assert decision.labels["decision"] == "advance" and decision.value == 1


def test_series_go_when_the_rollout_ends_or_the_policy_goes():
    m = RolloutMetrics()
    m.observe("ns", "llm", rolling(), steps=3, threshold=0.8)
    m.observe("ns", "llm", rolling("Ready"), steps=3, threshold=0.8)
    assert parsed(m)["kvtier_rollout_step"] == []
    m.observe("ns", "llm", rolling("Paused"), steps=3, threshold=0.8)
    m.forget("ns", "llm")
    assert parsed(m)["kvtier_rollout_step"] == []


def test_warm_ups_are_counted_by_outcome_with_their_tokens():
    m = RolloutMetrics()
    m.warmed("ns", "llm", "Warmed", 384)
    m.warmed("ns", "llm", "Warmed", 16)
    m.warmed("ns", "llm", "WarmupTimedOut", 0)
    got = parsed(m)
    by_outcome = {s.labels["outcome"]: s.value for s in got["kvtier_rollout_warmups"]
                  if s.name == "kvtier_rollout_warmups_total"}
    assert by_outcome == {"Warmed": 2.0, "WarmupTimedOut": 1.0}
    [tokens] = [s for s in got["kvtier_rollout_warmup_tokens"] if s.name == "kvtier_rollout_warmup_tokens_total"]
    assert (tokens.labels, tokens.value) == ({"namespace": "ns", "policy": "llm"}, 400.0)


def test_each_steps_first_minute_hit_rate_is_exported_for_all_warm_and_cold_pods():
    from kvtier.policy import FirstMinute

    status = rolling()
    figure = FirstMinute(step=1, window_s=60, pods=3, warm_pods=2, cold_pods=1, hit_rate=0.6, warm_hit_rate=0.85,
                         cold_hit_rate=0.1, started_at=T0, measured_at=T0)
    status.rollout.first_minutes.append(figure)
    m = RolloutMetrics()
    m.observe("ns", "llm", status, steps=3, threshold=0.8)
    got = {(s.labels["step"], s.labels["pods"]): s.value for s in parsed(m)["kvtier_rollout_first_minute_hit_rate"]}
    assert got == {("1", "all"): 0.6, ("1", "warm"): 0.85, ("1", "cold"): 0.1}
    m.observe("ns", "llm", rolling("Ready"), steps=3, threshold=0.8)
    assert parsed(m)["kvtier_rollout_first_minute_hit_rate"] == []
