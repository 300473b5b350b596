"""Per-tenant counters and their Prometheus rendering, bounded in memory and labels.

Counters are kept for at most `MAX_TRACKED_TENANTS` tenants, chosen by the space-saving
heavy-hitter algorithm: a new tenant past the bound takes the place of the tracked
tenant with the fewest events, whose counters are folded into "other" (so totals are
conserved) and whose event count the newcomer inherits (so a one-off tenant cannot
push out a heavy one: any tenant with more than 1/MAX_TRACKED_TENANTS of the events is
always tracked). A million distinct tenants cost the same memory as the bound. At
scrape time the `top_n` tracked tenants by lookups get their own label and the rest
is summed into tenant="other": top_n + 1 series per metric.
"""
from __future__ import annotations

import collections
import heapq
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


@dataclass(slots=True)
class TenantCounters:
    lookups: int = 0
    lookup_tokens: int = 0
    hits: collections.Counter = field(default_factory=collections.Counter)  # tier -> hits
    hit_tokens: collections.Counter = field(default_factory=collections.Counter)  # tier -> tokens
    peer_bytes: int = 0
    stores: int = 0
    stores_declined: int = 0
    warmed_bytes: int = 0  # pulled from a peer by a warm-up job (the operator's moves)

    def add(self, other: "TenantCounters") -> None:
        self.lookups += other.lookups
        self.lookup_tokens += other.lookup_tokens
        self.hits.update(other.hits)
        self.hit_tokens.update(other.hit_tokens)
        self.peer_bytes += other.peer_bytes
        self.stores += other.stores
        self.stores_declined += other.stores_declined
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
            "lookup_tokens": self.lookup_tokens,
            "peer_bytes_fetched": self.peer_bytes,
            "stores": self.stores,
            "stores_declined": self.stores_declined,
            "warmed_bytes": self.warmed_bytes,
        }


class TenantMetrics:
    def __init__(self, capacity: int = MAX_TRACKED_TENANTS) -> None:
        self.capacity = capacity
        self.tenants: dict[str, TenantCounters] = {}
        self.other = TenantCounters()  # tenants no longer tracked, summed
        self.evicted = 0
        self._weight: dict[str, int] = {}  # space-saving event counts (an upper bound)
        self._heap: list[tuple[int, str]] = []  # (weight, tenant), stale entries skipped

    def _counters(self, tenant: str) -> TenantCounters:
        c = self.tenants.get(tenant)
        if c is None:
            inherited = self._evict() if len(self.tenants) >= self.capacity else 0
            c = self.tenants[tenant] = TenantCounters()
            self._weight[tenant] = inherited
        weight = self._weight[tenant] + 1
        self._weight[tenant] = weight
        heapq.heappush(self._heap, (weight, tenant))
        if len(self._heap) > _HEAP_SLACK * self.capacity:
            self._heap = [(w, t) for t, w in self._weight.items()]
            heapq.heapify(self._heap)
        return c

    def _evict(self) -> int:
        """Fold the tracked tenant with the fewest events into "other"; its weight."""
        while True:
            weight, tenant = heapq.heappop(self._heap)
            if self._weight.get(tenant) == weight:
                break
        self.other.add(self.tenants.pop(tenant))
        del self._weight[tenant]
        self.evicted += 1
        return weight

    def lookup(self, tenant: str, prompt_tokens: int, tier: str | None, matched_tokens: int, peer_bytes: int = 0) -> None:
        c = self._counters(tenant)
        c.lookups += 1
        c.lookup_tokens += prompt_tokens
        if tier is not None:
            c.hits[tier] += 1
            c.hit_tokens[tier] += matched_tokens
        c.peer_bytes += peer_bytes

    def store(self, tenant: str, accepted: bool) -> None:
        c = self._counters(tenant)
        if accepted:
            c.stores += 1
        else:
            c.stores_declined += 1

    def warmed(self, tenant: str, nbytes: int) -> None:
        self._counters(tenant).warmed_bytes += nbytes

    def total(self) -> TenantCounters:
        out = TenantCounters()
        out.add(self.other)
        for c in self.tenants.values():
            out.add(c)
        return out

    def bucketed(self, top_n: int) -> dict[str, TenantCounters]:
        """The top_n tenants by lookups, plus OTHER holding the rest."""
        ranked = sorted(self.tenants.items(), key=lambda kv: kv[1].lookups, reverse=True)
        out = {name: c for name, c in ranked[:top_n]}
        rest = TenantCounters()
        rest.add(self.other)
        for _, c in ranked[top_n:]:
            rest.add(c)
        if ranked[top_n:] or self.evicted:
            out[OTHER if OTHER not in out else OTHER + "_"] = rest
        return out


class _Collector:
    def __init__(self, metrics: TenantMetrics, top_n: Callable[[], int], gauges: Callable[[], dict[str, float]],
                 counters: Callable[[], dict[str, float]]) -> None:
        self.metrics = metrics
        self.top_n = top_n
        self.gauges = gauges
        self.counters = counters

    def collect(self) -> Iterable:
        buckets = self.metrics.bucketed(self.top_n())
        lookups = CounterMetricFamily("kvtier_lookups", "Engine lookups", labels=["tenant"])
        hits = CounterMetricFamily("kvtier_hits", "Lookup hits by tier", labels=["tenant", "tier"])
        hit_tokens = CounterMetricFamily("kvtier_hit_tokens", "Matched tokens by tier", labels=["tenant", "tier"])
        lookup_tokens = CounterMetricFamily("kvtier_lookup_tokens", "Prompt tokens looked up", labels=["tenant"])
        peer_bytes = CounterMetricFamily("kvtier_peer_fetched_bytes", "KV bytes fetched from peers", labels=["tenant"])
        stores = CounterMetricFamily("kvtier_stores", "Stores by outcome", labels=["tenant", "outcome"])
        for tenant, c in buckets.items():
            lookups.add_metric([tenant], c.lookups)
            lookup_tokens.add_metric([tenant], c.lookup_tokens)
            peer_bytes.add_metric([tenant], c.peer_bytes)
            stores.add_metric([tenant, "accepted"], c.stores)
            stores.add_metric([tenant, "declined"], c.stores_declined)
            for tier in TIERS:
                hits.add_metric([tenant, tier], c.hits.get(tier, 0))
                hit_tokens.add_metric([tenant, tier], c.hit_tokens.get(tier, 0))
        yield from (lookups, hits, hit_tokens, lookup_tokens, peer_bytes, stores)
        for name, value in self.gauges().items():
            yield GaugeMetricFamily(f"kvtier_{name}", name.replace("_", " "), value=value)
        for name, value in self.counters().items():
            yield CounterMetricFamily(f"kvtier_{name}", name.replace("_", " "), value=value)


def render(metrics: TenantMetrics, top_n: int, gauges: dict[str, float], counters: dict[str, float]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(metrics, lambda: top_n, lambda: gauges, lambda: counters))
    return generate_latest(registry)
