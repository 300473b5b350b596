"""The operator's Prometheus metrics: where each policy's rollout stands and what the
analysis decided. Pure bookkeeping (`RolloutMetrics.observe` from the status the
rollout tick wrote) plus a small aiohttp server for /metrics.

Series exist only while a rollout is in flight (phase RollingOut or Paused), so the
chart's KVTierRolloutStalled alert and the dashboard's rollout panels see exactly the
rollouts under way. Labels: namespace and policy of the KVCachePolicy, target_version.
Scrape with honor_labels (the namespace is the policy's, not the operator's).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Iterable

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvtier.policy import KVCachePolicyStatus

IN_FLIGHT = ("RollingOut", "Paused")
PHASES = ("RollingOut", "Paused")


@dataclass(frozen=True, slots=True)
class RolloutGauges:
    target_version: str
    step: int
    steps: int
    canary_percent: int
    phase: str
    baseline_hit_rate: float | None
    current_hit_rate: float | None
    recovery_bar: float | None
    step_started_s: float | None
    # Each step's new pods in their first minute of traffic: (step, pods) -> hit rate,
    # pods "all", "warm" or "cold" (status.rollout.firstMinutes).
    first_minute: tuple[tuple[int, str, float], ...] = ()


class RolloutMetrics:
    def __init__(self) -> None:
        self.rollouts: dict[tuple[str, str], RolloutGauges] = {}
        # (namespace, policy, plan kind) -> count: every decision the rollout tick took.
        self.decisions: collections.Counter = collections.Counter()
        # Warm-before-ready: (namespace, policy, outcome) -> pods; (namespace, policy) -> tokens.
        self.warmups: collections.Counter = collections.Counter()
        self.warmed_tokens: collections.Counter = collections.Counter()

    def observe(self, namespace: str, policy: str, status: KVCachePolicyStatus, steps: int, threshold: float) -> None:
        r = status.rollout
        if status.phase not in IN_FLIGHT or r is None or r.target_version is None:
            self.rollouts.pop((namespace, policy), None)
            return
        bar = None if r.baseline_hit_rate is None else round(threshold * r.baseline_hit_rate, 4)
        first = tuple((f.step, pods, rate) for f in r.first_minutes
                      for pods, rate in (("all", f.hit_rate), ("warm", f.warm_hit_rate), ("cold", f.cold_hit_rate))
                      if rate is not None)
        self.rollouts[(namespace, policy)] = RolloutGauges(
            r.target_version, r.step, steps, r.canary_percent, status.phase, r.baseline_hit_rate, r.current_hit_rate,
            bar, r.step_started_at.timestamp() if r.step_started_at else None, first)

    def decided(self, namespace: str, policy: str, kind: str) -> None:
        self.decisions[(namespace, policy, kind)] += 1

    def warmed(self, namespace: str, policy: str, outcome: str, tokens: int) -> None:
        """One pod's warm-up ended (Warmed, WarmupFailed, WarmupTimedOut)."""
        self.warmups[(namespace, policy, outcome)] += 1
        self.warmed_tokens[(namespace, policy)] += tokens

    def forget(self, namespace: str, policy: str) -> None:
        self.rollouts.pop((namespace, policy), None)

    def collect(self) -> Iterable:
        labels = ["namespace", "policy", "target_version"]
        fams = {
            "step": GaugeMetricFamily("kvtier_rollout_step", "Current step of the rollout (1-based)", labels=labels),
            "steps": GaugeMetricFamily("kvtier_rollout_steps", "Steps of the rollout", labels=labels),
            "canary_percent": GaugeMetricFamily("kvtier_rollout_canary_percent",
                                                "Percent of the fleet on the new version", labels=labels),
            "baseline_hit_rate": GaugeMetricFamily("kvtier_rollout_baseline_hit_rate",
                                                   "Old version's hit rate when the rollout started", labels=labels),
            "current_hit_rate": GaugeMetricFamily("kvtier_rollout_current_hit_rate",
                                                  "New version's hit rate as last judged", labels=labels),
            "recovery_bar": GaugeMetricFamily("kvtier_rollout_recovery_bar",
                                              "Hit rate a step must reach (threshold x baseline)", labels=labels),
            "step_started_s": GaugeMetricFamily("kvtier_rollout_step_started_timestamp_seconds",
                                                "When the current step started", labels=labels),
        }
        phase = GaugeMetricFamily("kvtier_rollout_phase", "1 for the rollout's phase", labels=labels + ["phase"])
        first = GaugeMetricFamily("kvtier_rollout_first_minute_hit_rate",
                                  "A step's new pods' hit rate in their first minute of traffic (pods: all, warm, cold)",
                                  labels=labels + ["step", "pods"])
        for (ns, pol), g in sorted(self.rollouts.items()):
            key = [ns, pol, g.target_version]
            for step, pods, rate in g.first_minute:
                first.add_metric(key + [str(step), pods], rate)
            for name, fam in fams.items():
                value = getattr(g, name)
                if value is not None:
                    fam.add_metric(key, float(value))
            for p in PHASES:
                phase.add_metric(key + [p], float(g.phase == p))
        yield from fams.values()
        yield phase
        yield first
        decisions = CounterMetricFamily("kvtier_rollout_decisions", "Rollout actions taken, by kind",
                                        labels=["namespace", "policy", "decision"])
        for (ns, pol, kind), n in sorted(self.decisions.items()):
            decisions.add_metric([ns, pol, kind], n)
        yield decisions
        warmups = CounterMetricFamily("kvtier_rollout_warmups", "Pods a rollout warmed before ready, by outcome",
                                      labels=["namespace", "policy", "outcome"])
        for (ns, pol, outcome), n in sorted(self.warmups.items()):
            warmups.add_metric([ns, pol, outcome], n)
        yield warmups
        tokens = CounterMetricFamily("kvtier_rollout_warmup_tokens", "Prompt tokens prefilled by warm-before-ready",
                                     labels=["namespace", "policy"])
        for (ns, pol), n in sorted(self.warmed_tokens.items()):
            tokens.add_metric([ns, pol], n)
        yield tokens

    def render(self) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return generate_latest(registry)


async def serve(metrics: RolloutMetrics, host: str, port: int) -> web.AppRunner:
    """GET /metrics on host:port; the caller cleans the runner up."""
    async def handle(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
