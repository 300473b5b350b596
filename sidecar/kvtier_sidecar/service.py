"""The sidecar's request logic: local tier first, then the global index and a peer.

    lookup(root, tokens)
      ├─ DRAM tier match by tokens (pins)            -> hit "dram"
      ├─ platform-owned prefix under the platform root (if configured)
      └─ still short of the prompt?
           ├─ a router's peer-pull hint naming a member of this fleet (peer_hint.py)?
           │    that peer is asked first, its blocks verified as any peer's -> hit "peer"
           └─ one Redis round trip: longest prefix a peer holds
                └─ fetch the missing blocks from that peer into reserved arena slots,
                   commit the verified prefix, look up again   -> hit "peer"

Everything after the local match is best effort with a deadline: Redis down, a peer
gone, slow or lying (checksum), a full arena — each ends the attempt and the engine
gets whatever the local tier had (rule: fault-is-a-miss). Nothing on this path raises
for a fault.

`Sidecar` composes the concerns and answers the engine socket and the control API:
`PlatformPrefixes` (platform_prefix.py), `TicketBook` (store_tickets.py),
`PeerFetcher` (peer_fetch.py), `JobRegistry` (jobs.py), `Counters` (counters.py).
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import numpy as np

from kvtier import control_api as api
from kvtier.keys import KeyRoot, block_hashes
from kvtier.sidecar_config import SidecarConfig

from . import metrics as metrics_mod
from .counters import Count, Counters
from .dram import DramTier, TierHit
from .global_index import GlobalIndex
from .jobs import JobRegistry, QueueFull, RefConflict  # noqa: F401  (answered 429 / 409 by http_api)
from .peer_fetch import PeerFetcher
from .peer_hint import HintedPeers
from .platform_prefix import PlatformPrefixes
from .store_tickets import OwnershipError, TicketBook, TicketId, fresh_ids
from .transport import PeerTransport


# Warm-up jobs accepted and not finished; past this a request is answered 429 with
# Retry-After (one epoch's moves onto one target are far fewer).
MAX_WARM_JOBS = 64
# Warm-ups running at once; the rest wait their turn (each holds peer connections).
WARM_CONCURRENCY = 2
# A warm-up job that has not finished by then fails ("deadline"): a stalled peer must
# not hold a queue slot forever (the operator's own default wait is shorter).
WARM_JOB_DEADLINE_S = 120.0
# What a refused warm-up is told: about one queued job's worth of peer timeouts.
WARM_RETRY_AFTER_S = 5


class PeerTierDisabled(RuntimeError):
    """A peer operation asked of a sidecar whose config turned the peer tier off."""


@dataclass(slots=True)
class LookupAnswer:
    hit_id: int
    matched_tokens: int
    slots: list[int]
    tier: str
    # The leading tokens this sidecar held before the lookup: a "peer" hit's prefix
    # up to here is a DRAM hit, only the rest came from the peer.
    dram_tokens: int = 0


class Sidecar:
    def __init__(self, config: SidecarConfig, tier: DramTier, index: GlobalIndex | None,
                 transport: PeerTransport | None, instance: str) -> None:
        self.config = config
        self.tier = tier
        self.index = index
        self.transport = transport
        self.instance = instance
        self.block_size = config.block_size
        self.metrics = metrics_mod.TenantMetrics()
        self.counters = Counters()
        self.platform = PlatformPrefixes(tier, lambda: self.config)
        self.tickets = TicketBook(tier, self.metrics)
        self.fetcher = PeerFetcher(tier, index, transport, self.counters, self._register)
        self.hinted_peers = HintedPeers(lambda: self.index.members if self.index is not None else None,
                                        lambda: self.config.warm_peers, self._advertised)
        self.jobs_registry = JobRegistry()
        self._warm_slots = asyncio.Semaphore(WARM_CONCURRENCY)
        self._hits: dict[int, TierHit] = {}
        self._hit_owners: dict[int, object] = {}  # hit -> the engine connection that holds it
        self._ids = fresh_ids()  # hit ids: a predecessor's names nothing here
        self.nvme = None  # an nvme_probe.NvmeProbe when the config measures a local disk
        self.started_s = time.time()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Graceful leave (see main.SidecarProcess): set on SIGTERM; readiness fails so the
        # pod leaves membership while peers may still fetch from it.
        self.draining = False
        self.drain_done = asyncio.Event()
        self.last_control_s = time.monotonic()  # the operator's stats/warm/jobs calls

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop that owns the index client (fetch threads hand work to it)."""
        self._loop = loop
        self._loop_thread = threading.get_ident()

    # -- engine path --------------------------------------------------------------------

    async def lookup(self, root: KeyRoot, tokens: np.ndarray, owner: object = None,
                     local_tokens: int = 0, warmup: bool = False,
                     source_peer: str | None = None) -> LookupAnswer | None:
        """`local_tokens`: what the engine's own prefix cache holds; a peer is asked only
        for a prefix longer than that (and not at all when it covers the prompt).
        `warmup`: the request is the rollout's warm-up (`names.WARMUP_PURPOSE`), counted
        in the warm-up counters, never in the traffic's (`_count_warmup`).
        `source_peer`: a router's peer-pull hint (`peer_hint`), asked first when the
        local tiers fall short and it names a member of this fleet."""
        answer = self.lookup_now(root, tokens, owner, local_tokens, warmup, source_peer)
        if answer is None or type(answer) is LookupAnswer:
            return answer
        return await answer

    def lookup_now(self, root: KeyRoot, tokens: np.ndarray, owner: object = None, local_tokens: int = 0,
                   warmup: bool = False, source_peer: str | None = None):
        """`lookup` without a coroutine when the local tiers answer it (no peer to ask):
        the answer (a LookupAnswer, or None for a miss), else a coroutine that asks the
        peers and answers (the caller awaits it)."""
        hit = self.tier.lookup(root, tokens)  # None, or a hit of at least one block
        block_size = self.block_size
        max_blocks = (len(tokens) - 1) // block_size  # rule: last-token
        if hit is not None:
            have = hit.matched_tokens // block_size
            if have >= max_blocks:  # all a lookup may match: no platform copy or peer can add to it
                matched = hit.matched_tokens
                if warmup:
                    self._count_warmup(len(tokens), matched)
                else:
                    self.metrics.dram_hit(root.tenant, len(tokens), matched,
                                          matched // block_size * self.tier.block_bytes)
                hit_id = next(self._ids)
                self._hits[hit_id] = hit
                self._hit_owners[hit_id] = owner
                return LookupAnswer(hit_id, matched, hit.slots, "dram", matched)
            tier_name = "dram"
        else:
            have, tier_name = 0, None
        if have < max_blocks:
            platform = self.platform.hit(root, tokens, have)
            if platform is not None:
                if hit is not None:
                    self.tier.release(hit.handle)
                hit, tier_name = platform, "dram"
                have = hit.matched_tokens // block_size
        local_blocks = local_tokens // block_size
        if max(have, local_blocks) < max_blocks and self.transport is not None:
            hinted = self._hinted(source_peer) if source_peer is not None else None
            if self.index is not None or hinted is not None:
                return self._lookup_peers(root, tokens, owner, hit, tier_name, have, max_blocks, local_blocks,
                                          warmup, hinted)
        return self._answer(root, tokens, owner, hit, tier_name, have * block_size, 0, warmup)

    def _advertised(self) -> str | None:
        """This sidecar's own peer address, as its peers know it."""
        if self.index is not None:
            return self.index.host
        return getattr(self.transport, "identity", None) or None

    def _hinted(self, source_peer: str) -> str | None:
        """The member of this fleet a lookup's hint names (None, counted `unknown`: the
        lookup goes on as if it had none). A request's hint is never dialled itself."""
        member = self.hinted_peers.resolve(source_peer)
        if member is None:
            self.counters.add(Count.PEER_HINT_UNKNOWN)
        return member

    async def _lookup_peers(self, root: KeyRoot, tokens: np.ndarray, owner: object, hit: TierHit | None,
                            tier_name: str | None, have: int, max_blocks: int,
                            local_blocks: int, warmup: bool = False, hinted: str | None = None) -> LookupAnswer | None:
        fetched, peer_bytes = await self.fetcher.from_peers(root, tokens, have, max_blocks, beyond=local_blocks,
                                                            hinted=hinted)
        if fetched:
            again = self.tier.lookup(root, tokens)
            if again and again.matched_tokens > have * self.block_size:
                if hit:
                    self.tier.release(hit.handle)
                hit, tier_name = again, "peer"
            elif again:
                self.tier.release(again.handle)
        return self._answer(root, tokens, owner, hit, tier_name, have * self.block_size, peer_bytes, warmup)

    def _answer(self, root: KeyRoot, tokens: np.ndarray, owner: object, hit: TierHit | None,
                tier_name: str | None, dram_tokens: int, peer_bytes: int,
                warmup: bool = False) -> LookupAnswer | None:
        """Count the lookup and hand out its hit (pinned, owned by `owner`)."""
        matched = hit.matched_tokens if hit else 0
        if tier_name == "dram":
            dram_tokens = matched
        block_bytes = self.tier.block_bytes
        if warmup:
            self._count_warmup(len(tokens), matched)
        else:
            self.metrics.lookup(root.tenant, len(tokens), tier_name, matched, peer_bytes,
                                served_bytes=matched // self.block_size * block_bytes,
                                dram_tokens=dram_tokens, token_bytes=block_bytes // self.block_size)
        if not hit:
            return None
        hit_id = next(self._ids)
        self._hits[hit_id] = hit
        self._hit_owners[hit_id] = owner
        return LookupAnswer(hit_id, matched, hit.slots, tier_name or "dram", dram_tokens)

    def _count_warmup(self, prompt_tokens: int, matched_tokens: int) -> None:
        """A warm-up lookup: its own counters (`kvtier_warmup_lookups_total`,
        `kvtier_warmup_tokens_total{result}`), none of the traffic's (the tenants'
        lookups and hits: `kvtier_lookups_total`, `/cache/stats` "lookups", what the
        hit-rate alarm's sample size and the rollout's recovery check read)."""
        self.counters.add(Count.WARMUP_LOOKUPS)
        self.counters.add(Count.WARMUP_TOKENS_HIT, matched_tokens)
        self.counters.add(Count.WARMUP_TOKENS_MISS, prompt_tokens - matched_tokens)

    def release(self, hit_id: int, owner: object = None) -> bool:
        """Unpin a hit; only the connection that looked it up may (OwnershipError)."""
        if hit_id in self._hits and self._hit_owners.get(hit_id) is not owner:
            raise OwnershipError(f"hit {hit_id} belongs to another engine connection")
        hit = self._hits.pop(hit_id, None)
        self._hit_owners.pop(hit_id, None)
        if hit is None:
            return False
        self.tier.release(hit.handle)
        return True

    # -- stores -------------------------------------------------------------------------

    def store_begin(self, root: KeyRoot, tokens: np.ndarray, tp: int, rank: int,
                    owner: object = None) -> tuple[int, int, list[int]]:
        """(ticket, first_block, slots) for the engine to write; ticket 0: declined.
        All TP ranks of one prompt share a ticket, each rank from the connection that
        began it; it commits when every rank did (see store_tickets)."""
        return self.tickets.begin(root, tokens, tp, rank, owner)

    def store_commit(self, ticket_id: int, rank: int, owner: object = None) -> bool:
        step = self.tickets.commit_rank(TicketId(ticket_id), rank, owner)
        if step.unwritten_blocks:
            self.counters.add(Count.STORE_UNWRITTEN_BLOCKS, step.unwritten_blocks)
        if step.committed_blocks and step.ticket is not None:
            t = step.ticket
            self.counters.add(Count.STORED_BLOCKS, step.committed_blocks)
            self.counters.add(Count.STORED_BYTES, step.committed_blocks * self.tier.block_bytes)
            self.platform.mirror(t.root, t.tokens)
            self._after_store(t.root, t.tokens, t.reservation.first_block + step.committed_blocks,
                              t.reservation.slots)
        return step.ok

    def engine_report(self, report) -> None:
        """What only the engine knows (an `engine_proto.EngineReport`), into the counters."""
        self.counters.add(Count.ENGINE_LOADED_BYTES, report.loaded_bytes)
        self.counters.add(Count.ENGINE_LOAD_ERRORS, report.load_errors)
        for count, value in ((Count.ENGINE_LOADED_TOKENS_DRAM, report.loaded_tokens_dram),
                             (Count.ENGINE_LOADED_TOKENS_PEER, report.loaded_tokens_peer),
                             (Count.ENGINE_LOCAL_HIT_TOKENS, report.local_hit_tokens),
                             (Count.ENGINE_PROMPT_TOKENS, report.prompt_tokens),
                             (Count.ENGINE_LOOKUP_TIMEOUTS, report.lookup_timeouts),
                             (Count.ENGINE_BREAKER_TRIPS, report.breaker_trips)):
            if value:
                self.counters.add(count, value)

    def store_abort(self, ticket_id: int, owner: object = None) -> None:
        self.tickets.abort(TicketId(ticket_id), owner)

    def expire_tickets(self) -> int:
        return self.tickets.expire()

    def _after_store(self, root: KeyRoot, tokens: np.ndarray, n_blocks: int, slots: list[int]) -> None:
        """Off the request path: hash the new blocks for peer serving, then advertise
        them in the global index."""
        def work() -> None:
            self.tier.compute_digests(slots)
            if self.index is not None:
                self._register(root, tokens, n_blocks)
        if self._loop is None:
            work()
        else:
            self.fetcher.submit(work)

    def _register(self, root: KeyRoot, tokens: np.ndarray, n_blocks: int) -> None:
        """Queue the blocks' hashes for the global index (written in the background)."""
        hashes = block_hashes(root, tokens[: n_blocks * self.block_size], self.block_size)
        args = (root.digest().hex(), [h.hex() for h in hashes])
        if self._loop is not None and threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self.index.register, *args)
        else:
            self.index.register(*args)

    # -- control ------------------------------------------------------------------------

    def stats(self, tenant: str | None) -> api.TenantStats:
        """Built with the answers' constructors: a figure computed here that the model
        has no field for is an error, never silently left out."""
        self.last_control_s = time.monotonic()
        counters = self.metrics.tenants.get(tenant) if tenant else self.metrics.total()
        own = {**(counters or metrics_mod.TenantCounters()).as_dict(), "tenant": tenant,
               "cache": api.CacheReport(**self.tier.stats(tenant))}
        if tenant is not None:
            return api.TenantStats(**own)
        listed, total = self._tenant_summary(self.config.stats_max_tenants)
        return api.SidecarStats(
            **own, sidecar=self.counters.snapshot(), index=self._index_state(),
            tenants=listed, tenants_total=total, peer_enabled=self.transport is not None,
            thrash_ratio=self.config.thrash_ratio, draining=self.draining,
            nvme=api.NvmeReport(**self.nvme.report()) if self.nvme is not None else None,
            engine=self._engine_loads(),
        )

    def _engine_loads(self) -> api.EngineLoads:
        c = self.counters.snapshot()
        return api.EngineLoads(
            loaded_tokens_by_tier={t: c.get(f"engine_loaded_tokens_{t}", 0) for t in metrics_mod.TIERS},
            local_hit_tokens=c.get(Count.ENGINE_LOCAL_HIT_TOKENS, 0), prompt_tokens=c.get(Count.ENGINE_PROMPT_TOKENS, 0))

    def _tenant_summary(self, limit: int) -> tuple[dict[str, api.TenantSummary], int]:
        """The `limit` tenants holding the most bytes (then the most looked-up), and how
        many tenants there are in all. A tenant is known once it looked up, stored or
        was warmed here."""
        rows = []
        for name, c in self.metrics.tenants.copy().items():  # dict.copy: one step, safe off the loop
            cached = self.tier.stats(name)
            rows.append((name, cached["bytes_used"], c))
        rows.sort(key=lambda r: (-r[1], -r[2].lookups, r[0]))
        listed = {name: api.TenantSummary(bytes=nbytes, lookups=c.lookups, hits=sum(c.hits.values()),
                                          warmed_bytes=c.warmed_bytes)
                  for name, nbytes, c in rows[:limit]}
        return listed, len(rows)

    def _index_state(self) -> api.IndexState:
        if self.index is None:
            return api.IndexState(enabled=False)
        health = self.index.health()
        return api.IndexState(enabled=True, available=self.index.available, writable=self.index.writable,
                              reads=health["reads"], writes=health["writes"], pending_blocks=self.index.pending,
                              members=sorted(self.index.members), counters=dict(self.index.stats))

    def jobs(self) -> dict[api.JobId, api.Job]:
        self.last_control_s = time.monotonic()
        return self.jobs_registry.snapshot()

    def invalidate_version(self, version: str) -> api.JobId:
        async def run() -> dict[str, int]:
            dropped = self.tier.invalidate(lambda r: r.weights_version == version)
            self.counters.add(Count.INVALIDATED_BLOCKS, dropped)
            return {"dropped_blocks": dropped}
        return self.jobs_registry.spawn(api.JobKind.INVALIDATE, run())

    async def may_warm_from(self, peer: str) -> bool:
        """Warm-ups dial only this sidecar's own fleet: a peer listed in `warm_peers`, or
        a live member of the global index (written only by sidecars holding the Redis
        credentials). With neither configured the caller's word is all there is: the
        control API's authentication is then the only gate (see docs/SECURITY.md).
        Raises `global_index.MembershipUnknown` while the index cannot say."""
        if peer in self.config.warm_peers:
            return True
        if self.index is not None:
            return await self.index.is_member(peer)
        return not self.config.warm_peers

    def warm(self, tenant: str, peer: str, max_bytes: int, ref: str | None = None) -> tuple[api.JobId, bool]:
        """Start pulling `tenant`'s hot prefixes from `peer`; (job, started). A `ref`
        names the request: asking again with a ref this sidecar still remembers answers
        the first job instead of starting another (a restarted operator re-asks)."""
        if self.transport is None:
            raise PeerTierDisabled("the peer tier is disabled in this sidecar's config")
        known = self.jobs_registry.by_ref(ref, tenant=tenant, from_peer=peer, max_bytes=max_bytes)
        if known is not None:
            return known, False
        if self.jobs_registry.unfinished(api.JobKind.WARM) >= MAX_WARM_JOBS:
            self.counters.add(Count.WARM_REFUSED)
            raise QueueFull(f"{MAX_WARM_JOBS} warm-ups are already queued or running; retry later",
                            WARM_RETRY_AFTER_S)
        job = self.jobs_registry.spawn(api.JobKind.WARM, self._warm(tenant, peer, max_bytes), tenant=tenant,
                                       from_peer=peer, max_bytes=max_bytes, ref=ref, asks=1)
        return job, True

    async def _warm(self, tenant: str, peer: str, max_bytes: int) -> dict[str, int]:
        job_timer = asyncio.timeout_at(asyncio.get_running_loop().time() + WARM_JOB_DEADLINE_S)
        try:
            async with job_timer:
                async with self._warm_slots:
                    warmed = await self.fetcher.warm(tenant, peer, max_bytes, self.config.model.weights_version)
        except TimeoutError as exc:  # the job's deadline, or a peer socket's (socket.timeout is one too)
            if job_timer.expired():
                raise RuntimeError(f"deadline: not finished within {WARM_JOB_DEADLINE_S:.0f}s") from None
            raise RuntimeError(f"peer {peer} did not answer within peer_timeout_s={self.config.peer_timeout_s:g}s "
                               f"({exc or 'timed out'})") from None
        self.metrics.warmed(tenant, warmed.bytes)
        return {"prefixes": warmed.prefixes, "blocks": warmed.blocks, "bytes": warmed.bytes}

    def hot(self, tenant: str, max_tokens: int) -> api.HotPrompts:
        """`tenant`'s prefixes worth replaying on a new engine (`GET /cache/hot`):
        from this sidecar's own index, under this tenant's key roots only."""
        found = self.tier.hot_prompts(tenant, max_tokens)
        prefixes = [api.HotPrompt(token_ids=tokens.tolist(), frequency=round(f, 4))
                    for root, tokens, f in found if root.tenant == tenant]
        return api.HotPrompts(tenant=tenant, max_tokens=max_tokens, tokens=sum(len(p.token_ids) for p in prefixes),
                              prefixes=prefixes)

    def metrics_text(self, tenant_label: metrics_mod.TenantLabel | None = None) -> bytes:
        occ = self.tier.occupancy()
        state = metrics_mod.SidecarState(
            version=self.config.model.weights_version, bytes_used=occ["bytes_used"],
            capacity_bytes=occ["capacity_bytes"], reserved_blocks=occ["reserved_blocks"],
            evictions=occ["evictions"], admission_bar=occ["admission_bar"], thrashing=bool(occ["thrashing"]),
            pinned_hits=len(self._hits), index_up=None if self.index is None else self.index.available,
            index_errors={} if self.index is None else {
                k.removesuffix("_errors"): v for k, v in self.index.stats.items() if k.endswith("_errors")},
            counters={k: float(v) for k, v in self.counters.snapshot().items()},
            index_health={} if self.index is None else self.index.health(),
            index_pending_blocks=0 if self.index is None else self.index.pending,
        )
        return metrics_mod.render(self.metrics, self.config.metrics_top_tenants, state, tenant_label)

    def readiness(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining: leaving the fleet, still serving peers"
        return True, "serving the DRAM tier" + ("" if not self.index or self.index.available else "; global index unavailable")

    def apply_config(self, config: SidecarConfig) -> None:
        self.config = config
        if self.transport is not None:
            self.transport.timeout_s = config.peer_timeout_s
            self.transport.connect_timeout_s = config.peer_connect_timeout_s
        if self.index is not None:
            self.index.ttl_s = config.index_ttl_s
            self.index.timeout_s = config.index_lookup_timeout_s

    def start_drain(self) -> None:
        self.draining = True

    def finish_drain(self) -> bool:
        """The operator has warmed what it wanted from this pod; False when not draining."""
        if not self.draining:
            return False
        self.drain_done.set()
        return True

    def release_all(self, hit_ids, tickets, owner: object = None) -> None:
        """A connection went away: its pins and every store it joined (a TP group
        missing a rank can never complete)."""
        for h in list(hit_ids):
            self.release(h, owner)
        for t in list(tickets):
            self.store_abort(t, owner)

    def close(self) -> None:
        self.fetcher.close()
