"""The worker's sidecar calls (connect, load reports, stores) on one background thread,
so a slow or hung sidecar never holds up a forward pass.

The forward pass only copies memory: loads read the shared-memory arena it has
mapped, stores copy the finished prompt's blocks into a staging buffer owned by the
store (so vLLM may reuse its pages at once). This thread then asks the sidecar for
slots (`begin_store`), copies the staged blocks in and commits them, and sends the
reports. Work is queued in order, at most MAX_QUEUED calls and `staging_bytes` of
staged stores; past either a store is skipped (counted) and a report is dropped.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import numpy as np

log = logging.getLogger("vllm.kvtier_vllm")  # see connector.py

MAX_QUEUED = 1024
"""Queued calls; a sidecar this far behind gets no more work until it catches up."""


class Staged:
    """Blocks staged for a store: arena-like (`slot_array`, `slots`, `array`, what the
    paged copies read of an arena), slot i is block i."""

    def __init__(self, n_blocks: int, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.slots = n_blocks
        self.buf = np.empty(n_blocks * block_bytes, np.uint8)
        self.array = self.buf

    def slot_array(self, slot: int, count: int = 1) -> np.ndarray:
        return self.buf[slot * self.block_bytes : (slot + count) * self.block_bytes]

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes


class WorkerCalls:
    def __init__(self, staging_bytes: int) -> None:
        self.staging_bytes = staging_bytes
        self._staged_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(MAX_QUEUED)
        self._thread = threading.Thread(target=self._run, name="kvtier-worker-calls", daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], None]) -> bool:
        """Queue `call`; False when the queue is full (the call is dropped)."""
        try:
            self._queue.put_nowait((call, 0))
            return True
        except queue.Full:
            return False

    def stage(self, n_blocks: int, block_bytes: int) -> Staged | None:
        """A staging buffer for a store, or None when staged stores already hold the bound."""
        need = n_blocks * block_bytes
        with self._lock:
            if self._staged_bytes + need > self.staging_bytes:
                return None
            self._staged_bytes += need
        return Staged(n_blocks, block_bytes)

    def submit_store(self, call: Callable[[], None], staged: Staged) -> bool:
        """Queue a store's sidecar part; its staging bytes are freed when it has run."""
        try:
            self._queue.put_nowait((call, staged.nbytes))
            return True
        except queue.Full:
            self._unstage(staged.nbytes)
            return False

    def _unstage(self, nbytes: int) -> None:
        with self._lock:
            self._staged_bytes -= nbytes

    def idle(self, timeout_s: float) -> bool:
        """Wait until every queued call has run (tests, shutdown); False on timeout."""
        done = threading.Event()
        if not self.submit(done.set):
            return False
        return done.wait(timeout_s)

    def close(self) -> None:
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass  # a daemon thread: it goes with the process

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            call, staged_bytes = item
            try:
                call()
            except Exception:  # one failed call must not stop the ones after it
                log.exception("kvtier: a sidecar call on the worker thread failed")
            finally:
                if staged_bytes:
                    self._unstage(staged_bytes)
