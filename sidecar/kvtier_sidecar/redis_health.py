"""Per-operation health of the Redis global index: pure logic, no I/O.

Redis fails in ways that hit one kind of operation and not the other: out of memory
under `noeviction` refuses writes while reads still answer; a primary demoted to a
READONLY replica serves reads and refuses writes; a cluster slot on the move answers
MOVED/ASK/TRYAGAIN for a moment; a dead server refuses everything. So reads and writes
each get a `Breaker`, and `classify` says which breakers an error opens:

    unreachable  connection refused/reset, timeout      both reads and writes
    oom          OOM command not allowed                 writes
    readonly     READONLY replica                        writes
    moved        MOVED / ASK / TRYAGAIN / CLUSTERDOWN    the operation that saw it
    error        any other error reply                   the operation that saw it
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import Enum

from redis.exceptions import (AskError, ClusterDownError, MovedError, OutOfMemoryError, ReadOnlyError,
                              RedisError, TryAgainError)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Backoff after a failure before the next attempt (doubles up to the max).
BACKOFF_MIN_S = 0.25
BACKOFF_MAX_S = 5.0


class Health(str, Enum):
    OK = "ok"
    UNREACHABLE = "unreachable"
    OOM = "oom"
    READONLY = "readonly"
    MOVED = "moved"
    ERROR = "error"


# The failures that say the server itself is gone, so the other kind of operation fails too.
_SERVER_GONE = {Health.UNREACHABLE}
# Error-reply prefixes, for clients that raise a plain ResponseError for them.
_PREFIXES = (("OOM", Health.OOM), ("READONLY", Health.READONLY), ("MOVED", Health.MOVED),
             ("ASK", Health.MOVED), ("TRYAGAIN", Health.MOVED), ("CLUSTERDOWN", Health.MOVED))


def classify(exc: BaseException) -> Health:
    """Which failure `exc` is (never OK)."""
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError, TimeoutError)):
        return Health.UNREACHABLE
    if isinstance(exc, OutOfMemoryError):
        return Health.OOM
    if isinstance(exc, ReadOnlyError):
        return Health.READONLY
    if isinstance(exc, (MovedError, AskError, TryAgainError, ClusterDownError)):
        return Health.MOVED
    if isinstance(exc, RedisError):
        text = str(exc)
        for prefix, health in _PREFIXES:
            if text.startswith(prefix):
                return health
    return Health.ERROR


def opens_both(health: Health) -> bool:
    return health in _SERVER_GONE


@dataclass(slots=True)
class Breaker:
    """One kind of operation: closed (OK) or open until `down_until` after a failure,
    with exponential backoff between attempts. Times are the caller's monotonic clock."""

    state: Health = Health.OK
    down_until: float = 0.0
    backoff_s: float = BACKOFF_MIN_S
    failures: int = 0

    def allows(self, now: float) -> bool:
        return now >= self.down_until

    def failed(self, health: Health, now: float) -> float:
        """Open for the current backoff; returns how long."""
        wait = self.backoff_s
        self.state = health
        self.failures += 1
        self.down_until = now + wait
        self.backoff_s = min(BACKOFF_MAX_S, self.backoff_s * 2)
        return wait

    def succeeded(self) -> None:
        self.state = Health.OK
        self.down_until = 0.0
        self.backoff_s = BACKOFF_MIN_S
