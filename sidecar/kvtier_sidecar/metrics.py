"""Per-tenant counters and their Prometheus rendering with bounded label cardinality.

Counters are kept per tenant in plain dicts (cheap on the request path); at scrape
time the `top_n` tenants by lookups get their own label and every other tenant is
summed into tenant="other", so a fleet with 10,000 tenants still exports top_n + 1
series per metric.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

OTHER = "other"
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
    def __init__(self) -> None:
        self.tenants: dict[str, TenantCounters] = collections.defaultdict(TenantCounters)

    def lookup(self, tenant: str, prompt_tokens: int, tier: str | None, matched_tokens: int, peer_bytes: int = 0) -> None:
        c = self.tenants[tenant]
        c.lookups += 1
        c.lookup_tokens += prompt_tokens
        if tier is not None:
            c.hits[tier] += 1
            c.hit_tokens[tier] += matched_tokens
        c.peer_bytes += peer_bytes

    def store(self, tenant: str, accepted: bool) -> None:
        c = self.tenants[tenant]
        if accepted:
            c.stores += 1
        else:
            c.stores_declined += 1

    def warmed(self, tenant: str, nbytes: int) -> None:
        self.tenants[tenant].warmed_bytes += nbytes

    def total(self) -> TenantCounters:
        out = TenantCounters()
        for c in self.tenants.values():
            out.add(c)
        return out

    def bucketed(self, top_n: int) -> dict[str, TenantCounters]:
        """The top_n tenants by lookups, plus OTHER holding the rest."""
        ranked = sorted(self.tenants.items(), key=lambda kv: kv[1].lookups, reverse=True)
        out = {name: c for name, c in ranked[:top_n]}
        rest = TenantCounters()
        for _, c in ranked[top_n:]:
            rest.add(c)
        if ranked[top_n:]:
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
