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

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvtier.admission import DEFAULT_MIN_SIGHTINGS
from kvtier.sim.caches import KvtierCache, LruCache, OracleCache
from kvtier.sim.fleet import Fleet, FleetSpec
from kvtier.sim.policies import KvtierPolicy, RootBook, make_policy
from kvtier.sim.request import HashCache, SimRequest
from kvtier.sim.workload import Workload, WorkloadSpec, generate

CACHE_KINDS = ("kvtier", "lru")
# Requests between progress-bar updates: often enough to look alive, rare enough
# that tqdm costs nothing.
_PROGRESS_EVERY = 8192


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
    warm each moved tenant's new homes from its old ones (what the operator does).
    `warm_before_ready_tokens` > 0 makes every pod a "version" event restarts
    prefill up to that many tokens of its tenants' hottest prefixes, taken from the
    tenants' other homes, under the new version before it takes traffic (the
    operator's readiness gate); the prefill runs on the pod itself. 0: it comes up
    cold.
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
        if self.warm_before_ready_tokens < 0:
            raise ValueError(f"warm_before_ready_tokens must be >= 0, got {self.warm_before_ready_tokens}")

    @property
    def block_elems(self) -> int:
        return self.block_tokens // self.workload.token_unit


@dataclass(frozen=True, slots=True)
class Event:
    """A scenario event at `time_s`: "join" (one new replica), "leave" (`replicas`
    go), or "version" (`replicas` restart onto weights `version`, cold)."""

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

    def summary(self) -> dict:
        """Everything but the per-bucket series and per-replica loads."""
        skip = {"series_t_s", "series_hit_rate", "series_prefill_load", "load_s"}
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
        self.fleet = Fleet(cfg.fleet)
        spec = cfg.workload
        self.roots = RootBook([f"tenant-{t:05d}" for t in range(spec.n_tenants)])
        self.policy = make_policy(cfg.policy)
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

    def _make_cache(self):
        cfg = self.cfg
        block_bytes = cfg.block_tokens * cfg.fleet.kv_bytes_per_token
        if cfg.cache == "lru":
            return LruCache(cfg.fleet.dram_bytes // block_bytes, cfg.block_elems)
        return KvtierCache(cfg.fleet.dram_bytes, block_bytes, cfg.block_elems, self._clock, cfg.min_sightings)

    def _clock(self) -> float:
        return self.now_s

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
        version = fleet.version
        bar = cfg.progress(n, self.label) if cfg.progress else _Silent()
        reported = 0
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(n):
            now = times[i]
            self.now_s = now
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
        elif ev.kind == "version":
            # The pod restarts onto the new weights, and its sidecar with it: an
            # empty DRAM tier (old-version blocks could never hit again anyway).
            warm = self.cfg.warm_before_ready_tokens and self.cfg.cache == "kvtier" and hasattr(self.policy, "table")
            # What the operator reads from each pod's sidecar before it restarts it.
            own = {r: self._hot_prefixes(r) for r in ev.replicas} if warm else {}
            for r in ev.replicas:
                fleet.version[r] = ev.version
                self.caches[r].drop_all()
            entry["replicas"] = list(ev.replicas)
            entry["version"] = ev.version
            if warm:
                entry["warmed_tokens"] = sum(self._warm_before_ready(r, ev.version, ev.time_s, own[r])
                                             for r in ev.replicas)
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

    def _hot_prefixes(self, r: int) -> dict[str, list]:
        """Pod r's hottest prefixes (key root, element ids) of each tenant it is home to."""
        name, table, cache = self.fleet.names[r], self.policy.table, self.caches[r].cache
        return {t: cache.hottest_prefixes(t, self.cfg.fleet.dram_bytes)
                for t in self.roots.tenant_names if name in table.homes_for(t)}

    def _warm_before_ready(self, r: int, version: int, now_s: float, own: dict[str, list]) -> int:
        """Prefill pod r's tenants' hottest prefixes under `version` before it takes
        traffic, up to the budget; returns the tokens prefilled.

        The prefixes come first from what the pod itself held before it restarted
        (`own`: the traffic it will get again), then from the tenants' other live
        homes. Each source goes in rounds — every tenant's hottest prefix, then every
        tenant's second — so no tenant takes the whole budget. The budget never
        exceeds what the pod's DRAM tier holds (a later prefix would evict an earlier,
        hotter one), and the prefill queues on the pod like a request's."""
        cfg, fleet, unit = self.cfg, self.fleet, self.cfg.workload.token_unit
        index = {n: i for i, n in enumerate(fleet.names)}
        others: dict[str, list] = {}
        for tenant in own:
            for home in self.policy.table.homes_for(tenant):
                src = index.get(home)
                if src is not None and src != r and fleet.alive[src]:
                    others.setdefault(tenant, []).extend(
                        self.caches[src].cache.hottest_prefixes(tenant, cfg.fleet.dram_bytes))
        capacity_elems = cfg.fleet.dram_bytes // (cfg.block_tokens * cfg.fleet.kv_bytes_per_token) * cfg.block_elems
        budget = min(cfg.warm_before_ready_tokens // unit, capacity_elems)
        tenant_index = {t: i for i, t in enumerate(self.roots.tenant_names)}
        cache, spent = self.caches[r].cache, 0
        for source in (own, others):
            for rank in range(max((len(p) for p in source.values()), default=0)):
                for tenant, prefixes in source.items():
                    if rank >= len(prefixes) or spent >= budget:
                        continue
                    tokens = prefixes[rank][1][: budget - spent]
                    res = cache.reserve(self.roots.root(tenant_index[tenant], version), tokens, force=True)
                    if res is not None:  # prefill runs from the pod's own cached prefix on
                        spent += len(tokens) - res.first_block * cfg.block_elems
                        cache.commit(res)
        fleet.prefill_only(r, now_s, spent * unit)
        return spent * unit

    # ------------------------------------------------------------------ summary

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
            spill_rate=spilled / n if n and isinstance(self.policy, KvtierPolicy) else 0.0,
            evictions=int(evictions), wall_s=wall, cpu_s=cpu, sim_s=float(t[-1]) if n else 0.0,
            block_tokens=cfg.block_tokens, token_unit=cfg.workload.token_unit, bucket_s=cfg.bucket_s,
            series_t_s=[float(x) for x in np.arange(nb) * cfg.bucket_s],
            series_hit_rate=[float(x) for x in series_hit],
            series_prefill_load=[float(x) for x in series_load],
            events=self.event_log,
        )


def simulate(cfg: SimConfig, events=(), workload: Workload | None = None, label: str = "") -> SimResult:
    """Run one configuration and return what it measured."""
    return Simulation(cfg, events, workload, label).run()
