"""Pulling blocks from a peer into this sidecar's arena: on a lookup's miss (the
global index names the peer) and for the operator's warm-ups.

The fetcher owns three bounded thread pools (a fetch blocks a thread in `recv_into`),
so one kind of work never starves another: request-path fetches (an engine is
waiting), warm-up jobs (the operator's background pulls) and index writes after a
store. A flood of warm-ups toward a stalled peer fills only the warm pool; engine
lookups keep their own threads. It counts into the thread-safe `Counters`. Every fault — no answer, a short or lying peer, a
full arena — commits only the verified prefix, or nothing: rule: fault-is-a-miss.

A slow peer costs its own requests a miss, never anyone else's: every request-path
fetch ends by one deadline (`peer_timeout_s` from the lookup's ask, time queued for a
thread included), and no one peer holds more than `MAX_FETCHES_PER_PEER` of the
request-path threads; a lookup that would wait for a third is a miss at once.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtier.keys import KeyRoot, block_hashes

from .counters import Count, Counters
from .dram import DramTier, Reservation
from .global_index import GlobalIndex
from .transport import CHECKSUM_MISMATCH, RECORD_AUTH_FAILED, PeerTransport

log = logging.getLogger("kvtier.sidecar.peer_fetch")

# Hosts tried per miss: the second covers a stale first answer; more only adds latency.
PEER_ATTEMPTS = 2
# Parallel request-path peer fetches; each holds a thread blocked in recv_into.
FETCH_THREADS = 8
# Request-path fetches one peer may have in flight: a peer that stalls or trickles
# ties up at most half the threads until their deadline; the rest serve other peers.
MAX_FETCHES_PER_PEER = FETCH_THREADS // 2
# Parallel warm-up fetches: background work, so few; a stalled peer ties up only these.
WARM_THREADS = 2
# After-store work (digests, index registration): short and CPU-bound, one thread.
BACKGROUND_THREADS = 1
# The failures a transport reports for bad bytes (counted apart: a peer serving them).
BAD_BYTES = frozenset({CHECKSUM_MISMATCH, RECORD_AUTH_FAILED})

# Advertise (root, tokens, first n blocks) in the global index; safe from any thread.
Register = Callable[[KeyRoot, np.ndarray, int], None]


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


@dataclass(frozen=True, slots=True)
class Warmed:
    prefixes: int
    blocks: int
    bytes: int


class PeerFetcher:
    def __init__(self, tier: DramTier, index: GlobalIndex | None, transport: PeerTransport | None,
                 counters: Counters, register: Register) -> None:
        self.tier = tier
        self.index = index
        self.transport = transport
        self.counters = counters
        self.register = register
        self.block_size = tier.block_size
        self.pool = concurrent.futures.ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="peer-fetch")
        self.warm_pool = concurrent.futures.ThreadPoolExecutor(WARM_THREADS, thread_name_prefix="peer-warm")
        self.background_pool = concurrent.futures.ThreadPoolExecutor(BACKGROUND_THREADS, thread_name_prefix="after-store")
        # Request-path fetches in flight per peer (event-loop thread only); a peer's
        # entry lives while it has one, so at most FETCH_THREADS plus those queued.
        self._in_flight: collections.Counter[str] = collections.Counter()

    async def from_peers(self, root: KeyRoot, tokens: np.ndarray, have: int, max_blocks: int,
                         beyond: int = 0, hinted: str | None = None) -> tuple[int, int]:
        """Fetch blocks [have, k) from the peer holding the longest prefix, when k is
        more than `beyond` (the blocks the engine holds itself); (blocks, bytes).

        `hinted`: a member of this fleet a router named as holding the prefix
        (`peer_hint`), asked first for every block the prompt may match; the index is
        asked only when it served none, and then never for that peer again if it failed."""
        if self.transport is None:
            return 0, 0
        failed = None
        if hinted is not None:
            blocks, nbytes, answered = await self._from_hinted(hinted, root, tokens, have, max_blocks)
            if blocks:
                return blocks, nbytes
            if not answered:
                failed = hinted
        if self.index is None:
            return 0, 0
        hashes = block_hashes(root, tokens[: max_blocks * self.block_size], self.block_size)
        answer = await self.index.longest_prefix(root.digest().hex(), [h.hex() for h in hashes])
        if answer is None or answer.matched_blocks <= max(have, beyond):
            return 0, 0
        want = answer.matched_blocks
        for host in answer.hosts[:PEER_ATTEMPTS]:
            if host == failed:
                continue  # it just failed this very fetch
            if self._in_flight[host] >= MAX_FETCHES_PER_PEER:
                self.counters.add(Count.PEER_FETCHES_SHED)  # busy or slow: not worth a wait
                continue
            try:
                blocks, nbytes = await self.fetch(host, root, tokens[: want * self.block_size], have, want)
            except Exception:  # a bug in the fetch path must still be a miss
                log.exception("peer fetch failed", extra={"peer": host})
                blocks, nbytes = 0, 0
            if blocks:
                return blocks, nbytes
            self.index.forget_member(host)
        return 0, 0

    async def _from_hinted(self, host: str, root: KeyRoot, tokens: np.ndarray, have: int,
                           max_blocks: int) -> tuple[int, int, bool]:
        """(blocks, bytes, answered) of asking the hinted peer for blocks [have,
        max_blocks): no index round trip, so it may hold fewer (it sends what it has).
        `answered` is False when the fetch failed (the peer is forgotten as any failed
        peer is); each outcome is counted."""
        if self._in_flight[host] >= MAX_FETCHES_PER_PEER:
            self.counters.add(Count.PEER_FETCHES_SHED)
            self.counters.add(Count.PEER_HINT_FAILED)
            return 0, 0, False
        try:
            blocks, nbytes, error = await self._fetch(host, root, tokens[: max_blocks * self.block_size], have,
                                                      max_blocks)
        except Exception:  # a bug in the fetch path must still be a miss
            log.exception("hinted peer fetch failed", extra={"peer": host})
            blocks, nbytes, error = 0, 0, "fault"
        if blocks:  # verified blocks, even when the rest failed
            self.counters.add(Count.PEER_HINT_USED)
            return blocks, nbytes, True
        if error:
            self.counters.add(Count.PEER_HINT_FAILED)
            if self.index is not None:
                self.index.forget_member(host)
            return 0, 0, False
        self.counters.add(Count.PEER_HINT_MISS)
        return 0, 0, True

    async def fetch(self, host: str, root: KeyRoot, tokens: np.ndarray, have: int, want: int,
                    pool: concurrent.futures.Executor | None = None) -> tuple[int, int]:
        """Blocks [have, want) from `host`; (blocks, bytes). A request-path fetch (no
        `pool`) ends by a deadline set now; a warm-up's starts when it gets a thread."""
        blocks, nbytes, _ = await self._fetch(host, root, tokens, have, want, pool)
        return blocks, nbytes

    async def _fetch(self, host: str, root: KeyRoot, tokens: np.ndarray, have: int, want: int,
                     pool: concurrent.futures.Executor | None = None) -> tuple[int, int, str | None]:
        """`fetch`, and why the transfer stopped early (None: it did not)."""
        loop = asyncio.get_running_loop()
        if pool is not None:
            return await loop.run_in_executor(pool, self._fetch_blocking, host, root, tokens, have, want, None)
        deadline = time.monotonic() + self.transport.timeout_s
        self._in_flight[host] += 1
        try:
            return await loop.run_in_executor(self.pool, self._fetch_blocking, host, root, tokens, have, want,
                                              deadline)
        finally:
            self._in_flight[host] -= 1
            if not self._in_flight[host]:
                del self._in_flight[host]

    def _fetch_blocking(self, host: str, root: KeyRoot, tokens: np.ndarray, have: int, want: int,
                        deadline: float | None) -> tuple[int, int, str | None]:
        if deadline is not None and time.monotonic() >= deadline:  # it waited its whole deadline for a thread
            self.counters.add(Count.PEER_FETCH_ERRORS)
            return 0, 0, "deadline"
        sink = _Sink(self.tier, root, tokens, have)
        outcome = self.transport.fetch(host, root, tokens, self.block_size, self.tier.block_bytes, sink,
                                       max_blocks=want, skip_blocks=have, deadline=deadline)
        self.counters.add(Count.PEER_FETCHES)
        if outcome.error:
            self.counters.add(Count.PEER_FETCH_ERRORS)
            log.info("peer fetch ended early", extra={"peer": host, "reason": outcome.error,
                                                       "verified_blocks": outcome.verified_blocks})
        if outcome.error in BAD_BYTES:
            self.counters.add(Count.PEER_CHECKSUM_MISMATCHES)
        res = sink.reservation
        if res is None:
            return 0, 0, outcome.error
        committed = self.tier.commit(res, outcome.verified_blocks, outcome.digests)  # 0 verified: aborts
        self.counters.add(Count.PEER_BYTES_FETCHED, outcome.verified_blocks * self.tier.block_bytes)
        if committed and self.index is not None:
            self.register(root, tokens, have + committed)
        return committed, outcome.verified_blocks * self.tier.block_bytes, outcome.error

    async def warm(self, tenant: str, peer: str, max_bytes: int, serving_version: str) -> Warmed:
        """Pull `tenant`'s hottest prefixes from `peer`, up to `max_bytes`, skipping
        what this arena already holds."""
        assert self.transport is not None, "warm-ups need the peer tier (the sidecar checks)"
        loop = asyncio.get_running_loop()
        hot = await loop.run_in_executor(self.warm_pool, self.transport.hot_prefixes, peer, tenant, max_bytes)
        moved = 0
        blocks = 0
        for root, tokens in hot.prefixes:
            # Only what this pod's engine can use: during a rollout the old home still
            # holds the previous weights version's prefixes, which would only take room.
            if root.tenant != tenant or root.weights_version != serving_version or moved >= max_bytes:
                continue
            n = len(tokens) // self.block_size
            have_hit = self.tier.lookup(root, np.append(tokens, 0).astype(np.uint32))
            have = have_hit.matched_tokens // self.block_size if have_hit else 0
            try:
                if have >= n:
                    continue
                got, nbytes = await self.fetch(peer, root, tokens[: n * self.block_size], have, n, self.warm_pool)
                blocks += got
                moved += nbytes
            finally:
                if have_hit:
                    self.tier.release(have_hit.handle)
        self.counters.add(Count.WARMED_BLOCKS, blocks)
        return Warmed(len(hot.prefixes), blocks, moved)

    def submit(self, work: Callable[[], None]) -> None:
        """Run `work` on the after-store pool, off the request path."""
        self.background_pool.submit(work)

    def close(self) -> None:
        for pool in (self.pool, self.warm_pool, self.background_pool):
            pool.shutdown(wait=False, cancel_futures=True)
