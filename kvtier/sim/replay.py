"""Trace replay: a recorded request stream through one cache, or through a fleet.

Single-cache mode replays the trace, in arrival order, through one cache per
(policy, capacity) pair and reports the token hit rate (matched prompt tokens /
prompt tokens, with at least one token always computed):

- `kvtier`     the real `LocalCache`, metadata-only (the shipped policy), and its
               ablations (`kvtier-*`, one part of the policy switched off each);
- `lru`        plain LRU over the same blocks (what every engine ships);
- `belady`     the offline reference: evict the block whose next use is farthest
               away (ties: deepest first, so prefixes stay whole);
- `infinite`   unlimited capacity: every block seen before is a hit.

Fleet mode routes the trace's arrivals across N replicas under each routing policy
of the fleet simulator, with kvtier's `LocalCache` on every replica.
"""
from __future__ import annotations

import heapq
import multiprocessing
import re
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvtier.eviction import EvictionConfig
from kvtier.keys import KeyRoot
from kvtier.sim.caches import KvtierCache, LruCache, OracleCache, _hit_blocks
from kvtier.sim.fleet import FleetSpec
from kvtier.sim.loop import SimConfig, simulate
from kvtier.sim.trace import DEFAULT_BLOCK_ELEMS, Trace, TraceError, TracePrompts
from kvtier.sim.tuners import CAFFEINE_WINDOW_FRACTION
from kvtier.sim.workload import WorkloadSpec

if TYPE_CHECKING:
    from kvtier.sim.loop import ProgressFactory

ROOT = KeyRoot("trace", "model", "weights", "fp16", "rope", "attn")
"""Every request of a trace shares one key root: one model, one tenant."""

KVTIER_VARIANTS: dict[str, EvictionConfig] = {
    "kvtier": EvictionConfig(),
    "kvtier-lru-steering": EvictionConfig(adapt="shadow"),
    "kvtier-hill-climb": EvictionConfig(window_fraction=CAFFEINE_WINDOW_FRACTION, adapt="climb"),
    "kvtier-fixed-window": EvictionConfig(window_fraction=CAFFEINE_WINDOW_FRACTION, adapt="off"),
    "kvtier-symmetric-shadow": EvictionConfig(window_fraction=CAFFEINE_WINDOW_FRACTION, adapt="symmetric"),
    "kvtier-window-50": EvictionConfig(window_fraction=0.5, adapt="off"),
    "kvtier-window-75": EvictionConfig(window_fraction=0.75, adapt="off"),
    "kvtier-lru-window": EvictionConfig(window_fraction=1.0, adapt="off"),
    "kvtier-arc-window": EvictionConfig(window_fraction=CAFFEINE_WINDOW_FRACTION, adapt="ghost"),
    "kvtier-no-window": EvictionConfig(window_fraction=0.0, adapt="off"),
    "kvtier-no-doorkeeper": EvictionConfig(doorkeeper=False),
    "kvtier-no-duel": EvictionConfig(duel=False),
}
"""The shipped policy and, for the ablation, each part of it switched off or replaced;
lru-steering is the window steered against a same-size shadow LRU (from the whole
cache, one step down while ahead, two up while behind); hill-climb and fixed-window
start at Caffeine's 1% window; symmetric-shadow is the shadow-LRU steering's earlier
form (from 1%, one step either way, holding when level); the
window-50/75 variants hold the window at half / three quarters of the cache with no
tuner (what a tuner could find), lru-window at the whole cache (it must equal
plain LRU); arc-window starts at 1% and moves the window by ARC's ghost lists
instead of the miniature simulations."""

BASELINES = ("lru", "belady", "infinite")
SINGLE_POLICIES = tuple(KVTIER_VARIANTS) + BASELINES
DEFAULT_SINGLE_POLICIES = ("kvtier", "lru", "belady", "infinite")
DEFAULT_CAPACITIES = ("0.01", "3M", "0.05", "0.1", "0.25", "0.5")
"""Shares of the trace's unique blocks, or token counts (k/M/G suffixes)."""

_NEVER = np.iinfo(np.int64).max


@dataclass(slots=True)
class ReplayPoint:
    """One replay: a policy at a capacity."""

    policy: str
    capacity_blocks: int
    capacity_tokens: int
    capacity_fraction: float
    hit_rate: float
    request_hit_rate: float
    matched_tokens: int
    prompt_tokens: int
    evictions: int
    wall_s: float
    cpu_s: float
    n_requests: int

    @property
    def requests_per_s(self) -> float:
        return 0.0 if self.wall_s <= 0 else self.n_requests / self.wall_s

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__slots__}
        d["requests_per_s"] = self.requests_per_s
        return d


@dataclass(slots=True)
class TraceReport:
    """A capacity sweep of one trace: every (policy, capacity) point, plus figures."""

    name: str
    params: dict
    points: list[ReplayPoint] = field(default_factory=list)
    figures: list = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def point(self, policy: str, capacity_blocks: int) -> ReplayPoint:
        return next(p for p in self.points if p.policy == policy and p.capacity_blocks == capacity_blocks)

    def as_dict(self, series: bool = True) -> dict:
        return {"name": self.name, "params": self.params, "points": [p.as_dict() for p in self.points],
                "figures": [{"name": f.name, "value": f.value, "target": f.target, "passed": f.passed,
                             "baseline": f.baseline, "unit": f.unit} for f in self.figures],
                "notes": self.notes}


# ---------------------------------------------------------------------- capacities

_TOKENS = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([kKMG])$|^([0-9]+)$")
_SUFFIX = {"k": 1_000, "K": 1_000, "M": 1_000_000, "G": 1_000_000_000}


def capacity_blocks(spec: str, trace: Trace) -> int:
    """A capacity given as a share of the distinct blocks ("0.05", "5%") or as tokens
    ("3M", "250000"), in blocks. TraceError when malformed or under one block."""
    text = spec.strip()
    hint = (f"capacity {spec!r}: give a share of the distinct blocks in (0, 1] (0.05 or 5%) "
            f"or a token count of at least one block ({trace.block_tokens}; 3M, 250000)")
    m = _TOKENS.match(text)
    if m and (m.group(2) or int(m.group(3)) > 1):
        tokens = float(m.group(1)) * _SUFFIX[m.group(2)] if m.group(2) else int(m.group(3))
        if tokens < trace.block_tokens:
            raise TraceError(hint)
        return int(tokens) // trace.block_tokens
    try:
        share = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise TraceError(hint) from None
    if not 0 < share <= 1:
        raise TraceError(hint)
    return max(1, round(share * trace.unique_blocks()))


# ---------------------------------------------------------------------- requests

class _Request:
    """What the caches read of one trace request: its elements and its block ids."""

    __slots__ = ("tokens", "ids", "next_use")

    def __init__(self, tokens: np.ndarray, ids: list[int], next_use: list[int]) -> None:
        self.tokens, self.ids, self.next_use = tokens, ids, next_use

    def hashes(self, root: KeyRoot) -> list[int]:
        """Block identities: the trace's chained ids stand in for chained hashes."""
        return self.ids


def prepare(trace: Trace, block_elems: int = DEFAULT_BLOCK_ELEMS) -> list[_Request]:
    """Every request's elements, ids and each block's next use (request index)."""
    prompts = TracePrompts(trace, block_elems)
    lengths = np.asarray([len(a) for a in trace.ids], dtype=np.int64)
    flat = np.concatenate(trace.ids) if trace.ids else np.zeros(0, dtype=np.int64)
    owner = np.repeat(np.arange(len(trace)), lengths)
    order = np.lexsort((owner, flat))
    nxt = np.full(len(flat), _NEVER, dtype=np.int64)
    same = flat[order][1:] == flat[order][:-1]
    nxt[order[:-1][same]] = owner[order][1:][same]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    ids, nexts = flat.tolist(), nxt.tolist()
    return [_Request(prompts.tokens(i), ids[bounds[i]:bounds[i + 1]], nexts[bounds[i]:bounds[i + 1]])
            for i in range(len(trace))]


# ---------------------------------------------------------------------- Belady

class BeladyCache:
    """Offline reference over blocks: on overflow, evict the block whose next use is
    farthest away (never used again first); among equals the deepest block goes,
    so an ancestor never leaves before its descendants. Knows the future, so it is
    a bound to read kvtier against, not a policy."""

    def __init__(self, capacity_blocks: int, block_size: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._next: dict[int, int] = {}
        self._heap: list[tuple[int, int, int]] = []
        self.evicted_blocks = 0

    def serve(self, req: _Request, root: KeyRoot, now_s: float) -> int:
        cached = self._next
        m = 0
        for h in req.ids:
            if h not in cached:
                break
            m += 1
        matched = _hit_blocks(m, len(req.tokens), self.block_size) * self.block_size
        heap = self._heap
        for depth, (h, nu) in enumerate(zip(req.ids, req.next_use)):
            cached[h] = nu
            heapq.heappush(heap, (-nu, -depth, h))
        while len(cached) > self.capacity_blocks:
            neg_nu, _, h = heapq.heappop(heap)
            if cached.get(h) == -neg_nu:
                del cached[h]
                self.evicted_blocks += 1
        return matched


# ---------------------------------------------------------------------- single cache

class _Clock:
    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_cache(policy: str, blocks: int, block_elems: int, clock: _Clock):
    """One replica cache for a single-cache replay (metadata only for kvtier)."""
    if policy in KVTIER_VARIANTS:
        return KvtierCache(blocks * block_elems, block_elems, block_elems, clock, policy=KVTIER_VARIANTS[policy])
    if policy == "lru":
        return LruCache(blocks, block_elems)
    if policy == "belady":
        return BeladyCache(blocks, block_elems)
    if policy == "infinite":
        return OracleCache(block_elems)
    raise TraceError(f"unknown policy {policy!r}; choose from {', '.join(SINGLE_POLICIES)}")


def replay_single(trace: Trace, requests: list[_Request], policy: str, blocks: int,
                  block_elems: int = DEFAULT_BLOCK_ELEMS) -> ReplayPoint:
    """Replay the whole trace through one cache of `blocks` blocks."""
    clock = _Clock()
    cache = make_cache(policy, blocks, block_elems, clock)
    times = trace.time_s.tolist()
    matched = np.zeros(len(trace), dtype=np.int64)
    serve = cache.serve
    t0, c0 = time.perf_counter(), time.process_time()
    for i, req in enumerate(requests):
        clock.now = times[i]
        matched[i] = serve(req, ROOT, times[i])
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    matched_tokens = (matched // block_elems) * trace.block_tokens
    prompt = trace.prompt_tokens
    evictions = cache.evictions() if hasattr(cache, "evictions") else getattr(cache, "evicted_blocks", 0)
    unique = trace.unique_blocks()
    return ReplayPoint(policy=policy, capacity_blocks=blocks, capacity_tokens=blocks * trace.block_tokens,
                       capacity_fraction=blocks / unique if unique else 0.0,
                       hit_rate=float(matched_tokens.sum() / prompt) if prompt else 0.0,
                       request_hit_rate=float((matched > 0).mean()), matched_tokens=int(matched_tokens.sum()),
                       prompt_tokens=prompt, evictions=int(evictions), wall_s=wall, cpu_s=cpu,
                       n_requests=len(trace))


def sweep(trace: Trace, capacities: list[int], policies=DEFAULT_SINGLE_POLICIES,
          block_elems: int = DEFAULT_BLOCK_ELEMS, name: str = "trace", jobs: int = 1) -> TraceReport:
    """Every policy at every capacity (infinite once: it has no capacity), each replay
    in one of `jobs` worker processes. Each replay is deterministic and independent
    of the others, so the report is the same whatever `jobs` is (only times move)."""
    requests = prepare(trace, block_elems)
    rep = TraceReport(name, _params(trace, block_elems, capacities))
    tasks = [(p, blocks) for blocks in capacities for p in policies
             if p != "infinite" or blocks == capacities[0]]
    rep.points.extend(_replay_all(trace, requests, tasks, block_elems, jobs))
    _figures(rep, capacities)
    return rep


_SHARED: tuple[Trace, list[_Request], int] | None = None
"""The sweep's trace for its forked workers: inherited at fork, never pickled."""


def _replay_all(trace: Trace, requests: list[_Request], tasks: list[tuple[str, int]], block_elems: int,
                jobs: int) -> list[ReplayPoint]:
    """`replay_single` for every (policy, blocks), in order: in this process, or with
    jobs > 1 in that many forked workers (where the platform forks)."""
    global _SHARED
    workers = min(jobs, len(tasks))
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [replay_single(trace, requests, p, blocks, block_elems) for p, blocks in tasks]
    _SHARED = (trace, requests, block_elems)
    # Largest capacity first (a bigger cache replays slower): the short replays fill in
    # at the end, so no worker is left with a long one while the other idles.
    order = sorted(range(len(tasks)), key=lambda i: -tasks[i][1])
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            done = dict(zip(order, pool.map(_replay_task, [tasks[i] for i in order])))
    finally:
        _SHARED = None
    return [done[i] for i in range(len(tasks))]


def _replay_task(task: tuple[str, int]) -> ReplayPoint:
    assert _SHARED is not None, "a sweep worker runs only in a process forked by _replay_all"
    trace, requests, block_elems = _SHARED
    policy, blocks = task
    return replay_single(trace, requests, policy, blocks, block_elems)


def _params(trace: Trace, block_elems: int, capacities: list[int]) -> dict:
    return {"trace": trace.source, "requests": len(trace), "prompt_tokens": trace.prompt_tokens,
            "unique_blocks": trace.unique_blocks(), "tokens_per_hash_id": trace.block_tokens,
            "elements_per_block": block_elems, "capacities_blocks": list(capacities),
            "span_s": float(trace.time_s[-1] - trace.time_s[0]) if len(trace) else 0.0}


def _figures(rep: TraceReport, capacities: list[int]) -> None:
    from kvtier.sim.scenarios import Figure

    by = {(p.policy, p.capacity_blocks): p for p in rep.points}
    for blocks in capacities:
        k, lru = by.get(("kvtier", blocks)), by.get(("lru", blocks))
        if k is None or lru is None:
            continue
        rep.figures.append(Figure(f"kvtier / LRU at {blocks:,} blocks ({k.capacity_fraction:.1%})",
                                  k.hit_rate / lru.hit_rate if lru.hit_rate else float("inf"), target=1.0,
                                  baseline=lru.hit_rate, baseline_name="LRU hit rate", unit="x"))


# ---------------------------------------------------------------------- fleet

def fleet(trace: Trace, replicas: int, blocks_per_replica: int, policies, block_elems: int = DEFAULT_BLOCK_ELEMS,
          progress: ProgressFactory | None = None):
    """The trace's arrivals across `replicas` replicas under each routing policy,
    kvtier's LocalCache on every replica; a `ScenarioReport`."""
    from dataclasses import replace

    from kvtier.sim.scenarios import ScenarioReport

    if trace.block_tokens % block_elems:
        raise TraceError(f"fleet mode needs tokens per hash id ({trace.block_tokens}) to be a multiple of "
                         f"the elements per block ({block_elems})")
    unit = trace.block_tokens // block_elems
    spec = WorkloadSpec(n_requests=len(trace), n_tenants=1, token_unit=unit)
    fleet_spec = replace(FleetSpec(), n_replicas=replicas)
    fleet_spec = replace(fleet_spec, dram_bytes=blocks_per_replica * trace.block_tokens * fleet_spec.kv_bytes_per_token)
    workload = TraceWorkload(trace, spec, block_elems)
    rep = ScenarioReport("trace-fleet", f"{trace.source or 'trace'} across {replicas} replicas",
                         params={"trace": trace.source, "requests": len(trace), "replicas": replicas,
                                 "blocks_per_replica": blocks_per_replica,
                                 "tokens_per_replica": blocks_per_replica * trace.block_tokens,
                                 "granularity": f"one hash id = one {block_elems}-element block of "
                                                f"{trace.block_tokens} tokens"})
    for p in policies:
        cfg = SimConfig(spec, fleet_spec, policy=p, block_tokens=trace.block_tokens, progress=progress)
        rep.results.append(simulate(cfg, workload=workload, label=p))
    return rep


class TraceWorkload:
    """A trace dressed as the fleet simulator's `Workload`: one tenant, no templates
    (every prefix is found by matching tokens), no sessions."""

    def __init__(self, trace: Trace, spec, block_elems: int) -> None:
        n = len(trace)
        self.spec = spec
        self.trace = trace
        self._prompts = TracePrompts(trace, block_elems)
        self.time_s = trace.time_s - trace.time_s[0]
        self.tenant = np.zeros(n, dtype=np.int32)
        self.template = np.zeros(n, dtype=np.int32)
        self.session = np.full(n, -1, dtype=np.int32)
        self.output_tokens = trace.output_length.astype(np.int32)
        self.template_elems = np.zeros((1, 1), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.time_s)

    def prompt_elems(self) -> np.ndarray:
        return self._prompts.prompt_elems()

    def prompt_tokens(self) -> np.ndarray:
        return self.trace.input_length

    def token_builder(self):
        return self._prompts.tokens
