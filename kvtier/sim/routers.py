"""Routing policies behind one interface: the ones other systems ship, and kvtier's.

A policy is bound to a fleet (and the replicas' caches, for the one that reads
them), routes each request to a live replica, hears where it went, and is told
when membership changes. Competitors are modelled on the published behaviour of
the systems named; their knobs are constructor arguments with defaults set to
those projects' documented defaults as far as we know them, so a reader can
re-run with their own.

| name           | decides by                                                          |
|----------------|---------------------------------------------------------------------|
| random         | uniform over live replicas                                          |
| round-robin    | next live replica                                                   |
| chash-tenant   | consistent-hash ring (virtual nodes) on the tenant id               |
| chash-session  | the same ring on the session id (a fresh id per single request)     |
| approx-prefix  | Gateway API inference extension prefix plugin: per-replica LRU of   |
|                | blocks routed there, scored with queue length and KV utilisation    |
| precise-prefix | llm-d precise scorer / Dynamo KV router: the replicas' real cache   |
|                | contents, cost = overlap weight x prefill blocks + decode blocks    |
| sglang         | SGLang cache-aware router: approximate tree per worker, balance     |
|                | thresholds (absolute and relative) switch to shortest queue         |
| kvtier         | rendezvous top-k homes with occupancy spill and hysteresis: the    |
|                | real `kvtier.routing.pick` over a real `AffinityTable`              |
| oracle         | least-queued replica over one shared infinite cache (the ceiling)   |
"""
from __future__ import annotations

import bisect
import random
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

from kvtier.affinity import AffinityTable, MembershipPlan, plan_membership_change, with_bounded_loads
from kvtier.keys import DEFAULT_BLOCK_SIZE, KeyRoot
from kvtier.routing import SpillState, pick_rank
from kvtier.sim.fleet import Fleet
from kvtier.sim.request import SimRequest

# Ring points per replica: ~100 virtual nodes keep a consistent-hash ring's load
# within ~10% of even, the usual setting for session routers.
VIRTUAL_NODES = 100
# Gateway API inference extension prefix plugin: its default LRU capacity per server
# in blocks; scorer weights prefix:queue:kv = 3:2:2, a common llm-d scheduler profile.
GIE_LRU_BLOCKS_PER_SERVER = 31_250
GIE_WEIGHTS = (3.0, 2.0, 2.0)
# Dynamo KV router: cost = overlap_score_weight x prefill blocks + decode blocks.
DYNAMO_OVERLAP_WEIGHT = 1.0
# SGLang model gateway (sgl-router) cache-aware defaults; older sgl-router releases
# used 0.5 / 32 / 1.1.
SGLANG_CACHE_THRESHOLD = 0.3
SGLANG_BALANCE_ABS = 64
SGLANG_BALANCE_REL = 1.5


class Router:
    """Base: `bind` once, `route` per request, `routed` after it, `membership_changed`."""

    name = "base"

    def bind(self, fleet: Fleet, caches: Sequence, roots: RootBook) -> None:
        self.fleet, self.caches, self.roots = fleet, caches, roots

    def route(self, req: SimRequest, now_s: float) -> int:
        raise NotImplementedError

    def routed(self, req: SimRequest, replica: int) -> None:
        """The request went to `replica` (approximate indexes learn from this)."""

    def membership_changed(self) -> MembershipPlan | None:
        """`fleet.live` changed; returns kvtier's plan (which tenants moved), else None."""
        return None


class RootBook:
    """Key roots per (tenant, weights version), built once: a root's digest is
    hashed at construction, so it must not be rebuilt per request."""

    def __init__(self, tenant_names: Sequence[str], model_id: str = "llama-70b") -> None:
        self.tenant_names = list(tenant_names)
        self.model_id = model_id
        self._by_version: dict[int, list[KeyRoot]] = {}

    def root(self, tenant: int, version: int) -> KeyRoot:
        roots = self._by_version.get(version)
        if roots is None:
            roots = [KeyRoot(t, self.model_id, f"sha256:weights-v{version}", "fp16", "rope-default", "flash-attn")
                     for t in self.tenant_names]
            self._by_version[version] = roots
        return roots[tenant]


class RandomRouter(Router):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def route(self, req, now_s):
        live = self.fleet.live
        return live[self._rng.randrange(len(live))]


class RoundRobinRouter(Router):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, req, now_s):
        live = self.fleet.live
        self._next = (self._next + 1) % len(live)
        return live[self._next]


class ConsistentHashRouter(Router):
    """A hash ring with virtual nodes, keyed on the tenant or the session id."""

    def __init__(self, on: str = "tenant", virtual_nodes: int = VIRTUAL_NODES) -> None:
        if on not in ("tenant", "session"):
            raise ValueError(f"consistent hashing keys on 'tenant' or 'session', got {on!r}")
        self.on, self.virtual_nodes = on, virtual_nodes
        self.name = f"chash-{on}"

    def bind(self, fleet, caches, roots):
        super().bind(fleet, caches, roots)
        self._build()

    def _build(self) -> None:
        points = sorted((xxhash.xxh64_intdigest(f"{self.fleet.names[r]}#{v}".encode()), r)
                        for r in self.fleet.live for v in range(self.virtual_nodes))
        self._keys = [p[0] for p in points]
        self._owners = [p[1] for p in points]

    def route(self, req, now_s):
        if self.on == "tenant":
            key = req.tenant_name
        else:
            key = f"s{req.session}" if req.session >= 0 else f"r{req.index}"
        i = bisect.bisect(self._keys, xxhash.xxh64_intdigest(key.encode())) % len(self._keys)
        return self._owners[i]

    def membership_changed(self):
        self._build()
        return None


class _RoutedBlocks:
    """Per-replica LRU of block hashes routed there, plus hash -> replicas for scoring.

    This is what an approximate prefix router believes each replica holds: it never
    hears about evictions, only forgets the oldest when its own LRU is full.
    """

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._lru: dict[int, OrderedDict[bytes, None]] = {}
        self._where: dict[bytes, set[int]] = {}

    def matched_blocks(self, hashes: Sequence[bytes], live: Sequence[int]) -> dict[int, int]:
        """Consecutive leading blocks each replica is believed to hold (0 if none)."""
        out = dict.fromkeys(live, 0)
        if not hashes:
            return out
        cand = self._where.get(hashes[0], set()) & out.keys()
        depth = 0
        while cand:
            depth += 1
            for r in cand:
                out[r] = depth
            if depth == len(hashes):
                break
            cand = cand & self._where.get(hashes[depth], set())
        return out

    def add(self, replica: int, hashes: Sequence[bytes]) -> None:
        lru = self._lru.setdefault(replica, OrderedDict())
        where = self._where
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                where.setdefault(h, set()).add(replica)
        while len(lru) > self.capacity_blocks:
            h, _ = lru.popitem(last=False)
            owners = where[h]
            owners.discard(replica)
            if not owners:
                del where[h]

    def size(self, replica: int) -> int:
        return len(self._lru.get(replica, ()))

    def forget(self, replica: int) -> None:
        for h in self._lru.pop(replica, {}):
            owners = self._where.get(h)
            if owners is not None:
                owners.discard(replica)
                if not owners:
                    del self._where[h]


class _RoutedBlocksRouter(Router):
    """A router that remembers which blocks it sent where (`routed_blocks`), as the
    Gateway API prefix plugin and SGLang's router do, rather than asking the caches."""

    routed_blocks: _RoutedBlocks

    def routed(self, req, replica):
        self.routed_blocks.add(replica, req.hashes(self.roots.root(req.tenant, 0)))

    def membership_changed(self):
        for r in list(self.routed_blocks._lru):
            if not self.fleet.alive[r]:
                self.routed_blocks.forget(r)
        return None


class ApproxPrefixRouter(_RoutedBlocksRouter):
    """Gateway API inference extension prefix plugin, with its queue and KV scorers.

    score = w_prefix x matched/total blocks + w_queue x (max_q - q)/(max_q - min_q)
            + w_kv x (1 - KV utilisation); the highest score wins, ties at random.
    """

    name = "approx-prefix"

    def __init__(self, lru_blocks: int = GIE_LRU_BLOCKS_PER_SERVER, weights=GIE_WEIGHTS, seed: int = 0) -> None:
        self.routed_blocks = _RoutedBlocks(lru_blocks)
        self.weights = weights
        self._rng = random.Random(seed)

    def route(self, req, now_s):
        fleet, live = self.fleet, self.fleet.live
        hashes = req.hashes(self.roots.root(req.tenant, 0))
        matched = self.routed_blocks.matched_blocks(hashes, live)
        total = max(1, len(hashes))
        queues = [fleet.queue_s(r, now_s) for r in live]
        q_lo, q_hi = min(queues), max(queues)
        wp, wq, wk = self.weights
        best, best_score = [], float("-inf")
        for r, q in zip(live, queues):
            q_score = 1.0 if q_hi == q_lo else (q_hi - q) / (q_hi - q_lo)
            score = wp * matched[r] / total + wq * q_score + wk * (1.0 - min(1.0, fleet.occupancy(r)))
            if score > best_score + 1e-12:
                best, best_score = [r], score
            elif abs(score - best_score) <= 1e-12:
                best.append(r)
        return best[0] if len(best) == 1 else best[self._rng.randrange(len(best))]



class PrecisePrefixRouter(Router):
    """Dynamo KV router / llm-d precise scorer: exact cache contents plus a load term.

    cost = overlap_weight x prefill_blocks + decode_blocks, where prefill_blocks are
    the prompt's blocks not cached on the replica plus prefill already queued there,
    and decode_blocks the KV blocks its in-flight requests hold. Lowest cost wins.
    Block counts use the engine's 16-token block, whatever the simulation's block.
    """

    name = "precise-prefix"
    token_unit = 1  # real tokens per simulation element; the engine sets it

    def __init__(self, overlap_weight: float = DYNAMO_OVERLAP_WEIGHT) -> None:
        self.overlap_weight = overlap_weight

    def route(self, req, now_s):
        fleet, caches, unit = self.fleet, self.caches, self.token_unit
        best, best_cost = -1, float("inf")
        tps = fleet.spec.prefill_tokens_per_s
        for r in fleet.live:
            root = self.roots.root(req.tenant, fleet.version[r])
            cached = caches[r].peek(req, root) * unit
            prefill_blocks = (req.prompt_tokens - cached + fleet.queue_s(r, now_s) * tps) / DEFAULT_BLOCK_SIZE
            decode_blocks = fleet.active_kv_tokens[r] / DEFAULT_BLOCK_SIZE
            cost = self.overlap_weight * prefill_blocks + decode_blocks
            if cost < best_cost:
                best, best_cost = r, cost
        return best


class SglangRouter(_RoutedBlocksRouter):
    """SGLang cache-aware routing: prefix match when balanced, shortest queue when not.

    Imbalanced when max_load - min_load > abs_threshold AND max_load > rel_threshold x
    min_load (load = running requests). Balanced: the replica whose approximate tree
    matches the largest fraction of the prompt, if that fraction exceeds
    cache_threshold, else the replica with the smallest tree (most room).
    """

    name = "sglang"

    def __init__(self, cache_threshold: float = SGLANG_CACHE_THRESHOLD, abs_threshold: int = SGLANG_BALANCE_ABS,
                 rel_threshold: float = SGLANG_BALANCE_REL, tree_blocks: int = GIE_LRU_BLOCKS_PER_SERVER) -> None:
        self.cache_threshold, self.abs_threshold, self.rel_threshold = cache_threshold, abs_threshold, rel_threshold
        self.routed_blocks = _RoutedBlocks(tree_blocks)

    def route(self, req, now_s):
        fleet, live = self.fleet, self.fleet.live
        loads = [fleet.in_flight[r] for r in live]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.abs_threshold and hi > self.rel_threshold * lo:
            return live[loads.index(lo)]
        hashes = req.hashes(self.roots.root(req.tenant, 0))
        matched = self.routed_blocks.matched_blocks(hashes, live)
        best = max(live, key=lambda r: matched[r])
        if hashes and matched[best] / len(hashes) > self.cache_threshold:
            return best
        return min(live, key=self.routed_blocks.size)



class _MemoTable:
    """An `AffinityTable` whose per-tenant rendezvous order is computed once.

    `kvtier.routing.pick` recomputes `order_for(tenant)` on every call (a 1 x n score
    row and an argsort); the order is a pure function of the immutable table, so the
    simulator memoises it. Everything else is read straight from the real table, the
    members as a tuple (in the table's order: the fleet mean sums them per decision).
    """

    __slots__ = ("table", "members", "homes", "epoch", "spill_occupancy", "balance_factor", "hysteresis", "_orders")

    def __init__(self, table: AffinityTable) -> None:
        self.table = table
        self.members, self.homes, self.epoch = tuple(table.members), table.homes, table.epoch
        self.spill_occupancy, self.balance_factor = table.spill_occupancy, table.balance_factor
        self.hysteresis = table.hysteresis
        self._orders: dict[str, list[str]] = {}

    def order_for(self, tenant: str) -> list[str]:
        order = self._orders.get(tenant)
        if order is None:
            order = self._orders[tenant] = self.table.order_for(tenant)
        return order


class KvtierRouter(Router):
    """kvtier: the real affinity table and `pick`, fed the fleet's KV occupancy."""

    name = "kvtier"

    def __init__(self, homes: int | None = None, spill_occupancy: float | None = None,
                 balance_factor: float | None = None, hysteresis: float | None = None) -> None:
        knobs = {"homes": homes, "spill_occupancy": spill_occupancy,
                 "balance_factor": balance_factor, "hysteresis": hysteresis}
        self._knobs = {k: v for k, v in knobs.items() if v is not None}
        self.spilled = 0

    def bind(self, fleet, caches, roots):
        super().bind(fleet, caches, roots)
        # What the operator publishes when it knows the fleet and the tenants at once:
        # rendezvous homes with home loads bounded by balanceFactor.
        table = AffinityTable(members={fleet.names[r]: 1.0 for r in fleet.live}, **self._knobs)
        self._use(with_bounded_loads(table, roots.tenant_names))
        self._state = SpillState()
        self.last_plan: MembershipPlan | None = None

    def _use(self, table: AffinityTable) -> None:
        self.table = table
        self._memo = _MemoTable(table)
        self._index = {name: i for i, name in enumerate(self.fleet.names)}

    def route(self, req, now_s):
        order, rank = pick_rank(req.tenant_name, self._memo, self.fleet.occupancy_by_name, self._state)
        self.spilled += rank >= self._memo.homes  # `pick`'s Pick.spilled
        return self._index[order[rank]]

    def membership_changed(self):
        fleet = self.fleet
        plan = plan_membership_change(self.table, {fleet.names[r]: 1.0 for r in fleet.live},
                                      self.roots.tenant_names)
        self._use(plan.table)
        self.last_plan = plan
        return plan


class OracleRouter(Router):
    """Perfect routing over one infinite cache: every replica sees every block, so
    the only thing left to choose is the least-queued replica."""

    name = "oracle"

    def route(self, req, now_s):
        fleet = self.fleet
        return min(fleet.live, key=lambda r: (fleet.prefill_free_at[r], fleet.active_kv_tokens[r]))


ROUTERS = {
    "random": RandomRouter,
    "round-robin": RoundRobinRouter,
    "chash-tenant": lambda: ConsistentHashRouter("tenant"),
    "chash-session": lambda: ConsistentHashRouter("session"),
    "approx-prefix": ApproxPrefixRouter,
    "precise-prefix": PrecisePrefixRouter,
    "sglang": SglangRouter,
    "kvtier": KvtierRouter,
    "oracle": OracleRouter,
}


def make_router(name: str) -> Router:
    """A fresh policy by name; ValueError naming the known ones otherwise."""
    try:
        factory = ROUTERS[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(ROUTERS)}") from None
    return factory()
