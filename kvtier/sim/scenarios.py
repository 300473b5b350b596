"""Scenarios: the questions `kvtier simulate` answers, each a set of runs plus figures.

- `design_notes`  the design notes' fleet (44 replicas, 2,000 tenants x 5 templates
                  x 1,500 tokens, 320 KiB/token, 500 GiB DRAM): the arithmetic
                  (working set, random coverage, tenants per home) and kvtier vs
                  random vs the oracle, simulated.
- `compare`       every routing policy on one workload: hit rate, prefill, balance.
- `capacity`      hit rate vs DRAM capacity per policy.
- `membership`    a replica joins, later one leaves: hit rate over time, with and
                  without warming moved tenants.
- `rollout`       a weights change all at once vs in steps (canary, 10%, 50%, 100%),
                  cold or warmed before ready: peak prefill load, the hit-rate dip.
- `thrash`        working set far above capacity: kvtier's admission vs plain LRU.

Each function returns a `ScenarioReport`: the runs' results plus named figures
(with the target where the design sets one), and notes saying where a competitor
does better. Sizes scale with `scale` so tests run small and benches run full.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvtier.affinity import DEFAULT_HOMES
from kvtier.policy import DEFAULT_ROLLOUT_WARM_TOKENS
from kvtier.sim.loop import Event, ProgressFactory, SimConfig, SimResult, simulate
from kvtier.sim.fleet import FleetSpec
from kvtier.sim.workload import WorkloadSpec, generate

GIB, TIB = 2**30, 2**40
DRAM_FULL_BYTES = 500 * GIB  # one design-notes host's DRAM tier
# Arrival rate that keeps the design fleet's mean KV occupancy near 0.7: busy
# enough that the 0.85 spill threshold matters, below the preemption cliff.
DESIGN_RATE_RPS = 900.0
# Capacity-scale runs simulate 256-token blocks of 16-token elements: a template's
# match is then exact to 256 tokens instead of 16 (stated in every output).
COARSE_UNIT, COARSE_BLOCK = 16, 256
COMPETITORS = ("random", "round-robin", "chash-tenant", "chash-session", "approx-prefix",
               "precise-prefix", "sglang", "kvtier", "oracle")
# The operator's default rollout: one canary pod, then 10%, 50%, 100% of the pods.
ROLLOUT_STEPS = (10, 50, 100)
# The operator's default per-pod warm-up budget (spec.rollout.warmup.maxTokens).
WARM_BEFORE_READY_TOKENS = DEFAULT_ROLLOUT_WARM_TOKENS
# Issue #24's target: warmed before ready, the rollout's hit-rate dip is at most this
# share of the cold rolling one's, at the same extra prefill.
WARM_DIP_TARGET = 0.2
# A bucket counts towards a dip's duration while its hit rate is below this share of
# the same bucket's in the run without a rollout.
DIP_FLOOR = 0.95
NO_ROLLOUT = "no rollout (control)"
# The comparison row: the operator's warm-up before it read the restarted pod's own
# sidecar (issue #24), at the same extra prefill.
OTHER_HOMES_ONLY = "sources: the tenants' other homes only (the operator before the own-sidecar snapshot)"


@dataclass(slots=True)
class Figure:
    """One number the scenario reports, with its target when the design sets one."""

    name: str
    value: float
    target: float | None = None
    direction: str = "higher"
    baseline: float | None = None
    baseline_name: str = ""
    unit: str = ""
    note: str = ""

    @property
    def passed(self) -> bool | None:
        if self.target is None:
            return None
        return self.value >= self.target if self.direction == "higher" else self.value <= self.target


@dataclass(slots=True)
class ScenarioReport:
    name: str
    description: str
    results: list[SimResult] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    params: dict = field(default_factory=dict)

    def result(self, label: str) -> SimResult:
        return next(r for r in self.results if r.label == label)

    def as_dict(self, series: bool = True) -> dict:
        return {
            "name": self.name, "description": self.description, "params": self.params,
            "results": [r.as_dict() if series else r.summary() for r in self.results],
            "figures": [{"name": f.name, "value": f.value, "target": f.target, "direction": f.direction,
                         "baseline": f.baseline, "baseline_name": f.baseline_name, "unit": f.unit,
                         "passed": f.passed, "note": f.note} for f in self.figures],
            "notes": self.notes,
        }


def granularity_note(unit: int, block_tokens: int) -> str:
    if unit == 1 and block_tokens == 16:
        return "simulated at the engine's granularity: 16-token blocks, exact token ids"
    return (f"simulated at a coarser granularity: one token element = {unit} real tokens, "
            f"cache blocks of {block_tokens} tokens (matches are whole {block_tokens}-token blocks)")


# ---------------------------------------------------------------------- design notes

def design_workload(n_requests: int, unit: int = COARSE_UNIT, seed: int = 0, **overrides) -> WorkloadSpec:
    """2,000 tenants x 5 templates x 1,500 tokens, uniform popularity, a fresh query each."""
    base = WorkloadSpec(n_requests=n_requests, rate_rps=DESIGN_RATE_RPS, n_tenants=2_000, templates_per_tenant=5,
                        template_tokens=(1_500, 1_500), query_tokens=(50, 150), token_unit=unit, seed=seed)
    return replace(base, **overrides)


def design_arithmetic(fleet: FleetSpec, spec: WorkloadSpec, homes: int = DEFAULT_HOMES) -> dict:
    """The design notes' numbers, computed from the same inputs the simulation uses."""
    working_set = spec.working_set_tokens() * fleet.kv_bytes_per_token
    tenants_per_home = spec.n_tenants * homes / fleet.n_replicas
    per_home = tenants_per_home * spec.templates_per_tenant * spec.template_tokens[0] * fleet.kv_bytes_per_token
    return {
        "working_set_tib": working_set / TIB,
        "random_coverage": fleet.dram_bytes / working_set,
        "tenants_per_home": tenants_per_home,
        "home_working_set_gib": per_home / GIB,
        "home_fits": per_home <= fleet.dram_bytes,
    }


def design_notes(n_requests: int = 1_000_000, policies=("kvtier", "random", "oracle"), unit: int = COARSE_UNIT,
                 block_tokens: int = COARSE_BLOCK, n_tenants: int = 2_000, progress: ProgressFactory | None = None,
                 seed: int = 0) -> ScenarioReport:
    """The design notes' case. With fewer tenants (quick runs), DRAM shrinks in
    proportion so one host still covers ~11% of the working set, and the fleet and
    k stay as they are; the arithmetic figures are always the full-size ones."""
    full_fleet = FleetSpec()
    arith = design_arithmetic(full_fleet, design_workload(1))
    fleet = replace(full_fleet, dram_bytes=int(full_fleet.dram_bytes * n_tenants / 2_000))
    spec = design_workload(n_requests, unit, seed, n_tenants=n_tenants)
    rep = ScenarioReport("design-notes", "44 replicas, 2,000 tenants x 5 templates x 1,500 tokens at 320 KiB/token, "
                         "500 GiB DRAM per host", params={"n_requests": n_requests, **arith,
                                                          "granularity": granularity_note(unit, block_tokens)})
    if n_tenants != 2_000:
        rep.params["scaled"] = (f"simulated with {n_tenants} tenants and {fleet.dram_bytes / GIB:.0f} GiB DRAM per "
                                "replica (same coverage, same 44 replicas and k=3)")
    rep.figures += [
        Figure("working set", arith["working_set_tib"], unit="TiB", note="2,000 x 5 x 1,500 x 320 KiB"),
        Figure("random routing covers", arith["random_coverage"], unit="fraction", note="500 GiB / working set"),
        Figure("tenants per replica with k=3 homes", arith["tenants_per_home"], unit="tenants"),
        Figure("their working set", arith["home_working_set_gib"], target=full_fleet.dram_bytes / GIB,
               direction="lower", unit="GiB", note="fits in one host's 500 GiB DRAM"),
    ]
    workload = generate(spec)
    mean_prompt = float(workload.prompt_elems().mean()) * unit
    cold = spec.rate_rps * mean_prompt / fleet.prefill_tokens_per_s
    rep.params["prefill_replicas_needed_without_cache"] = cold
    if cold > fleet.n_replicas:
        rep.notes.append(f"at {spec.rate_rps:g} rps the fleet needs {cold:.1f} replicas of prefill without cache "
                         f"hits, more than its {fleet.n_replicas}: a policy that does not hit overloads it "
                         "(see its TTFT); the rate keeps kvtier's mean KV occupancy near 0.7")
    for p in policies:
        rep.results.append(simulate(SimConfig(spec, fleet, policy=p, block_tokens=block_tokens, progress=progress),
                                    workload=workload, label=p))
    by = {r.label: r for r in rep.results}
    if "kvtier" in by and "oracle" in by:
        rep.figures.append(Figure("kvtier hit rate vs oracle", by["kvtier"].hit_rate / by["oracle"].hit_rate,
                                  target=0.9, baseline=by["oracle"].hit_rate, baseline_name="oracle hit rate",
                                  unit="x"))
    if "kvtier" in by and "random" in by:
        rep.figures.append(Figure("kvtier hit rate vs random", by["kvtier"].hit_rate / max(by["random"].hit_rate, 1e-9),
                                  target=5.0, baseline=by["random"].hit_rate, baseline_name="random hit rate",
                                  unit="x"))
        rep.figures.append(Figure("random routing: requests with a hit", by["random"].request_hit_rate,
                                  unit="fraction", note="compare with the ~11% coverage"))
    if "kvtier" in by:
        rep.figures.append(Figure("kvtier max/mean replica load", by["kvtier"].load_imbalance, target=1.25,
                                  direction="lower", unit="x"))
        rep.figures.append(Figure("kvtier simulation time", by["kvtier"].cpu_s, unit="s CPU",
                                  note=f"{n_requests:,} requests; wall {by['kvtier'].wall_s:.1f} s"))
    _truth_notes(rep)
    return rep


# ---------------------------------------------------------------------- comparisons

def mixed_workload(n_requests: int, unit: int = 1, n_tenants: int = 200, seed: int = 0, **overrides) -> WorkloadSpec:
    """All four populations, Zipf-popular tenants: the default comparison workload."""
    # ~80 rps of ~4,000-token prompts per 16 replicas: ~70% of their cold prefill capacity.
    base = WorkloadSpec(n_requests=n_requests, rate_rps=80.0, n_tenants=n_tenants, templates_per_tenant=5,
                        template_tokens=(200, 2_000), tenant_zipf=1.0, template_zipf=1.0,
                        rag_share=0.2, docs_per_tenant=20, doc_tokens=(2_000, 20_000), doc_zipf=1.2,
                        conversation_share=0.15, agent_share=0.15, token_unit=unit, seed=seed)
    return replace(base, **overrides)


def small_fleet(n_replicas: int = 16, dram_gib: float = 40.0, **overrides) -> FleetSpec:
    return replace(FleetSpec(), n_replicas=n_replicas, dram_bytes=int(dram_gib * GIB), **overrides)


def compare(spec: WorkloadSpec, fleet: FleetSpec, policies=COMPETITORS, block_tokens: int = COARSE_BLOCK,
            cache: str = "kvtier", progress: ProgressFactory | None = None) -> ScenarioReport:
    rep = ScenarioReport("compare", "every routing policy on one workload and fleet (same cache on every replica)",
                         params={"n_requests": spec.n_requests, "replicas": fleet.n_replicas,
                                 "dram_gib": fleet.dram_bytes / GIB, "cache": cache,
                                 "granularity": granularity_note(spec.token_unit, block_tokens)})
    workload = generate(spec)
    for p in policies:
        rep.results.append(simulate(SimConfig(spec, fleet, policy=p, cache=cache, block_tokens=block_tokens,
                                              progress=progress), workload=workload, label=p))
    _truth_notes(rep)
    return rep


def capacity(spec: WorkloadSpec, fleet: FleetSpec, dram_gib=(5, 10, 20, 40, 80), policies=COMPETITORS,
             block_tokens: int = COARSE_BLOCK, progress: ProgressFactory | None = None) -> ScenarioReport:
    rep = ScenarioReport("capacity", "hit rate vs DRAM capacity per replica, per routing policy",
                         params={"dram_gib": list(dram_gib), "n_requests": spec.n_requests,
                                 "replicas": fleet.n_replicas,
                                 "granularity": granularity_note(spec.token_unit, block_tokens)})
    workload = generate(spec)
    for gib in dram_gib:
        f = replace(fleet, dram_bytes=int(gib * GIB))
        for p in policies:
            if p == "oracle" and gib != dram_gib[0]:
                continue  # the oracle has infinite capacity: one run covers every size
            rep.results.append(simulate(SimConfig(spec, f, policy=p, block_tokens=block_tokens, progress=progress),
                                        workload=workload, label=f"{p}@{gib:g}GiB"))
    return rep


# ---------------------------------------------------------------------- membership

def membership(spec: WorkloadSpec, fleet: FleetSpec, join_at_s: float, leave_at_s: float,
               block_tokens: int = COARSE_BLOCK, policy: str = "kvtier", progress: ProgressFactory | None = None) -> ScenarioReport:
    """One replica joins at `join_at_s`; replica 0 leaves at `leave_at_s`."""
    rep = ScenarioReport("membership", f"a replica joins at {join_at_s:g} s and one leaves at {leave_at_s:g} s",
                         params={"join_at_s": join_at_s, "leave_at_s": leave_at_s, "policy": policy,
                                 "granularity": granularity_note(spec.token_unit, block_tokens)})
    events = [Event(join_at_s, "join", label="join"), Event(leave_at_s, "leave", (0,), label="leave")]
    workload = generate(spec)
    for warm in (True, False):
        label = f"{policy} {'with' if warm else 'without'} warm-up"
        cfg = SimConfig(spec, fleet, policy=policy, block_tokens=block_tokens, warm_moved_tenants=warm,
                        bucket_s=5.0, progress=progress)
        rep.results.append(simulate(cfg, events, workload=workload, label=label))
    for r in rep.results:
        for ev in r.events:
            dip = _dip_after(r, ev["time_s"])
            rep.figures.append(Figure(f"{r.label}: hit-rate dip after {ev['kind']}", dip, unit="fraction",
                                      note=f"moved {ev.get('moved_tenants', 0)} tenants "
                                           f"({ev.get('movement_fraction', 0):.1%}), "
                                           f"warmed {ev.get('warmed_blocks', 0)} blocks"))
    return rep


def _dip_after(r: SimResult, t_s: float, window_s: float = 60.0) -> float:
    """Mean hit rate in the window before `t_s` minus the lowest bucket after it."""
    before = [h for t, h in zip(r.series_t_s, r.series_hit_rate) if t_s - window_s <= t < t_s]
    after = [h for t, h in zip(r.series_t_s, r.series_hit_rate) if t_s <= t < t_s + window_s]
    if not before or not after:
        return 0.0
    return sum(before) / len(before) - min(after)


# ---------------------------------------------------------------------- rollout

def rollout_events(n_replicas: int, start_s: float, gate_s: float, pod_s: float, steps=ROLLOUT_STEPS,
                   canary_pods: int = 1, snapshot: bool = False) -> list[Event]:
    """Canary pod(s), then each step's percentage of pods, each step `gate_s` after
    the previous step's last pod (the wait for hit-rate recovery). `snapshot`: each
    step starts by reading its pods' own hot lists (the operator does, before it moves
    the partition past them), for their warm-ups.

    Within a step the pods restart `pod_s` apart: a StatefulSet partition rolls one
    pod at a time, each waiting for the previous to load its weights and turn
    Ready. pod_s = 0 restarts a step's pods together (scaling up a canary
    Deployment does that).
    """
    targets = [canary_pods] + [max(canary_pods, -(-n_replicas * pct // 100)) for pct in steps]
    events, done, t = [], 0, start_s
    for k, target in enumerate(targets):
        pods = list(range(done, min(target, n_replicas)))
        if snapshot and pods:
            events.append(Event(t, "snapshot", tuple(pods), label=f"step {k}"))
        for j, r in enumerate(pods):
            events.append(Event(t + j * pod_s, "version", (r,), version=1, label=f"step {k}"))
        if pods:
            t += (len(pods) - 1) * pod_s + gate_s
        done = max(done, min(target, n_replicas))
    return events


def rollout(spec: WorkloadSpec, fleet: FleetSpec, start_s: float, gate_s: float, pod_s: float,
            block_tokens: int = COARSE_BLOCK, bucket_s: float = 10.0, progress: ProgressFactory | None = None,
            warm_tokens: int = WARM_BEFORE_READY_TOKENS, name: str = "rollout",
            workload=None, before_run: bool = True) -> ScenarioReport:
    """A weights change all at once, in steps (pods of a step together, or `pod_s`
    apart), and in steps warmed before ready: once with `warm_tokens` per pod (the
    operator's default budget), once with the budget that costs what the cold rolling
    rollout's extra prefill costs per pod ("at the same extra prefill"). A warmed
    pod's gate holds it out of traffic until its warm-up is prefilled, and the next pod
    restarts only once it is ready (a StatefulSet rolls one pod at a time), so a warmed
    rollout's pods are `pod_s` + the warm-up's prefill time apart. Warmed as the
    operator warms (each pod's own sidecar read at its step's start, then the other
    homes); `before_run`: also once at the same extra prefill from the other homes
    only (the operator before it read the pod's own sidecar), the comparison row."""
    rep = ScenarioReport(name, "a weights change: all replicas at once vs the default steps "
                         "(1 canary pod, 10%, 50%, 100%), cold or warmed before ready",
                         params={"start_s": start_s, "gate_s": gate_s, "pod_s": pod_s, "bucket_s": bucket_s,
                                 "warm_before_ready_tokens": warm_tokens,
                                 "granularity": granularity_note(spec.token_unit, block_tokens)})
    n, tps = fleet.n_replicas, fleet.prefill_tokens_per_s
    rolling = f"gradual, pods {pod_s:g} s apart"
    cold_plans = {
        "all at once": [Event(start_s, "version", tuple(range(n)), version=1, label="all")],
        "gradual, pods of a step together": rollout_events(n, start_s, gate_s, 0.0),
        rolling: rollout_events(n, start_s, gate_s, pod_s),
        NO_ROLLOUT: [],
    }
    workload = workload if workload is not None else generate(spec)

    def run(label, events, budget=0, source="own"):
        cfg = SimConfig(spec, fleet, policy="kvtier", block_tokens=block_tokens, bucket_s=bucket_s,
                        progress=progress, warm_before_ready_tokens=budget, warm_source=source)
        r = simulate(cfg, events, workload=workload, label=label)
        rep.results.append(r)
        return r

    for label, events in cold_plans.items():
        run(label, events)
    control, cold = rep.result(NO_ROLLOUT), rep.result(rolling)
    # The cold rolling rollout's extra prefill, per restarted pod, in tokens: the budget
    # at which warming costs what not warming costs.
    same = max(0, int((cold.prefill_replica_s - control.prefill_replica_s) * tps / n)) // 1024 * 1024
    warmed = {f"{rolling}, warmed before ready ({warm_tokens:,} tokens/pod)": warm_tokens,
              f"{rolling}, warmed before ready at the same extra prefill ({same:,} tokens/pod)": same}
    for label, budget in warmed.items():
        run(label, rollout_events(n, start_s, gate_s, pod_s + budget / tps, snapshot=True), budget)
    rep.params["same_extra_prefill_tokens_per_pod"] = same
    before = f"{rolling}, warmed before ready at the same extra prefill, {OTHER_HOMES_ONLY}"
    if before_run:
        run(before, rollout_events(n, start_s, gate_s, pod_s + same / tps, snapshot=True), same, source="homes")
    _dip_figures(rep, start_s, gate_s, rolling, list(warmed), fleet, before if before_run else None)
    peaks = {r.label: _peak_after(r, start_s) for r in rep.results if r.label in cold_plans and r.label != NO_ROLLOUT}
    steady = _mean_before(rep.results[0], start_s)
    rep.params["steady_prefill_load"] = steady
    # The capacity event is the load ABOVE the steady state: what the cache was
    # absorbing and suddenly is not. The total peak is reported beside it.
    excess = {label: max(0.0, peak - steady) for label, peak in peaks.items()}
    base = excess["all at once"]
    for label, peak in peaks.items():
        rep.figures.append(Figure(f"peak prefill load, {label}", peak, unit="replicas of prefill",
                                  note=f"steady state before: {steady:.2f}; excess {excess[label]:.2f}"))
    for label in list(peaks)[1:]:
        rep.figures.append(Figure(f"peak excess prefill ratio, {label} / all at once",
                                  excess[label] / base if base else 0.0, target=1 / 3, direction="lower",
                                  baseline=base, baseline_name="all-at-once excess", unit="x"))
        rep.figures.append(Figure(f"peak total prefill ratio, {label} / all at once",
                                  peaks[label] / peaks["all at once"] if peaks["all at once"] else 0.0,
                                  unit="x", note="includes the steady-state prefill both share"))
    return rep


@dataclass(frozen=True, slots=True)
class Dip:
    """A run's hit-rate dip during a rollout, against the same requests without one.

    `depth`: the largest shortfall of a bucket's fleet token hit rate below the
    control run's same bucket, over the rollout (first restart to `gate_s` after the
    last pod turned ready), relative to the control's hit rate over that period.
    `duration_s`: the time in buckets whose hit rate is under `DIP_FLOOR` of the
    control's. `extra_prefill_s`: replica-seconds of prefill above the control's,
    warm-up prefill included."""

    depth: float
    duration_s: float
    steady: float
    extra_prefill_s: float
    warmup_prefill_s: float
    first_minute: float | None


def warmup_tokens(r: SimResult) -> int:
    """Tokens the run's warm-ups prefilled."""
    return sum(e.get("warmed_tokens", 0) for e in r.events)


def rollout_end(r: SimResult, gate_s: float) -> float:
    """When the run's rollout is over: the last pod ready, plus the step's wait."""
    ready = [t for e in r.events if e["kind"] == "version" for t in e["ready_s"].values()]
    return (max(ready) if ready else 0.0) + gate_s


def dip(r: SimResult, control: SimResult, start_s: float, end_s: float, prefill_tokens_per_s: float) -> Dip:
    """The dip of run `r` from `start_s` to `end_s` against `control` (see `Dip`)."""
    idx = [i for i, t in enumerate(r.series_t_s) if start_s <= t < end_s and i < len(control.series_t_s)]
    warm_s = warmup_tokens(r) / prefill_tokens_per_s
    extra = r.prefill_replica_s + warm_s - control.prefill_replica_s
    rates = [v for e in r.events if e["kind"] == "version"
             for v in e.get("first_minute_hit_rate", {}).values() if v is not None]
    first = sum(rates) / len(rates) if rates else None
    if not idx:
        return Dip(0.0, 0.0, 0.0, extra, warm_s, first)
    # The control's hit rate over the period, weighted as its buckets' prompt tokens are.
    w = [control.series_prompt_tokens[i] for i in idx]
    steady = sum(wi * control.series_hit_rate[i] for wi, i in zip(w, idx)) / sum(w) if sum(w) else 0.0
    short = max(control.series_hit_rate[i] - r.series_hit_rate[i] for i in idx)
    depth = max(0.0, short) / steady if steady else 0.0
    below = sum(r.bucket_s for i in idx if r.series_hit_rate[i] < DIP_FLOOR * control.series_hit_rate[i])
    return Dip(depth, below, steady, extra, warm_s, first)


def _dip_figures(rep: ScenarioReport, start_s: float, gate_s: float, cold: str, warmed: list[str],
                 fleet: FleetSpec, before: str | None = None) -> None:
    control = rep.result(NO_ROLLOUT)
    tps = fleet.prefill_tokens_per_s
    dips = {label: dip(rep.result(label), control, start_s, rollout_end(rep.result(label), gate_s), tps)
            for label in ("all at once", cold, *warmed, *([before] if before else []))}
    for label, d in dips.items():
        first = "" if d.first_minute is None else \
            f"; restarted pods' first-minute hit rate {d.first_minute:.3f} (control {d.steady:.3f})"
        rep.figures.append(Figure(
            f"hit-rate dip depth, {label}", d.depth, unit="of steady hit rate", direction="lower",
            note=f"largest shortfall of a {control.bucket_s:g}-s bucket below the run without a rollout, "
                 f"{d.depth * d.steady:.3f} of {d.steady:.3f}; {d.duration_s:.0f} s under {DIP_FLOOR:.0%} of it; "
                 f"extra prefill {d.extra_prefill_s:.0f} replica-s (warm-up {d.warmup_prefill_s:.0f}){first}"))
    c = dips[cold]
    for i, label in enumerate(warmed):
        d = dips[label]
        same = i == len(warmed) - 1
        name = ("hit-rate dip depth ratio, warmed before ready at the same extra prefill / cold rolling" if same
                else "hit-rate dip depth ratio, warmed before ready (default budget) / cold rolling")
        rep.figures.append(Figure(
            name, d.depth / c.depth if c.depth else 0.0, target=WARM_DIP_TARGET if same else None,
            direction="lower", baseline=c.depth, baseline_name="cold rolling dip depth", unit="x",
            note=f"{label}: extra prefill {d.extra_prefill_s:.0f} replica-s (warm-up "
                 f"{d.warmup_prefill_s:.0f}) vs cold {c.extra_prefill_s:.0f}; dip {d.duration_s:.0f} s vs "
                 f"{c.duration_s:.0f} s under {DIP_FLOOR:.0%} of the control"))
        rep.figures.append(Figure(
            f"extra prefill ratio, {label} / cold rolling",
            d.extra_prefill_s / c.extra_prefill_s if c.extra_prefill_s > 0 else 0.0, unit="x",
            baseline=c.extra_prefill_s, baseline_name="cold rolling extra prefill (replica-s)",
            note="extra = prefill above the run without a rollout, the warm-up's own prefill included"))
    if before:
        d = dips[before]
        rep.figures.append(Figure(
            "hit-rate dip depth ratio, other homes only at the same extra prefill / cold rolling",
            d.depth / c.depth if c.depth else 0.0, direction="lower", baseline=c.depth,
            baseline_name="cold rolling dip depth", unit="x",
            note=f"{OTHER_HOMES_ONLY}; extra prefill {d.extra_prefill_s:.0f} replica-s (warm-up {d.warmup_prefill_s:.0f}) vs "
                 f"cold {c.extra_prefill_s:.0f}; dip {d.duration_s:.0f} s vs {c.duration_s:.0f} s"))


def _peak_after(r: SimResult, t_s: float) -> float:
    vals = [v for t, v in zip(r.series_t_s, r.series_prefill_load) if t >= t_s]
    return max(vals[:-1] or vals) if vals else 0.0  # the last bucket is partial


def _mean_before(r: SimResult, t_s: float) -> float:
    vals = [v for t, v in zip(r.series_t_s, r.series_prefill_load) if t_s / 2 <= t < t_s]
    return sum(vals) / len(vals) if vals else 0.0


# ---------------------------------------------------------------------- thrash

def thrash_workload(n_requests: int, unit: int = COARSE_UNIT, seed: int = 0) -> WorkloadSpec:
    """A small hot set (system prompts) under a stream of one-shot RAG documents."""
    # 10 rps of ~9,000-token prompts is ~90k tokens/s: what 4 replicas can prefill.
    return WorkloadSpec(n_requests=n_requests, rate_rps=10.0, n_tenants=40, templates_per_tenant=5,
                        template_tokens=(1_000, 2_000), rag_share=0.7, docs_per_tenant=5_000,
                        doc_tokens=(2_000, 20_000), doc_zipf=0.0, token_unit=unit, seed=seed)


def thrash(spec: WorkloadSpec, fleet: FleetSpec, policy: str = "kvtier", block_tokens: int = COARSE_BLOCK,
           progress: ProgressFactory | None = None) -> ScenarioReport:
    workload = generate(spec)
    demand = int(workload.prompt_elems().sum()) * spec.token_unit * fleet.kv_bytes_per_token
    rep = ScenarioReport("thrash", "working set far above capacity: one-shot documents stream past a hot set",
                         params={"policy": policy, "dram_gib": fleet.dram_bytes / GIB,
                                 "distinct_bytes_offered_gib": demand / GIB,
                                 "granularity": granularity_note(spec.token_unit, block_tokens)})
    for cache in ("kvtier", "lru"):
        cfg = SimConfig(spec, fleet, policy=policy, cache=cache, block_tokens=block_tokens, progress=progress)
        rep.results.append(simulate(cfg, workload=workload, label=f"{cache} cache"))
    k, lru = rep.results
    rep.figures.append(Figure("kvtier admission hit rate vs LRU", k.hit_rate / max(lru.hit_rate, 1e-9), target=2.0,
                              baseline=lru.hit_rate, baseline_name="LRU hit rate", unit="x"))
    return rep


# ---------------------------------------------------------------------- honesty

def _truth_notes(rep: ScenarioReport) -> None:
    """Say where a policy other than kvtier does better on some axis."""
    by = {r.label: r for r in rep.results}
    k = by.get("kvtier")
    if k is None:
        return
    others = [r for r in rep.results if r.label not in ("kvtier", "oracle")]
    for axis, better in (("hit rate", lambda r: r.hit_rate > k.hit_rate + 1e-9),
                         ("load balance (max/mean)", lambda r: r.load_imbalance < k.load_imbalance - 1e-9),
                         ("p99 TTFT", lambda r: r.ttft_p99_s < k.ttft_p99_s - 1e-9)):
        winners = [r.label for r in others if better(r)]
        if winners:
            rep.notes.append(f"better than kvtier on {axis}: {', '.join(winners)}")


# ---------------------------------------------------------------------- default sizes

def default_membership(n_requests: int = 90_000, progress: ProgressFactory | None = None, seed: int = 0) -> ScenarioReport:
    """16 replicas, 200 tenants x 5 templates x 1,500 tokens at 300 rps; a replica
    joins half-way through (once warm) and replica 0 leaves at three quarters."""
    spec = design_workload(n_requests, n_tenants=200, rate_rps=300.0, seed=seed)
    duration = n_requests / spec.rate_rps
    return membership(spec, small_fleet(16, 40.0), duration / 2, 3 * duration / 4, progress=progress)


def default_rollout(n_requests: int = 81_000, n_replicas: int = 8, progress: ProgressFactory | None = None,
                    seed: int = 0) -> ScenarioReport:
    """8 replicas, 100 tenants x 5 templates x 1,500 tokens at 150 rps (a cold fleet
    needs ~8.5 replicas of prefill). The rollout starts at 150 s, once warm; pods
    restart 30 s apart (a conservative time to load 70B weights) and each step waits
    30 s for recovery. 40 GiB of DRAM per replica holds less than its tenants'
    templates (~86 GiB): a cache under pressure."""
    rate = 150.0 * n_replicas / 8
    spec = design_workload(n_requests, n_tenants=100 * n_replicas // 8, rate_rps=rate, seed=seed)
    return rollout(spec, small_fleet(n_replicas, 40.0), start_s=150.0, gate_s=30.0, pod_s=30.0,
                   progress=progress)


def design_rollout(n_tenants: int = 200, n_requests: int | None = None, progress: ProgressFactory | None = None,
                   seed: int = 0, warm_tokens: int | None = None) -> ScenarioReport:
    """The design notes' fleet (44 replicas, k=3, 2,000 tenants x 5 x 1,500 tokens at
    900 rps, 500 GiB DRAM) rolled onto new weights one pod at a time, 30 s apart, each
    step waiting 30 s. Scaled by `n_tenants` / 2,000: the tenants, the arrival rate,
    the DRAM per host and the warm-up budget shrink together, so each template is
    asked for as often as in the full fleet and each pod's tenants' working set,
    DRAM and budget keep their proportions (the fleet's prefill load shrinks too)."""
    scale = n_tenants / 2_000
    start_s, gate_s, pod_s = 150.0, 30.0, 30.0
    fleet = replace(FleetSpec(), dram_bytes=int(DRAM_FULL_BYTES * scale))
    span = max(e.time_s for e in rollout_events(fleet.n_replicas, start_s, gate_s, pod_s))
    rate = DESIGN_RATE_RPS * scale
    # Past the slowest plan's end: warmed pods start up to ~5 s later each.
    n = n_requests or int(rate * (span + gate_s + 5.0 * fleet.n_replicas + 60.0))
    spec = design_workload(n, n_tenants=n_tenants, rate_rps=rate, seed=seed)
    budget = int(WARM_BEFORE_READY_TOKENS * scale) if warm_tokens is None else warm_tokens
    rep = rollout(spec, fleet, start_s=start_s, gate_s=gate_s, pod_s=pod_s, progress=progress,
                  warm_tokens=budget, name="rollout-design-notes")
    rep.params["scaled"] = (f"{n_tenants} tenants at {rate:g} rps, {fleet.dram_bytes / GIB:.0f} GiB DRAM and a "
                            f"{budget:,}-token warm-up budget per pod ({scale:g} of the design notes' 2,000 tenants, "
                            f"900 rps, 500 GiB and the operator's {WARM_BEFORE_READY_TOKENS:,}); 44 replicas, k=3")
    return rep


def trace_rollout(path, n_replicas: int = 8, n_tenants: int = 64, capacity: str = "0.1",
                  progress: ProgressFactory | None = None,
                  warm_tokens: int = WARM_BEFORE_READY_TOKENS, bucket_s: float = 60.0) -> ScenarioReport:
    """The shipped trace across `n_replicas` replicas of `capacity` each (a `kvtier
    simulate trace` capacity: a share of the trace's distinct blocks, or a token
    count), rolled onto new weights from a third of the way in, pods 30 s apart, each
    step waiting 30 s. A trace names no tenants: each conversation (its second block
    id; the first is one system prompt every request shares) is given to one of
    `n_tenants` tenants by its id, so a conversation's turns share their prefix as in
    the trace and tenants spread over the fleet's homes as a multi-tenant fleet's do.
    Buckets of 60 s: at ~3.4 requests/s a 10-s bucket is a handful of requests."""
    import numpy as np

    from kvtier.sim import replay
    from kvtier.sim.trace import load_trace

    trace = load_trace(path)
    block_elems = replay.DEFAULT_BLOCK_ELEMS
    unit = trace.block_tokens // block_elems
    spec = WorkloadSpec(n_requests=len(trace), n_tenants=n_tenants, token_unit=unit)
    blocks = replay.capacity_blocks(capacity, trace)
    fleet = replace(FleetSpec(), n_replicas=n_replicas)
    fleet = replace(fleet, dram_bytes=blocks * trace.block_tokens * fleet.kv_bytes_per_token)
    workload = replay.TraceWorkload(trace, spec, block_elems)
    conversation = np.array([int(a[1]) if a.size > 1 else 0 for a in trace.ids], dtype=np.int64)
    workload.tenant = (conversation * 2654435761 % 2**32 % n_tenants).astype(np.int32)
    workload.template_elems = np.zeros((n_tenants, 1), dtype=np.int64)
    start_s = float(workload.time_s[-1]) / 3
    rep = rollout(spec, fleet, start_s=start_s, gate_s=30.0, pod_s=30.0, block_tokens=trace.block_tokens,
                  bucket_s=bucket_s, progress=progress, warm_tokens=warm_tokens, name="rollout-trace",
                  workload=workload)
    rep.params.update({"trace": trace.source, "requests": len(trace), "replicas": n_replicas,
                       "tenants": f"{n_tenants}, each conversation given to one by its id",
                       "blocks_per_replica": blocks, "tokens_per_replica": blocks * trace.block_tokens})
    return rep


def default_thrash(n_requests: int = 40_000, progress: ProgressFactory | None = None, seed: int = 0) -> ScenarioReport:
    """4 replicas with 16 GiB each under the thrash workload."""
    return thrash(thrash_workload(n_requests, seed=seed), small_fleet(4, 16.0), progress=progress)


def default_compare(n_requests: int = 100_000, policies=COMPETITORS, progress: ProgressFactory | None = None,
                    seed: int = 0, cache: str = "kvtier") -> ScenarioReport:
    """16 replicas with 40 GiB each, the mixed workload (all four populations)."""
    return compare(mixed_workload(n_requests, unit=COARSE_UNIT, seed=seed), small_fleet(16, 40.0), policies,
                   cache=cache, progress=progress)


def default_capacity(n_requests: int = 50_000, policies=COMPETITORS, dram_gib=(5, 10, 20, 40, 80),
                     progress: ProgressFactory | None = None, seed: int = 0) -> ScenarioReport:
    return capacity(mixed_workload(n_requests, unit=COARSE_UNIT, seed=seed), small_fleet(16, 40.0), dram_gib,
                    policies, progress=progress)
