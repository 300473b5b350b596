"""The scheduler's sidecar calls, off vLLM's scheduler thread, under a deadline and a
circuit breaker: kvtier may miss, it never makes the scheduler wait.

    start(root, prompt, local)  -> PendingLookup, queued for the lookup thread
                                   (None: the breaker is open, the request is a miss)
    settle(pending, wait_s)     -> the EngineHit / None once known; PENDING while the lookup
                                   runs and its deadline has not passed; None (a miss)
                                   after the deadline, the lookup abandoned
    release(hit)                -> queued too: a hung sidecar never blocks a release

One thread owns the SidecarClient (one request in flight per connection). A lookup
that ends after its request gave up (deadline, finished, aborted) has its pin
released by that thread. Queued lookups whose deadline passed before the thread
reached them are dropped unasked.

Breaker (`Breaker`), per connector:

    closed --(FAILURES_TO_TRIP consecutive lookups past the deadline or faulted)--> open
    open   --(backoff_s passed)--> half-open: the next lookup is the probe
    probe in time -> closed (logged, counted);  probe late/faulted -> open, backoff doubled
                                                (up to MAX_BACKOFF_FACTOR times the base)
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvtier.keys import KeyRoot
from kvtier_sidecar.client import UNAVAILABLE

log = logging.getLogger("vllm.kvtier_vllm")  # see connector.py

PENDING = object()
"""`settle`'s answer while the lookup is still running within its deadline."""
FAILURES_TO_TRIP = 2
"""Consecutive slow or faulted lookups that open the breaker: one can be a hiccup."""
MAX_BACKOFF_FACTOR = 8
"""A sidecar that keeps failing its probes is asked at most every 8 base back-offs."""
QUEUE_BOUND = 4096
"""Queued lookups and releases; past it a lookup is a miss (the thread is far behind)."""


class Breaker:
    """Whether to ask the sidecar at all; thread-safe. `on_change(tripped, why)` is
    called on every trip and every recovery."""

    def __init__(self, backoff_s: float, failures_to_trip: int = FAILURES_TO_TRIP,
                 clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[bool, str], None] | None = None) -> None:
        self.base_backoff_s = backoff_s
        self.backoff_s = backoff_s
        self.failures_to_trip = failures_to_trip
        self.clock = clock
        self.on_change = on_change
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until: float | None = None  # None: closed
        self._probing = False
        self.trips = 0
        self.recoveries = 0

    @property
    def is_open(self) -> bool:
        return self._open_until is not None

    def allow(self) -> bool:
        """True to ask the sidecar now: always when closed; once per back-off when open
        (that lookup is the probe)."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._probing or self.clock() < self._open_until:
                return False
            self._probing = True
            return True

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            if self._open_until is None:
                return
            self._open_until, self._probing = None, False
            self.backoff_s = self.base_backoff_s
            self.recoveries += 1
        if self.on_change:
            self.on_change(False, "a probe lookup answered in time")

    def failure(self, why: str) -> None:
        with self._lock:
            self._failures += 1
            if self._open_until is not None:
                if not self._probing:
                    return  # a late answer to a lookup from before the trip
                self._probing = False
                self.backoff_s = min(self.backoff_s * 2, self.base_backoff_s * MAX_BACKOFF_FACTOR)
                self._open_until = self.clock() + self.backoff_s
                return
            if self._failures < self.failures_to_trip:
                return
            self._open_until = self.clock() + self.backoff_s
            self.trips += 1
        if self.on_change:
            self.on_change(True, why)


@dataclass(slots=True, frozen=True)
class _Report:
    counts: dict[str, int]


@dataclass(slots=True, eq=False)
class PendingLookup:
    root: KeyRoot
    prompt: list[int]
    local_tokens: int
    digests: bool
    deadline: float
    purpose: str | None = None  # `kvtier.names.WARMUP_PURPOSE` for the rollout's warm-up; None: traffic
    source_peer: str | None = None  # a router's peer-pull hint (`kvtier.names.source_peer`); None: none
    done: threading.Event = field(default_factory=threading.Event)
    hit: Any = None             # the client's EngineHit, or None (a miss)
    abandoned: bool = False     # the request stopped waiting: the thread releases the hit
    judged: bool = False        # counted for the breaker once (in time, late or faulted)


class AsyncLookups:
    """One background thread doing the scheduler side's sidecar calls (see module doc).

    `client` is a SidecarClient (lookup, release); `budget_s` is how long after its
    first ask a request waits for its lookup before it proceeds with no external tokens."""

    def __init__(self, client, budget_s: float, breaker: Breaker,
                 clock: Callable[[], float] = time.monotonic,
                 refuse: Callable[[dict], str | None] | None = None) -> None:
        self.client = client
        self.budget_s = budget_s
        self.breaker = breaker
        self.clock = clock
        # refuse(client.info): why the connected sidecar must not be used (its weights
        # version differs from the engine's); its lookups are then misses, unasked.
        self.refuse = refuse
        self._refused_instance: str | None = None
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(QUEUE_BOUND)
        self._thread = threading.Thread(target=self._run, name="kvtier-lookups", daemon=True)
        self._thread.start()
        # counts since take_counts (the connector's KVConnectorStats)
        self.counts = {"lookup_timeouts": 0, "lookup_faults": 0, "lookups_skipped": 0, "weights_version_mismatch": 0}
        self._reports_refused = False
        self._unsent: dict[str, int] = {}  # reported counts not queued yet (scheduler thread)

    # -- scheduler thread ---------------------------------------------------------------

    def start(self, root: KeyRoot, prompt: list[int], local_tokens: int, digests: bool,
              purpose: str | None = None, source_peer: str | None = None) -> PendingLookup | None:
        if not self.breaker.allow():
            self._count("lookups_skipped")
            return None
        pending = PendingLookup(root, prompt, local_tokens, digests, self.clock() + self.budget_s, purpose,
                                source_peer)
        try:
            self._queue.put_nowait(pending)
        except queue.Full:
            self._count("lookups_skipped")
            return None
        return pending

    def settle(self, pending: PendingLookup, wait_s: float = 0.0):
        """The lookup's hit (None: a miss) once known, else PENDING; past its deadline
        the lookup is abandoned and the answer is a miss."""
        now = self.clock()
        wait = min(wait_s, pending.deadline - now)
        if not pending.done.is_set() and wait > 0:
            pending.done.wait(wait)
        with self._lock:
            if pending.done.is_set():
                return pending.hit
            if self.clock() < pending.deadline:
                return PENDING
            pending.abandoned = True
            late = not pending.judged
            pending.judged = True
        self._count("lookup_timeouts")
        if late:
            self.breaker.failure(f"a lookup took longer than its {self.budget_s * 1000:.0f} ms budget")
        return None

    def abandon(self, pending: PendingLookup) -> None:
        """The request no longer wants the answer (finished, aborted)."""
        with self._lock:
            pending.abandoned = True
            hit = pending.hit if pending.done.is_set() else None
            pending.hit = None
        if hit:
            self.release(hit)

    def release(self, hit) -> None:
        if hit:
            try:
                self._queue.put_nowait(hit)
            except queue.Full:
                log.warning("kvtier: release queue full; the sidecar frees the pin when the engine reconnects")

    def report(self, counts: dict[str, int]) -> None:
        """Send `counts` (EngineReport fields) to the sidecar, best effort. While the
        breaker is open they are kept and sent with the first report after it closes:
        the prompts served without kvtier meanwhile belong in the hit rate's denominator."""
        for name, value in counts.items():
            self._unsent[name] = self._unsent.get(name, 0) + value
        if self._unsent and not self.breaker.is_open:
            try:
                self._queue.put_nowait(_Report(self._unsent))
            except queue.Full:
                return  # kept for the next report
            self._unsent = {}

    def take_counts(self) -> dict[str, int]:
        with self._lock:
            out, self.counts = self.counts, {k: 0 for k in self.counts}
        return out

    def _count(self, name: str) -> None:
        with self._lock:
            self.counts[name] += 1

    def close(self) -> None:
        self._queue.put(None)

    # -- lookup thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                if isinstance(item, PendingLookup):
                    self._lookup(item)
                elif isinstance(item, _Report):
                    self._send_report(item.counts)
                else:
                    self.client.release(item)
            except Exception:  # the thread must outlive any one call
                log.exception("kvtier: a sidecar call on the lookup thread failed")

    def _refused(self) -> bool:
        """True when the sidecar this thread talks to must not be used (logged and
        counted once per sidecar instance)."""
        if self.refuse is None:
            return False
        if not self.client.info:
            self.client.connect()
        problem = self.refuse(self.client.info)
        if problem is None:
            return False
        instance = str(self.client.info.get("instance", ""))
        if instance != self._refused_instance:
            self._refused_instance = instance
            log.error("kvtier: %s", problem)
            self._count("weights_version_mismatch")
        return True

    def _send_report(self, counts: dict[str, int]) -> None:
        if self._reports_refused or self._refused():
            return
        try:
            self.client.report(**counts)
        except ValueError as exc:  # a sidecar that does not know these fields (an older release)
            self._reports_refused = True
            log.warning("kvtier: the sidecar refused the scheduler's report (%s); not reporting again", exc)

    def _lookup(self, p: PendingLookup) -> None:
        if p.abandoned or self.clock() >= p.deadline:
            with self._lock:
                p.abandoned = True
                judged, p.judged = p.judged, True
                p.done.set()
            if not judged:  # the thread was too far behind to ask in time
                self.breaker.failure(f"lookups queued longer than their {self.budget_s * 1000:.0f} ms budget")
            return  # its request has already proceeded without it
        if self._refused():
            with self._lock:
                p.judged = True  # the sidecar answers; it is only the wrong one
                p.done.set()
            return
        if p.source_peer is None:  # no hint: the very call a lookup made before hints existed
            hit = self.client.lookup(p.root, p.prompt, digests=p.digests, local_tokens=p.local_tokens,
                                     purpose=p.purpose)
        else:
            hit = self.client.lookup(p.root, p.prompt, digests=p.digests, local_tokens=p.local_tokens,
                                     purpose=p.purpose, source_peer=p.source_peer)
        faulted = not hit and getattr(hit, "reason", "") == UNAVAILABLE
        with self._lock:
            in_time = self.clock() <= p.deadline and not p.abandoned
            judged, p.judged = p.judged, True
            if in_time:
                p.hit = hit if hit else None
            p.done.set()
        if faulted:
            self._count("lookup_faults")
        if not in_time and hit:
            self.client.release(hit)
        if judged:
            return
        if faulted:
            self.breaker.failure("the sidecar is unreachable")
        elif in_time:
            self.breaker.success()
        else:
            self.breaker.failure(f"a lookup took longer than its {self.budget_s * 1000:.0f} ms budget")
