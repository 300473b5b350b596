"""Background jobs behind `GET /cache/jobs`: warm-ups and invalidations the control
API answers 202 for. Each is a typed `control_api.Job`; the newest `MAX_JOBS_KEPT`
are remembered, and a warm-up's ref names its job while it is."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Coroutine
from typing import Any

from kvtier.control_api import Job, JobId, JobKind, JobState

log = logging.getLogger("kvtier.sidecar.jobs")

# Finished jobs kept for `GET /cache/jobs`: one epoch's warm-ups on one target fit.
MAX_JOBS_KEPT = 1000


class RefConflict(ValueError):
    """A remembered `ref` asked again with other parameters (answered 409)."""


class QueueFull(RuntimeError):
    """Too many jobs of a kind are unfinished; `retry_after_s` says when to ask again."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class JobRegistry:
    def __init__(self) -> None:
        self._jobs: dict[JobId, Job] = {}
        self._refs: dict[str, JobId] = {}  # warm request ref -> job
        self._ids = itertools.count(1)
        self._background: set[asyncio.Task] = set()

    def by_ref(self, ref: str | None, **asked: Any) -> JobId | None:
        """The job a remembered ref started, counting this ask; None when unknown.
        RefConflict when `asked` (e.g. tenant, from_peer, max_bytes) differs from what
        the ref first asked: the same ref must always mean the same request."""
        job = self._refs.get(ref) if ref is not None else None
        if job is not None:
            record = self._jobs[job]
            first = {k: getattr(record, k) for k in asked}
            if first != asked:
                raise RefConflict(f"ref {ref!r} already names job {job} with {first}; use a new ref for {asked}")
            record.asks += 1
        return job

    def spawn(self, kind: JobKind, work: Coroutine[Any, Any, dict[str, int]], **about: Any) -> JobId:
        """Run `work` in the background; its result (a dict of counts, "bytes" among
        them) lands in the job's record."""
        job = JobId(f"{kind}-{next(self._ids)}")
        self._jobs[job] = Job(kind=kind, started_s=time.time(), **about)
        if self._jobs[job].ref is not None:
            self._refs[self._jobs[job].ref] = job
        task = asyncio.get_running_loop().create_task(self._run(job, work))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return job

    async def _run(self, job: JobId, work: Coroutine[Any, Any, dict[str, int]]) -> None:
        record = self._jobs[job]
        try:
            result = await work
            record.state, record.result, record.bytes = JobState.DONE, result, result.get("bytes", 0)
        except Exception as exc:  # a failed job is reported, not raised
            log.exception("job failed", extra={"job": job})
            record.state, record.error = JobState.FAILED, str(exc)
        record.finished_s = time.time()
        self._trim()

    def _trim(self) -> None:
        while len(self._jobs) > MAX_JOBS_KEPT:
            old = self._jobs.pop(next(iter(self._jobs)))
            if old.ref is not None:
                self._refs.pop(old.ref, None)

    def unfinished(self, kind: JobKind) -> int:
        return sum(1 for r in self._jobs.values() if r.kind == kind and r.state == JobState.RUNNING)

    def snapshot(self) -> dict[JobId, Job]:
        return {job: record.model_copy() for job, record in self._jobs.items()}
