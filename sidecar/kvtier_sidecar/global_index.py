"""The global index in Redis: which hosts hold which chained block hashes.

Key schema (all keys of one key root share a hash tag, so one Lua call can read them
all on a single Redis Cluster shard):

    {prefix}:{<root tag>}:<block hash hex>   HASH  host -> expiry (unix s); key TTL
    {prefix}:members                          ZSET  host -> heartbeat expiry (unix s)

`longest_prefix` sends every block hash of the prompt in ONE round trip (EVALSHA);
the script walks the chain from block 0 and keeps the hosts that hold every block so
far, so the answer is the longest prefix one host holds. Per-host expiries live in
the hash fields because one host refreshing a key must not keep another's stale entry
alive. The index is a hint: a stale entry costs a fetch that comes back short, never
wrong KV (the peer matches by tokens).

Faults never reach the caller, and they are per operation (`redis_health`): reads
and writes each have a circuit breaker with backoff. A dead server opens both (lookups
answer "nothing" at once); out of memory, a READONLY replica or a slot on the move
opens only the one that saw it, so lookups keep answering while registrations and
heartbeats wait in a bounded queue and resume when writes are accepted again. The
state of each (`ok`, `unreachable`, `oom`, `readonly`, `moved`, `error`) is in stats
and /metrics.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Iterable

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from .redis_health import BACKOFF_MAX_S, Breaker, Health, classify, opens_both

log = logging.getLogger("kvtier.sidecar.index")

# Registrations buffered while Redis is away; beyond this the oldest are dropped
# (they are hints, and the next store of a hot prefix registers it again).
MAX_PENDING_REGISTRATIONS = 10_000
# Hashes per pipeline flush: 125 blocks is one 2,000-token prompt.
FLUSH_BATCH_BLOCKS = 4_000
# Remembered registrations to withdraw at shutdown; beyond this, TTL cleans up.
MAX_REMEMBERED_KEYS = 1_000_000
# Socket and connect timeout for Redis: long enough for a loaded Redis to answer a
# background write, while request-path calls are cut far sooner by their own deadline.
SOCKET_TIMEOUT_FLOOR_S = 0.5
HEARTBEAT_S = 2.0
# A warm-up's membership check is on the control path, not a lookup's: a second is fine.
MEMBERSHIP_CHECK_TIMEOUT_S = 1.0
# A member is live while its heartbeat is younger than this.
MEMBER_TTL_S = 3 * HEARTBEAT_S
# A member set this young (since this host last found itself missing from it: its first
# join, or a Redis that lost its data) may still lack live members: each heartbeats
# within its period plus the longest backoff after an outage. Until then a "no" is
# not yet a no.
MEMBER_SET_SETTLE_S = MEMBER_TTL_S + BACKOFF_MAX_S
# Whole seconds (an HTTP Retry-After) to ask again after a membership check Redis could
# not answer: about one heartbeat, by which a returned Redis knows its members again.
MEMBERSHIP_RETRY_AFTER_S = math.ceil(HEARTBEAT_S)


class MembershipUnknown(RuntimeError):
    """Redis cannot say now whether a host is a member (unreachable, timed out): neither
    a yes nor a no, so the caller asks again later instead of refusing for good."""


# `no-writes`: the lookup runs on a READONLY replica and while Redis is out of memory.
LONGEST_PREFIX_LUA = """#!lua flags=no-writes
local now = tonumber(ARGV[1])
local me = ARGV[2]
local cand = nil
local best = 0
for i, key in ipairs(KEYS) do
  local flat = redis.call('HGETALL', key)
  local present = {}
  local any = false
  for j = 1, #flat, 2 do
    local host = flat[j]
    if host ~= me and tonumber(flat[j + 1]) >= now and (cand == nil or cand[host]) then
      present[host] = true
      any = true
    end
  end
  if not any then break end
  cand = present
  best = i
end
local out = {best}
if cand then
  for host, _ in pairs(cand) do table.insert(out, host) end
end
return out
"""
# Redis names a script by the SHA-1 of its text, so the client knows it without asking.
LONGEST_PREFIX_SHA = hashlib.sha1(LONGEST_PREFIX_LUA.encode()).hexdigest()


@dataclass(slots=True)
class IndexAnswer:
    """`matched_blocks` leading blocks of the prompt are held by each of `hosts`."""

    matched_blocks: int
    hosts: list[str]


class GlobalIndex:
    def __init__(self, url: str, host: str, prefix: str = "kvt", ttl_s: int = 600,
                 timeout_s: float = 0.05, cluster: bool = False, socket_timeout_s: float | None = None) -> None:
        self.host = host
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        # What one socket operation may wait; a request-path call never waits this long
        # (it is cut at `timeout_s` by wait_for).
        self.socket_timeout_s = socket_timeout_s or max(timeout_s, SOCKET_TIMEOUT_FLOOR_S)
        kwargs = dict(socket_timeout=self.socket_timeout_s, socket_connect_timeout=SOCKET_TIMEOUT_FLOOR_S)
        if cluster:
            # No retry_on_timeout here: the cluster client rejects it (it retries
            # through its own Retry object, and every call is bounded by wait_for).
            # Partial coverage is fine: while one shard is down the roots hashed to
            # the others keep answering.
            self.redis = aioredis.RedisCluster.from_url(url, require_full_coverage=False, **kwargs)
        else:
            self.redis = aioredis.Redis.from_url(url, retry_on_timeout=False, **kwargs)
        self._pending: collections.deque[tuple[str, list[str]]] = collections.deque(maxlen=MAX_PENDING_REGISTRATIONS)
        self._remembered: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._wake = asyncio.Event()
        self.reads = Breaker()
        self.writes = Breaker()
        self._members: set[str] = set()
        # True once a heartbeat has written our member entry: from then on a missing
        # entry means Redis lost its data, and the remembered blocks are written again.
        self._joined = False
        self._joined_at: float | None = None  # monotonic: when this host last (re)entered the member set
        self._tasks: list[asyncio.Task] = []
        self.stats = collections.Counter()

    # -- keys ---------------------------------------------------------------------------

    def block_key(self, root_tag: str, block_hash_hex: str) -> str:
        return f"{self.prefix}:{{{root_tag}}}:{block_hash_hex}"

    @property
    def members_key(self) -> str:
        return f"{self.prefix}:members"

    # -- health -------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Lookups are attempted (the read breaker is closed or due for a retry)."""
        return self.reads.allows(time.monotonic())

    @property
    def writable(self) -> bool:
        return self.writes.allows(time.monotonic())

    def _failed(self, what: str, exc: BaseException, breaker: Breaker) -> None:
        health = classify(exc)
        self.stats[f"{what}_errors"] += 1
        self.stats[f"{what}_errors_{health.value}"] += 1
        now = time.monotonic()
        wait = breaker.failed(health, now)
        if opens_both(health):
            other = self.writes if breaker is self.reads else self.reads
            other.failed(health, now)
        log.warning("redis %s failed (%s: %s); %s paused for %.2fs", what, health.value,
                    exc.__class__.__name__, "reads and writes" if opens_both(health) else
                    ("reads" if breaker is self.reads else "writes"), wait)

    def health(self) -> dict:
        """{reads, writes}: each `ok` or the failure that paused it."""
        return {"reads": self.reads.state.value, "writes": self.writes.state.value}

    # -- lookup -------------------------------------------------------------------------

    async def longest_prefix(self, root_tag: str, block_hashes_hex: list[str]) -> IndexAnswer | None:
        """Longest prefix of `block_hashes_hex` some live peer holds, in one round trip;
        None when nobody does or the index is unavailable (a miss, never an error)."""
        if not block_hashes_hex or not self.available:
            return None
        keys = [self.block_key(root_tag, h) for h in block_hashes_hex]
        try:
            raw = await asyncio.wait_for(self._eval(keys), self.timeout_s)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self._failed("lookup", exc, self.reads)
            return None
        self._read_ok()
        self.stats["lookups"] += 1
        matched = int(raw[0])
        hosts = [h.decode() if isinstance(h, bytes) else str(h) for h in raw[1:]]
        if self._members:
            hosts = [h for h in hosts if h in self._members]
        if matched == 0 or not hosts:
            return None
        random.shuffle(hosts)
        return IndexAnswer(matched, hosts)

    async def _eval(self, keys: list[str]) -> list:
        args = [int(time.time()), self.host]
        try:
            return await self.redis.evalsha(LONGEST_PREFIX_SHA, len(keys), *keys, *args)
        except NoScriptError:
            # First call on this node, or it restarted and lost its script cache. EVAL
            # runs and caches the script on the node owning these keys' slot only;
            # SCRIPT LOAD would go to every cluster primary and fail while any is down.
            return await self.redis.eval(LONGEST_PREFIX_LUA, len(keys), *keys, *args)

    # -- registration -------------------------------------------------------------------

    def register(self, root_tag: str, block_hashes_hex: Iterable[str]) -> None:
        """Queue a registration; never blocks, never raises."""
        self._pending.append((root_tag, list(block_hashes_hex)))
        self._wake.set()

    async def flush(self) -> bool:
        """Write the queued registrations (pipelined); False while writes are refused."""
        while self._pending:
            if not self.writable:
                return False
            batch: list[tuple[str, list[str]]] = []
            size = 0
            while self._pending and size < FLUSH_BATCH_BLOCKS:
                item = self._pending.popleft()
                batch.append(item)
                size += len(item[1])
            try:
                await self._write(batch)
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                self._pending.extendleft(reversed(batch))
                self._failed("register", exc, self.writes)
                return False
            self.writes.succeeded()
        return True

    async def _write(self, batch: list[tuple[str, list[str]]]) -> None:
        expiry = int(time.time()) + self.ttl_s
        pipe = self.redis.pipeline(transaction=False)
        for tag, hashes in batch:
            for h in hashes:
                key = self.block_key(tag, h)
                pipe.hset(key, self.host, expiry)
                pipe.expire(key, self.ttl_s)
                self._remember(key)
        await pipe.execute()
        self.stats["registered_blocks"] += sum(len(h) for _, h in batch)

    def _remember(self, key: str) -> None:
        self._remembered[key] = None
        self._remembered.move_to_end(key)
        if len(self._remembered) > MAX_REMEMBERED_KEYS:
            self._remembered.popitem(last=False)

    @property
    def pending(self) -> int:
        return sum(len(h) for _, h in self._pending)

    # -- membership ---------------------------------------------------------------------

    async def heartbeat(self) -> None:
        """Refresh this host's membership (a write) and read the live members (a read):
        while writes are refused the member list still refreshes."""
        now = time.time()
        if self.writable:
            try:
                pipe = self.redis.pipeline(transaction=False)
                pipe.zscore(self.members_key, self.host)
                pipe.zadd(self.members_key, {self.host: now + MEMBER_TTL_S})
                pipe.zremrangebyscore(self.members_key, "-inf", now)
                previous_score, *_ = await pipe.execute()
                self.writes.succeeded()
                if previous_score is None:
                    self._joined_at = time.monotonic()
                    if self._joined:
                        await self._republish()
                self._joined = True
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                self._failed("heartbeat", exc, self.writes)
        if self.available:
            try:
                members = await self.redis.zrangebyscore(self.members_key, now, "+inf")
                self._members = {m.decode() if isinstance(m, bytes) else m for m in members}
                self._read_ok()
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                self._failed("members", exc, self.reads)

    async def _republish(self) -> None:
        """Our member entry vanished although we heartbeat in time: Redis lost its data
        (a restart without persistence, a failover to an empty replica, a flush). Write
        every remembered entry again, so peers find this host's blocks without waiting
        for new stores. An entry for a block evicted since costs a shorter peer answer
        only (the serving peer matches by tokens)."""
        keys = list(self._remembered)
        expiry = int(time.time()) + self.ttl_s
        for start in range(0, len(keys), FLUSH_BATCH_BLOCKS):
            pipe = self.redis.pipeline(transaction=False)
            for key in keys[start : start + FLUSH_BATCH_BLOCKS]:
                pipe.hset(key, self.host, expiry)
                pipe.expire(key, self.ttl_s)
            await pipe.execute()
        self.stats["republished_blocks"] += len(keys)
        log.info("redis lost its index entries; republished %d blocks", len(keys))

    def _read_ok(self) -> None:
        self.reads.succeeded()
        if self.writes.state is Health.UNREACHABLE:
            # The server answers again: let the queued writes try now instead of after the backoff.
            self.writes.down_until = 0.0

    async def is_member(self, host: str) -> bool:
        """Whether `host` heartbeats in this index's member set now (one round trip).
        Raises `MembershipUnknown` when Redis cannot say, or says no while the set may
        still be filling (`MEMBER_SET_SETTLE_S`): a warm-up source must be proven, not
        assumed, and neither an outage nor a fresh set proves it a stranger."""
        try:
            expiry = await asyncio.wait_for(self.redis.zscore(self.members_key, host), MEMBERSHIP_CHECK_TIMEOUT_S)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self._failed("membership check", exc, self.reads)
            raise MembershipUnknown(f"the global index cannot confirm {host} now ({exc.__class__.__name__})") from None
        if expiry is not None and float(expiry) > time.time():
            return True
        if self._joined_at is None or time.monotonic() - self._joined_at < MEMBER_SET_SETTLE_S:
            raise MembershipUnknown(f"{host} is not in the global index's member set yet, which is still "
                                    "filling (this sidecar only just joined it, or Redis lost its data)")
        return False

    @property
    def members(self) -> set[str]:
        """The live members as of the last heartbeat (no round trip; this host among
        them). Read-only: a heartbeat replaces the set, `forget_member` shrinks it."""
        return self._members

    def forget_member(self, host: str) -> None:
        """A peer that failed a fetch is skipped until its next heartbeat refresh."""
        self._members.discard(host)

    async def run(self) -> None:
        """Background loop: flush registrations as they come, heartbeat periodically."""
        next_beat = 0.0
        while True:
            if time.monotonic() >= next_beat:
                await self.heartbeat()
                next_beat = time.monotonic() + HEARTBEAT_S
            if self._pending and self.writable:
                await self.flush()
            self._wake.clear()
            retry_in = self.writes.down_until - time.monotonic() if self._pending else HEARTBEAT_S
            wait = max(0.01, min(next_beat - time.monotonic(), retry_in))
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
            except asyncio.TimeoutError:
                pass

    async def deregister(self) -> None:
        """Graceful shutdown: leave the member set and withdraw remembered entries."""
        try:
            await asyncio.wait_for(self._deregister(), 2.0)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            log.warning("deregister failed (%s); entries expire by TTL", exc.__class__.__name__)

    async def _deregister(self) -> None:
        await self.redis.zrem(self.members_key, self.host)
        keys = list(self._remembered)
        for start in range(0, len(keys), FLUSH_BATCH_BLOCKS):
            pipe = self.redis.pipeline(transaction=False)
            for key in keys[start : start + FLUSH_BATCH_BLOCKS]:
                pipe.hdel(key, self.host)
            await pipe.execute()
        self._remembered.clear()

    async def close(self) -> None:
        try:
            await self.redis.aclose()
        except Exception:  # closing a broken connection must not mask shutdown
            pass

