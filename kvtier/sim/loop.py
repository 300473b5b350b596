"""The event loop: route each request, serve it from a replica's cache, account it.

    for each request, in arrival order:
        fire due scenario events (join, leave, weights change)
        retire finished requests (frees HBM occupancy)
        replica = policy.route(request)          # sees queue, occupancy, caches
        matched = cache[replica].serve(request)  # lookup, release, store, apply
        fleet.serve(replica, prompt, matched)    # queue, TTFT, load
        record (replica, matched, prompt, TTFT)

Everything per request is recorded in numpy columns and summarised afterwards, so
the loop itself only does what a router and a cache would do.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvtier.admission import DEFAULT_MIN_SIGHTINGS
from kvtier.sim.caches import KvtierCache, LruCache, OracleCache, SimClock
from kvtier.sim.fleet import Fleet, FleetSpec
from kvtier.sim.routers import KvtierRouter, RootBook, make_router
from kvtier.sim.request import HashCache, SimRequest
from kvtier.sim.workload import Workload, WorkloadSpec, generate
from kvtier.warmup_plan import ASK_FLOOR_TOKENS as WARM_ASK_FLOOR_TOKENS
from kvtier.warmup_plan import OTHER_HOME_WEIGHT as WARM_OTHER_HOME_WEIGHT
from kvtier.warmup_plan import Planned as WarmPlanned  # noqa: F401 (the simulator's name)
from kvtier.warmup_plan import Prompt as WarmPrompt
from kvtier.warmup_plan import ask_tokens as warm_ask
from kvtier.warmup_plan import cut_to_shared as warm_cut
from kvtier.warmup_plan import keep_own as warm_keep_own
from kvtier.warmup_plan import plan as warm_plan
from kvtier.warmup_plan import rank as warm_rank  # noqa: F401 (the simulator's name)
from kvtier.warmup_plan import tenant_prompts as warm_tenant_prompts

CACHE_KINDS = ("kvtier", "lru")
# Requests between progress-bar updates: often enough to look alive, rare enough
# that tqdm costs nothing.
_PROGRESS_EVERY = 8192
# The operator's warm-up (operator/kvtier_operator/rollout_warmup_io.py): prefixes of
# a tenant are read from at most this many of its sources.
WARM_SOURCES_PER_TENANT = 2
# A restarted pod's first minute of traffic: its hit rate then is what the rollout
# history records per step.
FIRST_MINUTE_S = 60.0
# The operator's per-pod warm-up deadline (spec.rollout.warmup.timeout, default 2m):
# prompts not prefilled by then are not replayed.
WARM_TIMEOUT_S = 120.0
# The operator's warm-up from a leaver copies at most the policy's warmMaxBytes per
# tenant and home (`kvtier.policy.DEFAULT_WARM_MAX_BYTES`, 1Gi).
RESTART_WARM_MAX_BYTES = 1 << 30
# Where a warm-up reads its prompts: "own" (the operator: the restarted pod's own
# sidecar, read at a "snapshot" event before the restart, first; then the tenant's
# other homes) or "homes" (the operator before issue #24: the other homes only, kept
# as the bench's comparison row).
WARM_SOURCES = ("own", "homes")


class Progress(Protocol):
    """What the loop reports progress to (the `kvtier simulate` front-end draws a bar)."""

    def update(self, n: int) -> None: ...

    def close(self) -> None: ...


class _Silent:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


ProgressFactory = Callable[[int, str], Progress]
"""Builds a progress sink from (total requests, label). The simulator does no I/O: a
front-end that wants a bar passes one in `SimConfig.progress`."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One run: a workload, a fleet, a routing policy and a cache implementation.

    `block_tokens` is the cache block in real tokens; it must be a whole number of
    the workload's `token_unit`s. `warm_moved_tenants` makes a membership change
    warm each moved tenant's new homes from its old ones (what the operator does),
    and a "version" event that warms its pods before ready also warm their tenants'
    next homes from them before they restart (the operator's warm-up from a leaver:
    `_restart_warm_up`).
    `warm_before_ready_tokens` > 0 makes every pod a "version" event restarts do
    what the operator's rollout warm-up does (`operator/kvtier_operator/
    rollout_warmup.py`): for each tenant whose homes include the pod, the hottest
    prompts (`LocalCache.hot_prompts`: frequency x length) of the pod's own snapshot
    (`warm_source` "own": taken at a "snapshot" event, as the operator reads the pod's
    own sidecar before it moves the partition past it; `warmup_plan.keep_own`) and of
    its other homes, old version first, at most two sources in all, cut to shared
    prefixes, weighted and ranked (`warmup_plan.tenant_prompts`: own prompts at 1,
    others by the pod's rank in the tenant's homes: first home 1, others
    `WARM_OTHER_HOME_WEIGHT`), then all the tenants' prompts chosen greedily by weight
    x frequency x the tokens not already warmed, within the
    budget, replayed on the pod itself under the new
    version while a readiness gate holds it out of traffic; the gate opens when that
    prefill is done (its tenants' requests go to their other homes meanwhile). The
    budget is in prompt tokens, as the operator's `maxTokens`. 0: it comes up cold.
    A pod with no snapshot (no "snapshot" event before its restart) is warmed from its
    other homes alone, as the operator does when its snapshot is missing.
    `warm_source` "homes": the operator before the snapshot (other homes only).
    """

    workload: WorkloadSpec
    fleet: FleetSpec = field(default_factory=FleetSpec)
    policy: str = "kvtier"
    cache: str = "kvtier"
    block_tokens: int = 16
    min_sightings: int = DEFAULT_MIN_SIGHTINGS
    bucket_s: float = 30.0
    warm_moved_tenants: bool = True
    warm_before_ready_tokens: int = 0
    warm_source: str = "own"
    progress: ProgressFactory | None = None

    def __post_init__(self) -> None:
        if self.cache not in CACHE_KINDS:
            raise ValueError(f"cache must be one of {', '.join(CACHE_KINDS)}, got {self.cache!r}")
        unit = self.workload.token_unit
        if self.block_tokens < 1 or self.block_tokens % unit:
            raise ValueError(f"block_tokens ({self.block_tokens}) must be a positive multiple of "
                             f"token_unit ({unit})")
        if self.bucket_s <= 0:
            raise ValueError(f"bucket_s must be > 0, got {self.bucket_s}")
        if self.warm_source not in WARM_SOURCES:
            raise ValueError(f"warm_source must be one of {', '.join(WARM_SOURCES)}, got {self.warm_source!r}")
        if self.warm_before_ready_tokens < 0:
            raise ValueError(f"warm_before_ready_tokens must be >= 0, got {self.warm_before_ready_tokens}")

    @property
    def block_elems(self) -> int:
        return self.block_tokens // self.workload.token_unit


@dataclass(frozen=True, slots=True)
class Event:
    """A scenario event at `time_s`: "join" (one new replica), "leave" (`replicas`
    go), "version" (`replicas` restart onto weights `version`, cold), or "snapshot"
    (`replicas`' own hot lists are read and kept for their warm-up: the operator does
    it when it moves the partition past them, before they restart)."""

    time_s: float
    kind: str
    replicas: tuple[int, ...] = ()
    version: int = 0
    label: str = ""


@dataclass(slots=True)
class SimResult:
    """What one run measured. Token figures are real tokens."""

    label: str
    policy: str
    cache: str
    n_requests: int
    hit_rate: float
    request_hit_rate: float
    prompt_tokens: int
    matched_tokens: int
    prefill_replica_s: float
    load_imbalance: float
    load_s: list[float]
    ttft_p50_s: float
    ttft_p99_s: float
    spill_rate: float
    evictions: int
    wall_s: float
    cpu_s: float
    sim_s: float
    block_tokens: int
    token_unit: int
    bucket_s: float
    series_t_s: list[float]
    series_hit_rate: list[float]
    series_prefill_load: list[float]
    events: list[dict]
    series_prompt_tokens: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        """Everything but the per-bucket series and per-replica loads."""
        skip = {"series_t_s", "series_hit_rate", "series_prefill_load", "series_prompt_tokens", "load_s"}
        return {k: getattr(self, k) for k in self.__slots__ if k not in skip}

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


class Simulation:
    """Build the fleet, caches and policy for a `SimConfig`, then `run` it once."""

    def __init__(self, cfg: SimConfig, events: list[Event] | tuple[Event, ...] = (),
                 workload: Workload | None = None, label: str = "") -> None:
        self.cfg = cfg
        self.workload = workload if workload is not None else generate(cfg.workload)
        self.events = sorted(events, key=lambda e: e.time_s)
        self.label = label or f"{cfg.policy}/{cfg.cache}"
        self.now_s = 0.0
        self._now = SimClock()  # what the caches read: `now_s`, set with it
        self.fleet = Fleet(cfg.fleet)
        spec = cfg.workload
        self.roots = RootBook([f"tenant-{t:05d}" for t in range(spec.n_tenants)])
        self.policy = make_router(cfg.policy)
        if cfg.policy == "oracle":
            shared = OracleCache(cfg.block_elems)
            self.caches = [shared] * cfg.fleet.n_replicas
            self._new_cache = lambda: shared
        else:
            self.caches = [self._make_cache() for _ in range(cfg.fleet.n_replicas)]
            self._new_cache = self._make_cache
        self.policy.bind(self.fleet, self.caches, self.roots)
        self.policy.token_unit = spec.token_unit
        self.event_log: list[dict] = []
        # Pod -> its own hot prompts per tenant, from a "snapshot" event, until it restarts.
        self._snapshots: dict[int, dict[str, list]] = {}

    def _make_cache(self):
        cfg = self.cfg
        block_bytes = cfg.block_tokens * cfg.fleet.kv_bytes_per_token
        if cfg.cache == "lru":
            return LruCache(cfg.fleet.dram_bytes // block_bytes, cfg.block_elems)
        return KvtierCache(cfg.fleet.dram_bytes, block_bytes, cfg.block_elems, self._now, cfg.min_sightings)

    # ------------------------------------------------------------------ the loop

    def run(self) -> SimResult:
        cfg, w, fleet, policy, caches, roots = self.cfg, self.workload, self.fleet, self.policy, self.caches, self.roots
        unit = cfg.workload.token_unit
        n = len(w)
        times, tenants, sessions = w.time_s.tolist(), w.tenant.tolist(), w.session.tolist()
        outs = w.output_tokens.tolist()
        tpl_key = (w.tenant.astype(np.int64) * w.template_elems.shape[1] + w.template).tolist()
        tpl_elems = w.template_elems[w.tenant, w.template].tolist()
        prompt_tokens = w.prompt_tokens().tolist()
        names = roots.tenant_names
        build_tokens = w.token_builder()
        replica_col = np.empty(n, dtype=np.int32)
        matched_col = np.empty(n, dtype=np.int64)
        ttft_col = np.empty(n, dtype=np.float64)
        req = SimRequest(hash_cache=HashCache(cfg.block_elems))
        events = list(self.events)
        next_event_s = events[0].time_s if events else float("inf")
        version, clock = fleet.version, self._now
        bar = cfg.progress(n, self.label) if cfg.progress else _Silent()
        reported = 0
        collecting = gc.isenabled()
        # No reference cycles are made in the loop (an evicted node leaves its parent's
        # children; a request's objects die by reference count), only a restart's dropped
        # trees, collected once it ends: paused, the cycle collector does not rescan the
        # caches' growing trees at every full collection (~10% of the loop's time).
        gc.disable()
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            for i in range(n):
                now = times[i]
                self.now_s = clock.now = now
                if now >= next_event_s:
                    while events and events[0].time_s <= now:
                        self._fire(events.pop(0))
                    next_event_s = events[0].time_s if events else float("inf")
                fleet.advance(now)
                tenant = tenants[i]
                tokens = build_tokens(i)
                req.index, req.time_s, req.tenant, req.tenant_name = i, now, tenant, names[tenant]
                req.session, req.template_key, req.template_elems = sessions[i], tpl_key[i], tpl_elems[i]
                req.tokens, req.token_bytes = tokens, tokens.tobytes()
                req.prompt_tokens, req.output_tokens = prompt_tokens[i], outs[i]
                req._hashes.clear()
                r = policy.route(req, now)
                matched = caches[r].serve(req, roots.root(tenant, version[r]), now) * unit
                ttft_col[i] = fleet.serve(r, now, req.prompt_tokens, matched, outs[i])
                replica_col[i] = r
                matched_col[i] = matched
                policy.routed(req, r)
                if not (i + 1) % _PROGRESS_EVERY:
                    bar.update(_PROGRESS_EVERY)
                    reported += _PROGRESS_EVERY
        finally:
            if collecting:
                gc.enable()
        bar.update(n - reported)
        bar.close()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return self._result(np.asarray(prompt_tokens, dtype=np.int64), matched_col, replica_col, ttft_col, wall, cpu)

    # ------------------------------------------------------------------ scenario events

    def _fire(self, ev: Event) -> None:
        fleet = self.fleet
        entry = {"time_s": ev.time_s, "kind": ev.kind, "label": ev.label}
        if ev.kind == "join":
            r = fleet.join()
            self.caches.append(self._new_cache())
            entry["replicas"] = [r]
            self._membership_changed(entry)
        elif ev.kind == "leave":
            for r in ev.replicas:
                fleet.leave(r)
            entry["replicas"] = list(ev.replicas)
            self._membership_changed(entry)
        elif ev.kind == "snapshot":
            entry["replicas"] = list(ev.replicas)
            if self._warms() and self.cfg.warm_source == "own":
                for r in ev.replicas:
                    self._snapshots[r] = self._own_prompts(r)
        elif ev.kind == "version":
            # The pod restarts onto the new weights, and its sidecar with it: an
            # empty DRAM tier (old-version blocks could never hit again anyway).
            warm = self._warms()
            entry["replicas"] = list(ev.replicas)
            entry["version"] = ev.version
            # Each snapshot is used by the one restart it was taken for.
            own = {r: self._snapshots.pop(r) for r in ev.replicas if r in self._snapshots}
            self._restart_warm_up(entry, ev.replicas)
            for r in ev.replicas:
                fleet.version[r] = ev.version
                self.caches[r].drop_all()
            entry["ready_s"] = {r: ev.time_s for r in ev.replicas}
            if warm:
                entry["warmed_tokens"] = entry["warmed_prompt_tokens"] = entry["warmed_tenants"] = 0
                entry["warmed_prompts"] = 0
                entry["snapshots"] = len(own)
                for r in ev.replicas:
                    prefilled, prompt_tokens, tenants, prompts = self._warm_before_ready(
                        r, ev.version, ev.time_s, own.get(r))
                    entry["warmed_prompts"] += prompts
                    entry["warmed_tokens"] += prefilled
                    entry["warmed_prompt_tokens"] += prompt_tokens
                    entry["warmed_tenants"] += tenants
                    # The gate opens once the pod's engine has prefilled the warm-up.
                    ready = fleet.prefill_only(r, ev.time_s, prefilled)
                    fleet.gate(r, ready)
                    entry["ready_s"][r] = ready
        else:
            raise ValueError(f"unknown scenario event {ev.kind!r}")
        self.event_log.append(entry)

    def _membership_changed(self, entry: dict) -> None:
        plan = self.policy.membership_changed()
        if plan is None:
            return
        entry["moved_tenants"] = len(plan.moves)
        entry["movement_fraction"] = plan.movement_fraction
        entry["epoch"] = plan.table.epoch
        entry["warmed_blocks"] = 0
        if not (self.cfg.warm_moved_tenants and self.cfg.cache == "kvtier"):
            return
        index = {name: i for i, name in enumerate(self.fleet.names)}
        warmed = 0
        budget = self.cfg.fleet.dram_bytes
        for move in plan.moves:
            sources = [index[m] for m in move.old_homes if m in index]
            # `pick` sends a cool tenant to its FIRST home, so the new first home must be
            # warm too, even when it was already a (lower-ranked, hence cold) home.
            targets = list(move.gained)
            if move.new_homes and move.new_homes[0] != move.old_homes[0] and move.new_homes[0] not in targets:
                targets.append(move.new_homes[0])
            for target in targets:
                for src in sources:
                    if src != index[target]:
                        warmed += self.caches[index[target]].warm_from(self.caches[src], move.tenant, budget)
        entry["warmed_blocks"] = warmed

    def _restart_warm_up(self, entry: dict, restarted: list[int]) -> None:
        """What the operator does when a rollout deletes pods to restart them: each
        one's sidecar answers while its engine shuts down, so it is a LEAVER
        (`kvtier_operator.membership`), and before the epoch without it the operator
        warms its tenants' new homes — the home each one gains, and the surviving home
        promoted to first — from it (`kvtier_operator.warmup.plan`: a leaver first). The
        table here keeps the pods (a StatefulSet brings each back under its name): while
        one restarts and its gate holds it, `pick` reads it as full and sends its
        tenants on along their order, to those same homes. Peer copies, no prefill,
        at most the policy's default `warmMaxBytes` per tenant and home, as the operator
        asks. Only where the pods are held out of traffic (warmed before ready): a cold
        restart here serves again at once, so copies for it would serve nobody."""
        entry["restart_warmed_blocks"] = 0
        if not (self.cfg.warm_moved_tenants and self._warms()):
            return
        fleet, table = self.fleet, self.policy.table
        index = {name: i for i, name in enumerate(fleet.names) if fleet.alive[i]}
        gone = {fleet.names[r] for r in restarted}
        budget = RESTART_WARM_MAX_BYTES
        warmed = 0
        for tenant in self.roots.tenant_names:
            old = table.homes_for(tenant)
            leavers = [m for m in old if m in gone]
            if not leavers:
                continue
            order = [m for m in table.order_for(tenant) if m not in gone and m in index]
            new = order[:table.homes]
            targets = [m for m in new if m not in old]
            if new and new[0] != old[0] and new[0] not in targets:
                targets.append(new[0])
            source = self.caches[index[leavers[0]]]
            for target in targets:
                warmed += self.caches[index[target]].warm_from(source, tenant, budget)
        entry["restart_warmed_blocks"] = warmed

    def _warms(self) -> bool:
        return bool(self.cfg.warm_before_ready_tokens and self.cfg.cache == "kvtier" and hasattr(self.policy, "table"))

    def _tenants_of(self, r: int) -> list[str]:
        """The tenants whose homes include pod r."""
        table, me = self.policy.table, self.fleet.names[r]
        return [t for t in self.roots.tenant_names if me in table.homes_for(t)]

    def _own_prompts(self, r: int) -> dict[str, list]:
        """Pod r's own hot prompts per tenant, read before it restarts and kept as the
        operator keeps them (`warmup_plan.keep_own`)."""
        tenants = self._tenants_of(r)
        unit = self.cfg.workload.token_unit
        budget = self.cfg.warm_before_ready_tokens // unit
        ask = warm_ask(budget, len(tenants), WARM_ASK_FLOOR_TOKENS // unit)
        answers = {t: [WarmPrompt(tuple(tokens.tolist()), freq)
                       for _, tokens, freq in self.caches[r].cache.hot_prompts(t, ask)] for t in tenants}
        return warm_keep_own({t: a for t, a in answers.items() if a}, budget, self.cfg.block_elems)

    def _warm_before_ready(self, r: int, version: int, now_s: float,
                           own: dict[str, list] | None = None) -> tuple[int, int, int]:
        """Warm pod r (just restarted onto `version`) as the operator does; returns
        (tokens actually prefilled, prompt tokens charged to the budget as the operator
        counts them — a prefix shared with a prompt of the tenant replayed before is not
        counted again —, tenants warmed, prompts replayed), in real tokens. The two differ by the partial
        block of a shared prefix, which the engine computes again.

        Tenants: those whose homes include the pod. Sources of a tenant: the pod's own
        snapshot (`own`, taken before the restart) where it holds the tenant, then its
        homes on the old version in rendezvous order, then its homes already on the new
        one (the last old pod of a fleet has no old peer left), never the pod's
        restarted sidecar, at most `WARM_SOURCES_PER_TENANT` in all; each is asked
        for `warm_ask` tokens. The answers are cut, weighted, ranked and planned across
        the pod's tenants exactly as `warmup_plan.tenant_prompts` / `plan` do in the
        operator, and replayed under the new
        version's key root; a prompt whose blocks the pod already holds costs only the
        blocks it lacks (the engine's prefix cache)."""
        cfg, fleet, unit = self.cfg, self.fleet, self.cfg.workload.token_unit
        table = self.policy.table
        index = {n: i for i, n in enumerate(fleet.names)}
        tenants = self._tenants_of(r)
        budget = cfg.warm_before_ready_tokens // unit  # in token elements
        ask = warm_ask(budget, len(tenants), WARM_ASK_FLOOR_TOKENS // unit)
        me = fleet.names[r]
        ranked: dict[str, tuple[float, list[WarmPrompt]]] = {}
        for tenant in tenants:
            homes = [index[m] for m in table.homes_for(tenant) if m in index and index[m] != r and fleet.alive[index[m]]]
            old = [h for h in homes if fleet.version[h] != version]
            new = [h for h in homes if fleet.version[h] == version]
            sources = old + new
            mine = own.get(tenant) if own is not None else None
            others = [[WarmPrompt(tuple(tokens.tolist()), freq)
                       for _, tokens, freq in self.caches[src].cache.hot_prompts(tenant, ask)]
                      for src in sources[:WARM_SOURCES_PER_TENANT - (mine is not None)]]
            weight = 1.0 if table.homes_for(tenant)[:1] == [me] else WARM_OTHER_HOME_WEIGHT
            ranked[tenant] = (1.0, warm_tenant_prompts(mine, others, weight, cfg.block_elems))
        tenant_index = {t: i for i, t in enumerate(self.roots.tenant_names)}
        cache, prefilled, replayed, warmed, prompts = self.caches[r].cache, 0, 0, set(), 0
        deadline_elems = WARM_TIMEOUT_S * fleet.spec.prefill_tokens_per_s / unit
        for item in warm_plan(ranked, budget, cfg.block_elems):
            tenant, prompt = item.tenant, item.prompt
            if prefilled >= deadline_elems:
                break  # out of time: the gate opens with the rest not warmed (WarmupTimedOut)
            tokens = np.asarray(prompt.tokens, dtype=np.int64)
            res = cache.reserve(self.roots.root(tenant_index[tenant], version), tokens, force=True)
            replayed += item.new_tokens  # what the operator charges its budget
            prompts += 1
            warmed.add(tenant)
            # The engine computes what its prefix cache lacks (whole blocks it holds
            # are found; the rest, the partial tail included, is prefilled).
            held = res.first_block * cfg.block_elems if res is not None else cache.peek(
                self.roots.root(tenant_index[tenant], version), tokens, allow_full=True)
            prefilled += len(tokens) - held
            if res is not None:
                cache.commit(res)
        return prefilled * unit, replayed * unit, len(warmed), prompts

    # ------------------------------------------------------------------ summary

    def _first_minutes(self, t, prompt, matched, replica) -> None:
        """Each restarted pod's token hit rate over its first `FIRST_MINUTE_S` of
        traffic from when it turned ready (what the rollout history records per step),
        into its version event's entry: {replica: hit rate} (None: no traffic)."""
        for entry in self.event_log:
            if entry["kind"] != "version":
                continue
            rates = {}
            for r, ready in entry["ready_s"].items():
                lo, hi = np.searchsorted(t, [ready, ready + FIRST_MINUTE_S])
                sel = replica[lo:hi] == r
                p = prompt[lo:hi][sel].sum()
                rates[r] = float(matched[lo:hi][sel].sum() / p) if p else None
            entry["first_minute_hit_rate"] = rates

    def _result(self, prompt, matched, replica, ttft, wall, cpu) -> SimResult:
        cfg, fleet, w = self.cfg, self.fleet, self.workload
        n = len(prompt)
        tps = cfg.fleet.prefill_tokens_per_s
        present = [r for r in range(cfg.fleet.n_replicas) if fleet.alive[r]]
        loads = np.array([fleet.load_s[r] for r in present]) if present else np.zeros(1)
        t = w.time_s
        bucket = np.floor(t / cfg.bucket_s).astype(np.int64)
        nb = int(bucket.max()) + 1 if n else 0
        b_prompt = np.bincount(bucket, weights=prompt, minlength=nb)
        b_matched = np.bincount(bucket, weights=matched, minlength=nb)
        with np.errstate(invalid="ignore", divide="ignore"):
            series_hit = np.where(b_prompt > 0, b_matched / b_prompt, 0.0)
        # Prefill load: replica-seconds of prefill per second, i.e. replicas' worth.
        series_load = (b_prompt - b_matched) / tps / cfg.bucket_s
        self._first_minutes(t, prompt, matched, replica)
        spilled = getattr(self.policy, "spilled", 0)
        evictions = sum(c.evictions() if hasattr(c, "evictions") else getattr(c, "evicted_blocks", 0)
                        for c in {id(c): c for c in self.caches}.values())
        return SimResult(
            label=self.label, policy=cfg.policy, cache=cfg.cache, n_requests=n,
            hit_rate=float(matched.sum() / prompt.sum()) if n else 0.0,
            request_hit_rate=float((matched > 0).mean()) if n else 0.0,
            prompt_tokens=int(prompt.sum()), matched_tokens=int(matched.sum()),
            prefill_replica_s=float((prompt - matched).sum() / tps),
            load_imbalance=float(loads.max() / loads.mean()) if loads.mean() > 0 else 1.0,
            load_s=[float(x) for x in loads],
            ttft_p50_s=float(np.percentile(ttft, 50)) if n else 0.0,
            ttft_p99_s=float(np.percentile(ttft, 99)) if n else 0.0,
            spill_rate=spilled / n if n and isinstance(self.policy, KvtierRouter) else 0.0,
            evictions=int(evictions), wall_s=wall, cpu_s=cpu, sim_s=float(t[-1]) if n else 0.0,
            block_tokens=cfg.block_tokens, token_unit=cfg.workload.token_unit, bucket_s=cfg.bucket_s,
            series_t_s=[float(x) for x in np.arange(nb) * cfg.bucket_s],
            series_hit_rate=[float(x) for x in series_hit],
            series_prefill_load=[float(x) for x in series_load],
            events=self.event_log,
            series_prompt_tokens=[float(x) for x in b_prompt],
        )


# ---------------------------------------------------------------------- the operator's warm-up plan
# `kvtier.warmup_plan`, the one the operator runs, under the simulator's names.

def warm_trim_shared(answers, block: int) -> list[list[WarmPrompt]]:
    """`warmup_plan.cut_to_shared` (the simulator's former name for it)."""
    return warm_cut(answers, block)


def simulate(cfg: SimConfig, events=(), workload: Workload | None = None, label: str = "") -> SimResult:
    """Run one configuration and return what it measured."""
    return Simulation(cfg, events, workload, label).run()
