"""Rollout analysis for the prometheus and alarm recovery sources: pure.

Argo Rollouts' AnalysisRun semantics, on what one step of a kvtier rollout needs:

    every `interval`: one measurement ->
      successful    value >= bar (prometheus), or the alert is silent and the new pods
                    served >= minLookups lookups (alarm)
      pending       value below the bar while `window` is not over (a cold cache is
                    expected to start low: not a failure yet)
      failed        value below the bar after `window`, or the named alert fires
      inconclusive  no series / NaN (too few lookups); for alarm: too few lookups, or the
                    alert pending (its condition holds, not yet for its `for:`)
      error         Prometheus or Alertmanager unreachable or answering garbage

    failures > failureLimit                 -> fail (roll back, or pause on onFailure: pause)
    consecutive errors > consecutiveErrorLimit,
    or inconclusives > inconclusiveLimit     -> inconclusive: pause, resume by itself once a
                                               measurement is conclusive again
    successes >= count, new pods ready       -> pass (advance / complete)

Nothing here performs I/O: the thin client (`prom_client`) turns HTTP answers into a
`Probe`, the handler decides when one is due (`due`), and the planner calls `measure`,
`tally` and `judge`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from kvtier.policy import AnalysisStatus, Recovery

Result = Literal["successful", "failed", "pending", "inconclusive", "error"]
VerdictKind = Literal["continue", "pass", "fail", "inconclusive"]
# Values in messages and status: four decimals, like the rollout's hit rates.
VALUE_DIGITS = 4


@dataclass(frozen=True, slots=True)
class Probe:
    """What one look at Prometheus or Alertmanager returned. `error` set: it could not
    be asked (unreachable, HTTP error, unparsable answer). `value`: the query's single
    sample (None: no series). `firing`/`pending`: descriptions of the matching alerts
    in each state (Alertmanager only ever reports firing ones)."""

    value: float | None = None
    error: str | None = None
    firing: tuple[str, ...] = ()
    pending: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Measurement:
    result: Result
    value: float | None
    message: str


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: VerdictKind
    reason: str


def render_query(template: str, *, namespace: str, policy: str, version: str, window: str, min_lookups: int) -> str:
    """The recovery query with its placeholders filled (plain substitution: label values
    are Kubernetes names and version strings, which PromQL string literals accept)."""
    out = template
    for key, value in (("namespace", namespace), ("policy", policy), ("version", version), ("window", window),
                       ("minLookups", str(min_lookups))):
        out = out.replace("{{" + key + "}}", value)
    return out


def due(spec: Recovery, analysis: AnalysisStatus | None, now: datetime) -> bool:
    """A measurement is due when none was taken this step or `interval` has passed."""
    if analysis is None or analysis.measured_at is None:
        return True
    return (now - analysis.measured_at).total_seconds() >= spec.interval_s


def measure_hit_rate(probe: Probe, bar: float, window_over: bool) -> Measurement:
    """A prometheus-source measurement: the new version's hit rate against the bar."""
    if probe.error is not None:
        return Measurement("error", None, f"query failed: {probe.error}")
    value = probe.value
    if value is None or math.isnan(value):
        return Measurement("inconclusive", None, "no data: no series (too few lookups, or nothing scraped yet)")
    value = round(value, VALUE_DIGITS)
    if value >= bar:
        return Measurement("successful", value, f"hit rate {value:.4f} >= {bar:.4f}")
    if not window_over:
        return Measurement("pending", value, f"hit rate {value:.4f} < {bar:.4f}, recovery window not over")
    return Measurement("failed", value, f"hit rate {value:.4f} < {bar:.4f} after the recovery window")


def measure_alarm(probe: Probe, alert: str, version: str, lookups: int, min_lookups: int) -> Measurement:
    """An alarm-source measurement: the alert must be silent for the new version, and
    the new pods must have served enough lookups for silence to mean something
    (`lookups`: traffic's, never the warm-up's, which the sidecars count apart)."""
    if probe.error is not None:
        return Measurement("error", None, f"alerts query failed: {probe.error}")
    if probe.firing:
        return Measurement("failed", None, f"alert {alert} firing for {version}: {'; '.join(probe.firing)}"[:1024])
    if probe.pending:  # the condition holds but not for long yet: neither silence nor failure
        return Measurement("inconclusive", None, f"alert {alert} pending for {version}: {'; '.join(probe.pending)}"[:1024])
    if lookups < min_lookups:
        return Measurement("inconclusive", None,
                           f"alert {alert} silent but the new pods served {lookups} < {min_lookups} lookups")
    return Measurement("successful", None, f"alert {alert} silent for {version} over {lookups} lookups")


def tally(analysis: AnalysisStatus | None, m: Measurement, now: datetime) -> AnalysisStatus:
    a = analysis or AnalysisStatus()
    counts = {
        "successes": a.successes + (m.result == "successful"),
        "failures": a.failures + (m.result == "failed"),
        "inconclusives": a.inconclusives + (m.result == "inconclusive"),
        "consecutive_errors": a.consecutive_errors + 1 if m.result == "error" else 0,
    }
    return a.model_copy(update={**counts, "measured_at": now, "last_result": m.result, "last_value": m.value,
                                "message": m.message[:1024]})


def judge(spec: Recovery, a: AnalysisStatus, new_pods_ready: bool) -> Verdict:
    if a.failures > spec.failure_limit:
        return Verdict("fail", f"{a.failures} failed measurements (failureLimit {spec.failure_limit}); "
                               f"last: {a.message}")
    if a.consecutive_errors > spec.consecutive_error_limit:
        return Verdict("inconclusive", f"{a.consecutive_errors} errors in a row (consecutiveErrorLimit "
                                       f"{spec.consecutive_error_limit}); last: {a.message}")
    if a.inconclusives > spec.inconclusive_limit:
        return Verdict("inconclusive", f"{a.inconclusives} inconclusive measurements (inconclusiveLimit "
                                       f"{spec.inconclusive_limit}); last: {a.message}")
    if a.successes >= spec.count and new_pods_ready:
        return Verdict("pass", f"{a.successes}/{spec.count} successful measurements; last: {a.message}")
    return Verdict("continue", f"{a.successes}/{spec.count} successful, {a.failures} failed, "
                               f"{a.inconclusives} inconclusive; last: {a.message or 'none yet'}")


def conclusive(m: Measurement) -> bool:
    """A measurement that ends an inconclusive pause: the source answered with data."""
    return m.result in ("successful", "failed", "pending")


def matching_alerts(alerts: list[dict], alert: str, labels: dict[str, str],
                    states: tuple[str, ...] = ("firing", "active")) -> tuple[str, ...]:
    """Descriptions of the alerts named `alert` in one of `states` whose labels include
    `labels`. Accepts both shapes: Prometheus' /api/v1/alerts (state "firing" or
    "pending") and Alertmanager's /api/v2/alerts (status.state "active")."""
    out = []
    for a in alerts:
        got = a.get("labels") or {}
        state = a.get("state") or (a.get("status") or {}).get("state")
        if got.get("alertname") != alert or state not in states:
            continue
        if any(got.get(k) != v for k, v in labels.items()):
            continue
        since = a.get("activeAt") or a.get("startsAt") or "?"
        value = a.get("value")
        out.append(f"since {since}" + (f", value {value}" if value is not None else ""))
    return tuple(sorted(out))
