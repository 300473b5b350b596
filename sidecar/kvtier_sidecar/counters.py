"""Named event counters that any thread may bump (peer-fetch pool threads, the event
loop): one lock, so no increment is lost and a snapshot is consistent."""
from __future__ import annotations

import threading
from enum import StrEnum


class Count(StrEnum):
    """The sidecar-wide counters (`GET /cache/stats` "sidecar", `/metrics`)."""

    PEER_FETCHES = "peer_fetches"
    PEER_FETCH_ERRORS = "peer_fetch_errors"
    PEER_CHECKSUM_MISMATCHES = "peer_checksum_mismatches"
    PEER_BYTES_FETCHED = "peer_bytes_fetched"
    PEER_FETCHES_SHED = "peer_fetches_shed"  # lookups that skipped a peer at its in-flight bound
    # What the peer server refused after the handshake or at it, by cause:
    PEER_BAD_RECORDS = "peer_bad_records"  # a sealed record failed its tag (tampered, replayed)
    PEER_REQUEST_TIMEOUTS = "peer_request_timeouts"  # a request not in by its deadline
    PEER_OLD_PROTOCOL = "peer_old_protocol"  # a peer speaking an earlier protocol version
    # Lookups that reached the peer step with a peer-pull hint (`peer_hint`), by outcome:
    PEER_HINT_USED = "peer_hint_used"  # the hinted peer served verified blocks
    PEER_HINT_UNKNOWN = "peer_hint_unknown"  # it names no member of this fleet: not asked
    PEER_HINT_MISS = "peer_hint_miss"  # asked, it held nothing more
    PEER_HINT_FAILED = "peer_hint_failed"  # asked, the fetch failed (bad bytes, timeout, busy)
    STORED_BLOCKS = "stored_blocks"
    INVALIDATED_BLOCKS = "invalidated_blocks"
    WARMED_BLOCKS = "warmed_blocks"
    STORED_BYTES = "stored_bytes"
    STORE_UNWRITTEN_BLOCKS = "store_unwritten_blocks"  # committed but never written: not published
    ENGINE_LOADED_BYTES = "engine_loaded_bytes"  # reported by the engine (engine socket REPORT)
    ENGINE_LOAD_ERRORS = "engine_load_errors"  # blocks the engine reported as not loaded
    ENGINE_LOADED_TOKENS_DRAM = "engine_loaded_tokens_dram"  # prompt tokens the engine loaded, by tier
    ENGINE_LOADED_TOKENS_PEER = "engine_loaded_tokens_peer"
    ENGINE_LOCAL_HIT_TOKENS = "engine_local_hit_tokens"  # the engine's own prefix-cache hits
    ENGINE_PROMPT_TOKENS = "engine_prompt_tokens"
    ENGINE_LOOKUP_TIMEOUTS = "engine_lookup_timeouts"  # lookups the engine stopped waiting for
    ENGINE_BREAKER_TRIPS = "engine_breaker_trips"  # the engine stopped asking for a back-off
    # The rollout's warm-up requests (the LOOKUP's purpose "warmup"), counted apart from
    # the traffic's lookups: their misses are by design (the pod is cold).
    WARMUP_LOOKUPS = "warmup_lookups"
    WARMUP_TOKENS_HIT = "warmup_tokens_hit"  # prompt tokens a warm-up lookup matched
    WARMUP_TOKENS_MISS = "warmup_tokens_miss"  # and those it did not (the engine prefills them)
    WARM_REFUSED = "warm_refused"  # warm-ups answered 429: the queue was full
    PEER_SECRET_ROTATIONS = "peer_secret_rotations"  # the mounted peer secret changed
    TOKEN_REVIEWS = "token_reviews"  # control-API tokens sent to the API server's TokenReview
    AUTH_MISSING = "auth_missing"  # control-API calls without a bearer token
    AUTH_UNAVAILABLE = "auth_unavailable"  # calls refused because TokenReview could not be asked
    AUTH_RATE_LIMITED = "auth_rate_limited"  # unknown tokens refused unreviewed: their source asked too often


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[Count, int] = {}

    def add(self, name: Count, n: int = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {str(k): v for k, v in self._values.items()}
