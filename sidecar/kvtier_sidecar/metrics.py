"""Per-tenant counters and their Prometheus rendering, bounded in memory and labels.

Counters are kept for at most `MAX_TRACKED_TENANTS` tenants, chosen by the space-saving
heavy-hitter algorithm: a new tenant past the bound takes the place of the tracked
tenant with the fewest events, whose counters are folded into "other" (so totals are
conserved) and whose event count the newcomer inherits (so a one-off tenant cannot
push out a heavy one: any tenant with more than 1/MAX_TRACKED_TENANTS of the events is
always tracked). A million distinct tenants cost the same memory as the bound. At
scrape time the `top_n` tracked tenants by lookups get their own label and the rest
is summed into tenant="other": top_n + 1 series per metric.

Names follow Prometheus conventions (`_total` counters, `_bytes` units) and vLLM's:
`kvtier_prefix_cache_queries_total` / `kvtier_prefix_cache_hits_total` count tokens,
as `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` do, while
`kvtier_lookups_total` / `kvtier_hits_total` count requests. Both are what lookups
offered; the hit figure is what the engine reported loading
(`kvtier_engine_loaded_tokens_total` over `kvtier_engine_prompt_tokens_total`).
Every series carries `version`, the weights version this sidecar serves; `namespace`,
`pod` and `policy` are target labels Prometheus adds from the pod (see
docs/OBSERVABILITY.md), so the label set per sidecar is bounded by top_n x tiers.

Tenant names are the operator's to read (`/cache/stats`, behind its token). Where
/metrics answers without a token while the control API wants one, the tenant label is
`hashed_tenants`' keyed digest of the name: the same on every sidecar of a policy (keyed
by its peer secret), so per-tenant series still add up across pods, and no name can be
read or guessed from it.
"""
from __future__ import annotations

import collections
import hashlib
import heapq
import hmac
from dataclasses import dataclass, field
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

OTHER = "other"
# Tenants with their own counters; ~1 KiB each, so a few MiB at most. Far above any
# stats or metrics top-N, so those lists are exact for every tenant that matters.
MAX_TRACKED_TENANTS = 4096
# The lazy min-heap is rebuilt from the live weights past this many entries per tenant.
_HEAP_SLACK = 4
TIERS = ("dram", "peer")
# Sidecar counters rendered under their own typed families below, not generically.
_TYPED_COUNTERS = frozenset({"peer_fetches", "peer_fetch_errors", "peer_checksum_mismatches", "stored_bytes",
                             "engine_loaded_bytes", "engine_load_errors", "engine_loaded_tokens_dram",
                             "engine_loaded_tokens_peer", "engine_local_hit_tokens", "engine_prompt_tokens",
                             "engine_lookup_timeouts", "engine_breaker_trips", "warmup_lookups",
                             "warmup_tokens_hit", "warmup_tokens_miss", "peer_hint_used", "peer_hint_unknown",
                             "peer_hint_miss", "peer_hint_failed"})
# What became of a lookup's peer-pull hint (`peer_hint`): `kvtier_peer_hint_total{outcome}`.
PEER_HINT_OUTCOMES = ("used", "unknown", "miss", "failed")
# Global index operations, exported at 0 before their first failure (so rates exist).
INDEX_OPERATIONS = ("lookup", "register", "heartbeat")
# The states `kvtier_index_health` reports per kind of operation (redis_health.Health).
INDEX_HEALTH_STATES = ("ok", "unreachable", "oom", "readonly", "moved", "error")


@dataclass(slots=True)
class TenantCounters:
    lookups: int = 0
    lookup_tokens: int = 0
    hits: collections.Counter = field(default_factory=collections.Counter)  # tier -> hits
    hit_tokens: collections.Counter = field(default_factory=collections.Counter)  # tier -> tokens
    served_bytes: collections.Counter = field(default_factory=collections.Counter)  # tier -> KV bytes handed out
    peer_bytes: int = 0
    stores: int = 0
    stores_declined: int = 0  # refused by admission (or no slot could be freed)
    stores_cached: int = 0  # nothing to write: every block was cached already
    warmed_bytes: int = 0  # pulled from a peer by a warm-up job (the operator's moves)

    def add(self, other: "TenantCounters") -> None:
        self.lookups += other.lookups
        self.lookup_tokens += other.lookup_tokens
        # dict(...) copies in one step: reports add these up off the event loop while
        # the loop may add a tier's first key.
        self.hits.update(dict(other.hits))
        self.hit_tokens.update(dict(other.hit_tokens))
        self.served_bytes.update(dict(other.served_bytes))
        self.peer_bytes += other.peer_bytes
        self.stores += other.stores
        self.stores_declined += other.stores_declined
        self.stores_cached += other.stores_cached
        self.warmed_bytes += other.warmed_bytes

    def as_dict(self) -> dict:
        total_hits = sum(self.hits.values())
        return {
            "lookups": self.lookups,
            "hits": total_hits,
            "hit_rate": total_hits / self.lookups if self.lookups else 0.0,
            "token_hit_rate": sum(self.hit_tokens.values()) / self.lookup_tokens if self.lookup_tokens else 0.0,
            "hits_by_tier": {t: self.hits.get(t, 0) for t in TIERS},
            "hit_tokens_by_tier": {t: self.hit_tokens.get(t, 0) for t in TIERS},
            "served_bytes_by_tier": {t: self.served_bytes.get(t, 0) for t in TIERS},
            "lookup_tokens": self.lookup_tokens,
            "peer_bytes_fetched": self.peer_bytes,
            "stores": self.stores,
            "stores_declined": self.stores_declined,
            "stores_cached": self.stores_cached,
            "warmed_bytes": self.warmed_bytes,
        }


class TenantMetrics:
    """Per-tenant counters, bounded (space-saving top-N plus "other").

    Written on the event loop, read by reports on their own thread: readers take
    `dict.copy()` first, which copies in one step of C code with no Python run in
    between (unlike `list(d.items())`, whose tuple allocations can run the garbage
    collector and so let the loop's thread add a tenant mid-iteration)."""

    def __init__(self, capacity: int = MAX_TRACKED_TENANTS) -> None:
        self.capacity = capacity
        self.tenants: dict[str, TenantCounters] = {}
        self.other = TenantCounters()  # tenants no longer tracked, summed
        self.evicted = 0
        self._weight: dict[str, int] = {}  # space-saving event counts (an upper bound)
        self._heap: list[tuple[int, str]] = []  # (weight, tenant), stale entries skipped
        self._heap_live = False  # kept up to date only from the first eviction on

    def _counters(self, tenant: str) -> TenantCounters:
        c = self.tenants.get(tenant)
        if c is None:
            inherited = self._evict() if len(self.tenants) >= self.capacity else 0
            c = self.tenants[tenant] = TenantCounters()
            self._weight[tenant] = inherited
        weight = self._weight[tenant] + 1
        self._weight[tenant] = weight
        # The heap only matters once an eviction can happen (the bound reached): until
        # then an event costs no push; `_evict` builds the heap from the weights first.
        if self._heap_live:
            heapq.heappush(self._heap, (weight, tenant))
            if len(self._heap) > _HEAP_SLACK * self.capacity:
                self._heap = [(w, t) for t, w in self._weight.items()]
                heapq.heapify(self._heap)
        return c

    def _evict(self) -> int:
        """Fold the tracked tenant with the fewest events into "other"; its weight."""
        if not self._heap_live:
            self._heap = [(w, t) for t, w in self._weight.items()]
            heapq.heapify(self._heap)
            self._heap_live = True
        while True:
            weight, tenant = heapq.heappop(self._heap)
            if self._weight.get(tenant) == weight:
                break
        self.other.add(self.tenants.pop(tenant))
        del self._weight[tenant]
        self.evicted += 1
        return weight

    def lookup(self, tenant: str, prompt_tokens: int, tier: str | None, matched_tokens: int, peer_bytes: int = 0,
               served_bytes: int = 0, dram_tokens: int | None = None, token_bytes: int = 0) -> None:
        """`tier`: where the hit's last block came from (the request's hit is counted
        there); `dram_tokens`: its leading tokens this sidecar already held, counted
        under "dram" even in a "peer" hit (None: all of them are `tier`'s);
        `token_bytes`: KV bytes per token, to split `served_bytes` the same way."""
        c = self._counters(tenant)
        c.lookups += 1
        c.lookup_tokens += prompt_tokens
        if tier == "dram":  # the engine path's common case: every matched token is a DRAM one
            c.hits["dram"] += 1
            if matched_tokens:
                c.hit_tokens["dram"] += matched_tokens
                c.served_bytes["dram"] += served_bytes
        elif tier is not None:
            c.hits[tier] += 1
            local = matched_tokens if dram_tokens is None else min(dram_tokens, matched_tokens)
            local_bytes = local * token_bytes if dram_tokens is not None else served_bytes
            for name, tokens, nbytes in (("dram", local, local_bytes),
                                         (tier, matched_tokens - local, served_bytes - local_bytes)):
                if tokens:
                    c.hit_tokens[name] += tokens
                    c.served_bytes[name] += nbytes
        if peer_bytes:
            c.peer_bytes += peer_bytes

    def dram_hit(self, tenant: str, prompt_tokens: int, matched_tokens: int, served_bytes: int) -> None:
        """`lookup(tenant, prompt_tokens, "dram", matched_tokens, served_bytes=served_bytes)`
        of a hit of at least one token, the engine path's common case, in fewer steps."""
        c = self._counters(tenant)
        c.lookups += 1
        c.lookup_tokens += prompt_tokens
        c.hits["dram"] += 1
        c.hit_tokens["dram"] += matched_tokens
        c.served_bytes["dram"] += served_bytes

    def store(self, tenant: str, accepted: bool, cached: bool = False) -> None:
        c = self._counters(tenant)
        if accepted:
            c.stores += 1
        elif cached:
            c.stores_cached += 1
        else:
            c.stores_declined += 1

    def warmed(self, tenant: str, nbytes: int) -> None:
        self._counters(tenant).warmed_bytes += nbytes

    def total(self) -> TenantCounters:
        out = TenantCounters()
        out.add(self.other)
        for c in self.tenants.copy().values():  # a copy first: see the class docstring
            out.add(c)
        return out

    def bucketed(self, top_n: int) -> dict[str, TenantCounters]:
        """The top_n tenants by lookups, plus OTHER holding the rest."""
        ranked = sorted(self.tenants.copy().items(), key=lambda kv: kv[1].lookups, reverse=True)
        out = {name: c for name, c in ranked[:top_n]}
        rest = TenantCounters()
        rest.add(self.other)
        for _, c in ranked[top_n:]:
            rest.add(c)
        if ranked[top_n:] or self.evicted:
            out[OTHER if OTHER not in out else OTHER + "_"] = rest
        return out


@dataclass(frozen=True, slots=True)
class SidecarState:
    """The sidecar-wide numbers of one scrape (the tenants' counters aside)."""

    version: str
    bytes_used: float
    capacity_bytes: float
    reserved_blocks: float
    evictions: float
    admission_bar: float  # sightings a block needs to displace another in a full cache
    thrashing: bool
    pinned_hits: int
    index_up: bool | None  # None: no global index configured
    index_errors: dict[str, int]  # operation -> failures
    counters: dict[str, float]  # the sidecar's event counters (peer fetches, stores, ...)
    # "reads"/"writes" -> "ok" or the failure pausing them (redis_health.Health values)
    index_health: dict[str, str] = field(default_factory=dict)
    index_pending_blocks: int = 0  # registrations queued while writes are refused


TenantLabel = Callable[[str], str]
# Hex digits of a hashed tenant label: 64 bits, no collision among a sidecar's tenants.
HASHED_LABEL_HEX = 16


def hashed_tenants(key: bytes) -> TenantLabel:
    """A tenant's label as HMAC-SHA256(key, name), shortened; "other" stays "other"."""
    def label(bucket: str) -> str:
        if bucket == OTHER:
            return OTHER
        return "h-" + hmac.new(key, bucket.encode(), hashlib.sha256).hexdigest()[:HASHED_LABEL_HEX]
    return label


def _tenant_families(buckets: dict[str, TenantCounters], version: str, tenant_label: TenantLabel | None = None) -> Iterable:
    def counter(name: str, doc: str, *extra: str) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, labels=["tenant", "version", *extra])

    lookups = counter("kvtier_lookups", "Engine lookups (requests)")
    hits = counter("kvtier_hits", "Lookups that hit, by the tier that served them", "tier")
    queries = counter("kvtier_prefix_cache_queries", "Prompt tokens looked up (vLLM's prefix_cache_queries)")
    hit_tokens = counter("kvtier_prefix_cache_hits", "Prompt tokens matched, by tier (vLLM's prefix_cache_hits)",
                         "tier")
    served = counter("kvtier_served_bytes", "KV bytes handed to the engine, by tier", "tier")
    peer_bytes = counter("kvtier_peer_fetched_bytes", "KV bytes fetched from peers for lookups")
    warmed = counter("kvtier_warmed_bytes", "KV bytes pulled from peers by warm-up jobs")
    stores = counter("kvtier_stores", "Stores by outcome: accepted, declined (by admission), cached (every block "
                     "was cached already: nothing to write)", "outcome")
    for bucket, c in buckets.items():
        tenant = bucket if tenant_label is None else tenant_label(bucket)
        lookups.add_metric([tenant, version], c.lookups)
        queries.add_metric([tenant, version], c.lookup_tokens)
        peer_bytes.add_metric([tenant, version], c.peer_bytes)
        warmed.add_metric([tenant, version], c.warmed_bytes)
        stores.add_metric([tenant, version, "accepted"], c.stores)
        stores.add_metric([tenant, version, "declined"], c.stores_declined)
        stores.add_metric([tenant, version, "cached"], c.stores_cached)
        for tier in TIERS:
            hits.add_metric([tenant, version, tier], c.hits.get(tier, 0))
            hit_tokens.add_metric([tenant, version, tier], c.hit_tokens.get(tier, 0))
            served.add_metric([tenant, version, tier], c.served_bytes.get(tier, 0))
    return (lookups, hits, queries, hit_tokens, served, peer_bytes, warmed, stores)


def _sidecar_families(s: SidecarState) -> Iterable:
    v = [s.version]

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["version"])
        g.add_metric(v, value)
        return g

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["version"])
        c.add_metric(v, value)
        return c

    yield gauge("kvtier_dram_bytes_used", "DRAM tier bytes holding KV", s.bytes_used)
    yield gauge("kvtier_dram_capacity_bytes", "DRAM tier capacity", s.capacity_bytes)
    yield gauge("kvtier_dram_reserved_blocks", "Slots reserved by writers not yet committed", s.reserved_blocks)
    yield gauge("kvtier_pinned_hits", "Lookup hits the engine has not released yet", s.pinned_hits)
    yield counter("kvtier_evictions", "Blocks evicted from the DRAM tier", s.evictions)
    yield gauge("kvtier_admission_bar", "Sightings a block needs to displace another in a full cache",
                s.admission_bar)
    yield gauge("kvtier_thrashing", "1 while the cache matches under thrash_ratio x what a same-size LRU would",
                float(s.thrashing))
    if s.index_up is not None:
        yield gauge("kvtier_index_up", "1 while the global index (Redis) answers", float(s.index_up))
        errors = CounterMetricFamily("kvtier_index_errors", "Global index operations that failed",
                                     labels=["version", "operation"])
        for op, n in sorted({**dict.fromkeys(INDEX_OPERATIONS, 0), **s.index_errors}.items()):
            errors.add_metric([s.version, op], n)
        yield errors
        health = GaugeMetricFamily("kvtier_index_health", "1 for the state each kind of index operation is in "
                                   "(reads and writes fail separately: oom, readonly, moved, unreachable)",
                                   labels=["version", "operation", "state"])
        for op, state in sorted(s.index_health.items()):
            for candidate in INDEX_HEALTH_STATES:
                health.add_metric([s.version, op, candidate], float(state == candidate))
        yield health
        yield gauge("kvtier_index_pending_blocks", "Block registrations queued until index writes resume",
                    s.index_pending_blocks)
    yield counter("kvtier_peer_fetches", "Fetches from peer sidecars", s.counters.get("peer_fetches", 0))
    peer_errors = CounterMetricFamily("kvtier_peer_errors", "Peer fetches that ended early, by reason",
                                      labels=["version", "reason"])
    mismatches = s.counters.get("peer_checksum_mismatches", 0)
    peer_errors.add_metric([s.version, "checksum"], mismatches)
    peer_errors.add_metric([s.version, "transport"], s.counters.get("peer_fetch_errors", 0) - mismatches)
    yield peer_errors
    # Exported at 0 before the first hint, so that a fleet without a hinting router has them too.
    hints = CounterMetricFamily("kvtier_peer_hint", "Lookups that reached the peer step with a router's peer-pull "
                                "hint, by outcome: used (the hinted peer served verified blocks), unknown (no "
                                "member of this fleet: not asked), miss (it held nothing more), failed (the fetch "
                                "failed: bad bytes, timeout, busy)", labels=["version", "outcome"])
    for outcome in PEER_HINT_OUTCOMES:
        hints.add_metric([s.version, outcome], s.counters.get(f"peer_hint_{outcome}", 0))
    yield hints
    # The engine-facing byte counters, exported at 0 before the first store or report.
    yield counter("kvtier_stored_bytes", "KV bytes the engine stored (committed stores)",
                  s.counters.get("stored_bytes", 0))
    yield counter("kvtier_engine_loaded_bytes", "KV bytes the engine reported copying in from the arena",
                  s.counters.get("engine_loaded_bytes", 0))
    yield counter("kvtier_engine_load_errors", "Blocks the engine reported to its scheduler as not loaded "
                  "(recomputed)", s.counters.get("engine_load_errors", 0))
    # The one hit figure: what the engine loaded (kvtier_prefix_cache_hits_total is what
    # lookups offered, which the engine may not take: its own cache may hold it).
    loaded = CounterMetricFamily("kvtier_engine_loaded_tokens", "Prompt tokens the engine reported loading "
                                 "from kvtier, by tier (the hits it really used)", labels=["version", "tier"])
    for tier in TIERS:
        loaded.add_metric([s.version, tier], s.counters.get(f"engine_loaded_tokens_{tier}", 0))
    yield loaded
    yield counter("kvtier_engine_local_hit_tokens", "Prompt tokens the engine's own prefix cache held when it "
                  "asked", s.counters.get("engine_local_hit_tokens", 0))
    yield counter("kvtier_engine_prompt_tokens", "Prompt tokens of the requests the engine looked up",
                  s.counters.get("engine_prompt_tokens", 0))
    yield counter("kvtier_engine_lookup_timeouts", "Lookups the engine stopped waiting for (its lookup budget)",
                  s.counters.get("engine_lookup_timeouts", 0))
    yield counter("kvtier_engine_breaker_trips", "Times the engine stopped asking this sidecar for a back-off "
                  "period", s.counters.get("engine_breaker_trips", 0))
    # The rollout's warm-up requests, apart from the traffic's lookups (none of the
    # series above counts them): exported at 0 so that a pod never warmed has them too.
    yield counter("kvtier_warmup_lookups", "Lookups of the rollout's warm-up requests (not traffic: not in "
                  "kvtier_lookups_total nor in any hit figure)", s.counters.get("warmup_lookups", 0))
    warmup_tokens = CounterMetricFamily("kvtier_warmup_tokens", "Prompt tokens of the rollout's warm-up lookups, "
                                        "by result: hit (matched) or miss (the engine prefills them)",
                                        labels=["version", "result"])
    for result in ("hit", "miss"):
        warmup_tokens.add_metric([s.version, result], s.counters.get(f"warmup_tokens_{result}", 0))
    yield warmup_tokens
    for name, value in sorted(s.counters.items()):
        if name not in _TYPED_COUNTERS:
            yield counter(f"kvtier_{name}", name.replace("_", " "), value)


class _Collector:
    def __init__(self, metrics: TenantMetrics, top_n: int, state: SidecarState,
                 tenant_label: TenantLabel | None) -> None:
        self.metrics, self.top_n, self.state, self.tenant_label = metrics, top_n, state, tenant_label

    def collect(self) -> Iterable:
        yield from _tenant_families(self.metrics.bucketed(self.top_n), self.state.version, self.tenant_label)
        yield from _sidecar_families(self.state)


def render(metrics: TenantMetrics, top_n: int, state: SidecarState, tenant_label: TenantLabel | None = None) -> bytes:
    """Prometheus text; `tenant_label` (e.g. `hashed_tenants`) names the tenant series."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(metrics, top_n, state, tenant_label))
    return generate_latest(registry)
