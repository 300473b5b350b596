"""The sidecar's request logic: local tier first, then the global index and a peer.

    lookup(root, tokens)
      ├─ DRAM tier match by tokens (pins)            -> hit "dram"
      ├─ platform-owned prefix under the platform root (if configured)
      └─ still short of the prompt?  one Redis round trip: longest prefix a peer holds
           └─ fetch the missing blocks from that peer into reserved arena slots,
              commit the verified prefix, look up again   -> hit "peer"

Everything after the local match is best effort with a deadline: Redis down, a peer
gone, slow or lying (checksum), a full arena — each ends the attempt and the engine
gets whatever the local tier had. Nothing on this path raises for a fault.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from kvtier.keys import KeyRoot, block_hashes
from kvtier.sidecar_config import SidecarConfig

from . import metrics as metrics_mod
from .dram import DramTier, Reservation, TierHit
from .global_index import GlobalIndex
from .transport import PeerTransport

log = logging.getLogger("kvtier.sidecar.service")

# A multi-rank store whose ranks have not all committed by then is abandoned.
STORE_TICKET_TIMEOUT_S = 10.0
# Hosts tried per miss: the second covers a stale first answer; more only adds latency.
PEER_ATTEMPTS = 2
# Parallel peer fetches; each holds a thread blocked in recv_into.
FETCH_THREADS = 8
# Finished jobs kept for `GET /cache/jobs`: one epoch's warm-ups on one target fit.
MAX_JOBS_KEPT = 1000


class OwnershipError(ValueError):
    """An engine connection named a hit or store ticket it does not hold."""


class PeerTierDisabled(RuntimeError):
    """A peer operation asked of a sidecar whose config turned the peer tier off."""


@dataclass(slots=True)
class LookupAnswer:
    hit_id: int
    matched_tokens: int
    slots: list[int]
    tier: str


@dataclass(slots=True)
class StoreTicket:
    root: KeyRoot
    tokens: np.ndarray
    reservation: Reservation
    tp: int
    created_s: float
    ranks: dict[int, object]  # rank -> the engine connection that began it
    committed_ranks: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _Sink:
    """Reserves arena slots for a peer's blocks once the peer says how many."""

    tier: DramTier
    root: KeyRoot
    tokens: np.ndarray
    first_block: int
    reservation: Reservation | None = None

    def reserve(self, n_blocks: int) -> list[memoryview] | None:
        self.reservation = self.tier.reserve(self.root, self.tokens, self.first_block, n_blocks, admit=False)
        if self.reservation is None or len(self.reservation.slots) < n_blocks:
            return None
        return [self.tier.slot_view(s, 1) for s in self.reservation.slots]


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
        self.counters: collections.Counter = collections.Counter()
        self._hits: dict[int, TierHit] = {}
        self._hit_owners: dict[int, object] = {}  # hit -> the engine connection that holds it
        self._tickets: dict[int, StoreTicket] = {}
        self._ticket_keys: dict[tuple, int] = {}
        self._ids = itertools.count(1)
        self._fetch_pool = concurrent.futures.ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="peer-fetch")
        self._jobs: dict[str, dict] = {}
        self._job_refs: dict[str, str] = {}  # warm request ref -> job
        self.nvme = None  # an nvme_probe.NvmeProbe when the config measures a local disk
        self._background: set[asyncio.Task] = set()
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

    async def lookup(self, root: KeyRoot, tokens: np.ndarray, owner: object = None) -> LookupAnswer | None:
        hit = self.tier.lookup(root, tokens)
        tier_name = "dram" if hit else None
        peer_bytes = 0
        max_blocks = (len(tokens) - 1) // self.block_size  # rule 3: one token always computed
        have = hit.matched_tokens // self.block_size if hit else 0
        if have < max_blocks:
            platform = self._platform_hit(root, tokens, have)
            if platform is not None:
                if hit:
                    self.tier.release(hit.handle)
                hit, tier_name = platform, "dram"
                have = hit.matched_tokens // self.block_size
        if have < max_blocks and self.index is not None and self.transport is not None:
            fetched, peer_bytes = await self._from_peers(root, tokens, have, max_blocks)
            if fetched:
                again = self.tier.lookup(root, tokens)
                if again and again.matched_tokens > have * self.block_size:
                    if hit:
                        self.tier.release(hit.handle)
                    hit, tier_name = again, "peer"
                elif again:
                    self.tier.release(again.handle)
        self.metrics.lookup(root.tenant, len(tokens), tier_name, hit.matched_tokens if hit else 0, peer_bytes)
        if not hit:
            return None
        hit_id = next(self._ids)
        self._hits[hit_id] = hit
        self._hit_owners[hit_id] = owner
        return LookupAnswer(hit_id, hit.matched_tokens, hit.slots, tier_name or "dram")

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

    def _platform_hit(self, root: KeyRoot, tokens: np.ndarray, have: int) -> TierHit | None:
        """A platform-owned prefix (config) the prompt starts with, cached under the
        platform root: the only way one tenant's lookup touches blocks not its own."""
        prefix = self._platform_prefix(tokens)
        if prefix is None or len(prefix) // self.block_size <= have:
            return None
        platform_root = self._platform_root(root)
        # One extra token keeps the last-block rule from trimming the prefix itself.
        hit = self.tier.lookup(platform_root, tokens[: len(prefix) + 1])
        if hit and hit.matched_tokens // self.block_size <= have:
            self.tier.release(hit.handle)
            return None
        return hit

    def _platform_prefix(self, tokens: np.ndarray) -> np.ndarray | None:
        best = None
        for p in self.config.platform_prefixes:
            if len(p) >= self.block_size and len(tokens) > len(p) and np.array_equal(tokens[: len(p)], p):
                if best is None or len(p) > len(best):
                    best = np.asarray(p, dtype=np.uint32)
        return best

    def _platform_root(self, root: KeyRoot) -> KeyRoot:
        return KeyRoot(self.config.platform_tenant, root.model_id, root.weights_version, root.kv_dtype,
                       root.rope_config_hash, root.attn_impl_id)

    async def _from_peers(self, root: KeyRoot, tokens: np.ndarray, have: int, max_blocks: int) -> tuple[int, int]:
        """Fetch blocks [have, k) from the peer holding the longest prefix; (blocks, bytes)."""
        hashes = block_hashes(root, tokens[: max_blocks * self.block_size], self.block_size)
        answer = await self.index.longest_prefix(root.digest().hex(), [h.hex() for h in hashes])
        if answer is None or answer.matched_blocks <= have:
            return 0, 0
        want = answer.matched_blocks
        loop = asyncio.get_running_loop()
        for host in answer.hosts[:PEER_ATTEMPTS]:
            try:
                blocks, nbytes = await loop.run_in_executor(
                    self._fetch_pool, self._fetch_blocking, host, root, tokens[: want * self.block_size], have, want)
            except Exception:  # a bug in the fetch path must still be a miss
                log.exception("peer fetch failed", extra={"peer": host})
                blocks, nbytes = 0, 0
            if blocks:
                return blocks, nbytes
            self.index.forget_member(host)
        return 0, 0

    def _fetch_blocking(self, host: str, root: KeyRoot, tokens: np.ndarray, have: int, want: int) -> tuple[int, int]:
        sink = _Sink(self.tier, root, tokens, have)
        outcome = self.transport.fetch(host, root, tokens, self.block_size, self.tier.block_bytes, sink,
                                       max_blocks=want, skip_blocks=have)
        self.counters["peer_fetches"] += 1
        if outcome.error:
            self.counters["peer_fetch_errors"] += 1
            log.info("peer fetch ended early", extra={"peer": host, "reason": outcome.error,
                                                       "verified_blocks": outcome.verified_blocks})
        if outcome.error == "checksum mismatch":
            self.counters["peer_checksum_mismatches"] += 1
        res = sink.reservation
        if res is None:
            return 0, 0
        committed = self.tier.commit(res, outcome.verified_blocks, outcome.digests)  # 0 verified: aborts
        self.counters["peer_bytes_fetched"] += outcome.verified_blocks * self.tier.block_bytes
        if committed and self.index is not None:
            self._register(root, tokens, have + committed)
        return committed, outcome.verified_blocks * self.tier.block_bytes

    # -- stores -------------------------------------------------------------------------

    def store_begin(self, root: KeyRoot, tokens: np.ndarray, tp: int, rank: int,
                    owner: object = None) -> tuple[int, int, list[int]]:
        """(ticket, first_block, slots) for the engine to write; ticket 0: declined.
        All TP ranks of one prompt share a ticket, each rank joining from its own
        connection (`owner`); it commits when every rank committed what it wrote."""
        if tp < 1 or not (0 <= rank < tp) or self.tier.kv_heads % tp:
            raise ValueError(f"tp={tp} rank={rank} does not divide {self.tier.kv_heads} kv heads")
        key = (root, tokens.tobytes(), tp)
        ticket_id = self._ticket_keys.get(key)
        if ticket_id is not None and ticket_id in self._tickets:
            t = self._tickets[ticket_id]
            if t.ranks.setdefault(rank, owner) is not owner:
                raise OwnershipError(f"rank {rank} of this store was begun by another engine connection")
            return ticket_id, t.reservation.first_block, t.reservation.slots
        reservation = self.tier.reserve(root, tokens, None, None, admit=True)
        self.metrics.store(root.tenant, reservation is not None)
        if reservation is None:
            return 0, 0, []
        ticket_id = next(self._ids)
        self._tickets[ticket_id] = StoreTicket(root, tokens.copy(), reservation, tp, time.monotonic(), {rank: owner})
        self._ticket_keys[key] = ticket_id
        return ticket_id, reservation.first_block, reservation.slots

    def store_commit(self, ticket_id: int, rank: int, owner: object = None) -> bool:
        """Rank `rank` wrote its shard. The blocks are published only once every rank
        0..tp-1 committed, each from the connection that began it (OwnershipError
        otherwise, and nothing changes)."""
        t = self._tickets.get(ticket_id)
        if t is None:
            return False
        if rank not in t.ranks or t.ranks[rank] is not owner:
            raise OwnershipError(f"ticket {ticket_id} rank {rank} was not begun by this engine connection")
        t.committed_ranks.add(rank)
        if t.committed_ranks != set(range(t.tp)):
            return True
        self._forget_ticket(ticket_id)
        committed = self.tier.commit(t.reservation, len(t.reservation.slots))
        if committed:
            self.counters["stored_blocks"] += committed
            self._copy_platform_prefix(t)
            self._after_store(t.root, t.tokens, t.reservation.first_block + committed, t.reservation.slots)
        return committed > 0

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
            self._fetch_pool.submit(work)

    def store_abort(self, ticket_id: int, owner: object = None, expired: bool = False) -> None:
        """Give up a store: a connection that joined it, or the expiry sweep."""
        t = self._tickets.get(ticket_id)
        if t is not None and not expired and not any(o is owner for o in t.ranks.values()):
            raise OwnershipError(f"ticket {ticket_id} belongs to another engine connection")
        if t is not None:
            self._forget_ticket(ticket_id)
            self.tier.abort(t.reservation)

    def _forget_ticket(self, ticket_id: int) -> None:
        t = self._tickets.pop(ticket_id)
        self._ticket_keys.pop((t.root, t.tokens.tobytes(), t.tp), None)

    def expire_tickets(self) -> int:
        now = time.monotonic()
        stale = [tid for tid, t in self._tickets.items() if now - t.created_s > STORE_TICKET_TIMEOUT_S]
        for tid in stale:
            self.store_abort(tid, expired=True)
        return len(stale)

    def _copy_platform_prefix(self, t: StoreTicket) -> None:
        """Mirror a configured platform prefix under the platform root (memcpy in the arena)."""
        prefix = self._platform_prefix(t.tokens)
        if prefix is None or t.root.tenant == self.config.platform_tenant:
            return
        n = len(prefix) // self.block_size
        src = self.tier.lookup(t.root, t.tokens[: n * self.block_size + 1])
        if not src:
            return
        try:
            if src.matched_tokens < n * self.block_size:
                return
            proot = self._platform_root(t.root)
            res = self.tier.reserve(proot, t.tokens[: n * self.block_size], None, None, admit=False)
            if res is None:
                return
            for i, slot in enumerate(res.slots):
                self.tier.slot_array(slot)[:] = self.tier.slot_array(src.slots[res.first_block + i])
            self.tier.commit(res, len(res.slots))
        finally:
            self.tier.release(src.handle)

    def _register(self, root: KeyRoot, tokens: np.ndarray, n_blocks: int) -> None:
        """Queue the blocks' hashes for the global index (written in the background)."""
        hashes = block_hashes(root, tokens[: n_blocks * self.block_size], self.block_size)
        args = (root.digest().hex(), [h.hex() for h in hashes])
        if self._loop is not None and threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self.index.register, *args)
        else:
            self.index.register(*args)

    # -- control ------------------------------------------------------------------------

    def stats(self, tenant: str | None) -> dict:
        self.last_control_s = time.monotonic()
        counters = self.metrics.tenants.get(tenant) if tenant else self.metrics.total()
        out = (counters or metrics_mod.TenantCounters()).as_dict()
        out["tenant"] = tenant
        out["cache"] = self.tier.stats(tenant)
        if tenant is None:
            out["sidecar"] = dict(self.counters)
            out["index"] = self._index_state()
            out["tenants"], out["tenants_total"] = self._tenant_summary(self.config.stats_max_tenants)
            out["peer_enabled"] = self.transport is not None
            out["thrash_ratio"] = self.config.thrash_ratio
            out["draining"] = self.draining
            if self.nvme is not None:
                out["nvme"] = self.nvme.report()
        return out

    def _tenant_summary(self, limit: int) -> tuple[dict[str, dict], int]:
        """{tenant: bytes held here, lookups, hits} for the `limit` tenants holding the
        most bytes (then the most looked-up), and how many tenants there are in all.
        A tenant is known once it looked up, stored or was warmed here."""
        rows = []
        for name, c in list(self.metrics.tenants.items()):
            cached = self.tier.stats(name)
            rows.append((name, cached["bytes_used"], c))
        rows.sort(key=lambda r: (-r[1], -r[2].lookups, r[0]))
        listed = {name: {"bytes": nbytes, "lookups": c.lookups, "hits": sum(c.hits.values()),
                         "warmed_bytes": c.warmed_bytes}
                  for name, nbytes, c in rows[:limit]}
        return listed, len(rows)

    def _index_state(self) -> dict:
        if self.index is None:
            return {"enabled": False}
        return {"enabled": True, "available": self.index.available, "pending_blocks": self.index.pending,
                **dict(self.index.stats)}

    def _spawn(self, name: str, coro, **about) -> str:
        """Run `coro` in the background as a job; its record (wall-clock `started_s`,
        `finished_s`, and what it was about) is what `GET /cache/jobs` shows."""
        job = f"{name}-{next(self._ids)}"
        self._jobs[job] = {"state": "running", "kind": name, **about, "started_s": time.time(), "finished_s": None}
        task = asyncio.get_running_loop().create_task(self._run_job(job, coro))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return job

    async def _run_job(self, job: str, coro) -> None:
        record = self._jobs[job]
        try:
            result = await coro
            record.update(state="done", result=result, bytes=result.get("bytes", 0))
        except Exception as exc:  # a failed job is reported, not raised
            log.exception("job failed", extra={"job": job})
            record.update(state="failed", error=str(exc))
        record["finished_s"] = time.time()
        while len(self._jobs) > MAX_JOBS_KEPT:
            old = self._jobs.pop(next(iter(self._jobs)))
            if old.get("ref"):
                self._job_refs.pop(old["ref"], None)

    def jobs(self) -> dict:
        self.last_control_s = time.monotonic()
        return {job: dict(record) for job, record in self._jobs.items()}

    def invalidate_version(self, version: str) -> str:
        async def run() -> dict:
            dropped = self.tier.invalidate(lambda r: r.weights_version == version)
            self.counters["invalidated_blocks"] += dropped
            return {"dropped_blocks": dropped}
        return self._spawn("invalidate", run())

    async def may_warm_from(self, peer: str) -> bool:
        """Warm-ups dial only this sidecar's own fleet: a peer listed in `warm_peers`, or
        a live member of the global index (written only by sidecars holding the Redis
        credentials). With neither configured the caller's word is all there is: the
        control API's authentication is then the only gate (see docs/SECURITY.md)."""
        if peer in self.config.warm_peers:
            return True
        if self.index is not None:
            return await self.index.is_member(peer)
        return not self.config.warm_peers

    def warm(self, tenant: str, peer: str, max_bytes: int, ref: str | None = None) -> tuple[str, bool]:
        """Start pulling `tenant`'s hot prefixes from `peer`; (job, started). A `ref`
        names the request: asking again with a ref this sidecar still remembers answers
        the first job instead of starting another (a restarted operator re-asks)."""
        if self.transport is None:
            raise PeerTierDisabled("the peer tier is disabled in this sidecar's config")
        if ref is not None and ref in self._job_refs:
            job = self._job_refs[ref]
            self._jobs[job]["asks"] += 1
            return job, False
        job = self._spawn("warm", self._warm(tenant, peer, max_bytes), tenant=tenant, from_peer=peer,
                          max_bytes=max_bytes, ref=ref, asks=1)
        if ref is not None:
            self._job_refs[ref] = job
        return job, True

    async def _warm(self, tenant: str, peer: str, max_bytes: int) -> dict:
        loop = asyncio.get_running_loop()
        hot = await loop.run_in_executor(self._fetch_pool, self.transport.hot_prefixes, peer, tenant, max_bytes)
        moved = 0
        blocks = 0
        serving = self.config.model.weights_version
        for root, tokens in hot.prefixes:
            # Only what this pod's engine can use: during a rollout the old home still
            # holds the previous weights version's prefixes, which would only take room.
            if root.tenant != tenant or root.weights_version != serving or moved >= max_bytes:
                continue
            n = len(tokens) // self.block_size
            have_hit = self.tier.lookup(root, np.append(tokens, 0).astype(np.uint32))
            have = have_hit.matched_tokens // self.block_size if have_hit else 0
            try:
                if have >= n:
                    continue
                got, nbytes = await loop.run_in_executor(
                    self._fetch_pool, self._fetch_blocking, peer, root, tokens[: n * self.block_size], have, n)
                blocks += got
                moved += nbytes
            finally:
                if have_hit:
                    self.tier.release(have_hit.handle)
        self.counters["warmed_blocks"] += blocks
        self.metrics.warmed(tenant, moved)
        return {"prefixes": len(hot.prefixes), "blocks": blocks, "bytes": moved}

    def metrics_text(self) -> bytes:
        gauges = {f"dram_{k}": float(v) for k, v in self.tier.occupancy().items()}
        gauges["index_available"] = float(bool(self.index and self.index.available))
        gauges["pinned_hits"] = float(len(self._hits))
        counters = {k: float(v) for k, v in self.counters.items()}
        return metrics_mod.render(self.metrics, self.config.metrics_top_tenants, gauges, counters)

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
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)
