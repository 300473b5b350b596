"""A warmed pod's hit figures are its traffic's (issue #24): its sidecar counts the
warm-up's lookups apart (`sidecar.warmup_*` in `GET /cache/stats`, never `lookups` nor
the engine's loaded/prompt tokens), and the operator reads only the traffic's figures —
the pods' samples (`rollout_reconcile._samples`, `sidecar_client.parse_stats`), the
step's recovery check, the alarm source's sample size, the first-minute figure and the
fleet hit rate. A canary warmed with 300 prompts that all missed (it was cold), whose
traffic then loads 85% of its prompt tokens, recovers at once; read as if the warm-up
were traffic, the same pod would sit at 14% and be rolled back."""
from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from kvtier import control_api
from kvtier.policy import Counters, PodWarmup, Recovery, Rollout, RolloutStatus
from kvtier_operator import first_minute as fm
from kvtier_operator import names, rollout, rollout_reconcile
from kvtier_operator.analysis import Probe
from kvtier_operator.rollout import Observed, PodSample, Workload
from kvtier_operator.sidecar_client import FleetStats, parse_stats
from test_rollout_planner import NEW, OLD, REPLICA_TOKENS_S, T0

# The warm-up as the sidecar counts it: 300 prompts, 30,000 prompt tokens, all missed.
WARMUP = {"warmup_lookups": 300, "warmup_tokens_hit": 0, "warmup_tokens_miss": 30_000}
SIDECAR = Rollout(canary_pods=1, steps=[50, 100], recovery=Recovery(threshold=0.8, window="2m", min_lookups=20))
ALARM = Rollout(canary_pods=1, steps=[50, 100],
                recovery=Recovery(window="2m", min_lookups=20, source="alarm", interval="5s", count=1,
                                  alarm={"url": "http://127.0.0.1:9093"}))


def stats_body(lookups: int, loaded: int, prompt: int, **sidecar: int) -> dict[str, Any]:
    """A `GET /cache/stats` answer as the sidecar sends it (the shared control-API model)."""
    engine = control_api.EngineLoads(loaded_tokens_by_tier={"dram": loaded}, prompt_tokens=prompt)
    return control_api.dump(control_api.SidecarStats(lookups=lookups, hits=lookups, engine=engine, sidecar=sidecar))


class Sidecars:
    """The operator's sidecar client, each member answering its stats body."""

    def __init__(self, bodies: dict[str, dict[str, Any]]) -> None:
        self.bodies = bodies

    async def fleet_stats(self, members) -> FleetStats:
        return FleetStats(tuple(s for n in members if (s := parse_stats(n, self.bodies[n])) is not None))


def pod(name: str, version: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "annotations": {names.WEIGHTS_VERSION_ANNOTATION: version}},
            "status": {"phase": "Running", "podIP": f"10.0.0.{name[-1]}",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def samples(canary: dict[str, Any]) -> tuple[PodSample, ...]:
    """The pods as the rollout sees them: three old pods hitting 90%, the canary `canary`."""
    bodies = {f"llm-{i}": stats_body(100, 900, 1000) for i in range(3)} | {"llm-3": canary}
    pods = [pod(f"llm-{i}", OLD) for i in range(3)] + [pod("llm-3", NEW)]
    return asyncio.run(rollout_reconcile._samples(Sidecars(bodies), "ns", pods))


def rolling() -> RolloutStatus:
    warmed = PodWarmup(pod="llm-3", version=NEW, outcome="Warmed", tokens=30_000, finished_at=T0)
    return RolloutStatus(target_version=NEW, step=1, baseline_hit_rate=0.9, step_started_at=T0, warmups=[warmed])


def observed(pods: tuple[PodSample, ...], seconds: float, probe: Probe | None = None) -> Observed:
    return Observed(Workload(4, NEW, 3), pods, T0 + timedelta(seconds=seconds), REPLICA_TOKENS_S, probe=probe)


def test_a_warmed_canarys_recovery_check_reads_its_traffic_not_its_warm_ups_misses():
    pods = samples(stats_body(60, 5100, 6000, **WARMUP))
    assert pods[3] == PodSample("llm-3", NEW, True, 60, 5100, 6000)
    assert rollout.hit_rate(pods[3:]).rate == 0.85
    advanced = rollout.plan(SIDECAR, NEW, OLD, rolling(), "RollingOut", observed(pods, 30))
    assert advanced.kind == "advance", advanced.conditions
    assert "hit rate 0.8500 >= 0.7200 over 60 lookups" in advanced.event[2]
    # The same pod read as if its warm-up were traffic (an engine that sends no purpose,
    # or a sidecar before #24): the warm-up's misses hold it below the bar, then roll it back.
    as_traffic = pods[:3] + (PodSample("llm-3", NEW, True, 360, 5100, 36_000),)
    assert rollout.plan(SIDECAR, NEW, OLD, rolling(), "RollingOut", observed(as_traffic, 30)).kind == "wait"
    assert rollout.plan(SIDECAR, NEW, OLD, rolling(), "RollingOut", observed(as_traffic, 120)).kind == "rollback"
    # The fleet hit rate (`status.fleetHitRate`) is the traffic's too.
    canary = FleetStats((parse_stats("llm-3", stats_body(60, 5100, 6000, **WARMUP)),))
    assert canary.hit_rate == 0.85


def test_a_warmed_canary_with_no_traffic_yet_gives_the_alarm_no_sample():
    """300 warm-up lookups are no lookups of traffic: a silent alarm over them is
    inconclusive (minLookups 20 not served), never a success."""
    pods = samples(stats_body(0, 0, 0, **WARMUP))
    assert pods[3] == PodSample("llm-3", NEW, True, 0, 0, 0)
    quiet = rollout.plan(ALARM, NEW, OLD, rolling(), "RollingOut", observed(pods, 5, Probe()))
    assert quiet.kind == "wait"
    a = quiet.rollout.analysis
    assert (a.successes, a.inconclusives) == (0, 1) and "served 0 < 20 lookups" in a.message


def test_a_warmed_pods_first_minute_is_its_traffic():
    """The window opens when the pod first serves, from counters the warm-up never moved,
    and its figure is the traffic's alone."""
    r, figs = fm.observe(rolling(), "RollingOut", samples(stats_body(0, 0, 0, **WARMUP)), [1, 2, 4],
                         T0 + timedelta(seconds=1), 60)
    assert figs == [] and [(w.pod, w.warm, w.start) for w in r.first_minute_pods] == [
        ("llm-3", True, Counters(lookups=0, loaded_tokens=0, prompt_tokens=0))]
    # A minute of traffic; a restarted operator's second warm-up of the pod meanwhile
    # (the engine answers it from its cache) moves only the warm-up counters.
    again = {**WARMUP, "warmup_lookups": 600, "warmup_tokens_hit": 29_000}
    r, [f] = fm.observe(r, "RollingOut", samples(stats_body(60, 5100, 6000, **again)), [1, 2, 4],
                        T0 + timedelta(seconds=61), 60)
    assert (f.pods, f.warm_pods, f.lookups, f.loaded_tokens, f.prompt_tokens) == (1, 1, 60, 5100, 6000)
    assert (f.hit_rate, f.warm_hit_rate, f.baseline_hit_rate, f.baseline_source) == (0.85, 0.85, 0.9, "oldPods")
