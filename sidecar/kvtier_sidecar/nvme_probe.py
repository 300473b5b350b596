"""Shadow mode of the NVMe tier: measure the local disk, serve nothing from it.

The design refuses an NVMe tier for interactive traffic on paper (7 GB/s is below the
70B TP4 break-even of 9.26 GB/s); shadow mode replaces the paper figure with the
disk this pod actually has. One probe:

    write probe_bytes in 4 MiB chunks -> fsync        (write_gbps)
    read them back                                    (read_gbps = measured_gbps)

with O_DIRECT where the filesystem allows it (aligned buffers from mmap), so neither
direction is served by the page cache; where it does not (tmpfs, some overlays), the
written pages are dropped with POSIX_FADV_DONTNEED before the read, and the report
says `direct_io: false`. A probe past its time budget stops and reports what it
measured so far (`partial`). The file is removed whatever happens.

`measure` is the blocking probe; `NvmeProbe` repeats it on a slow timer in a worker
thread and keeps the last result for `GET /cache/stats`.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import mmap
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.sidecar_config import NvmeConfig

log = logging.getLogger("kvtier.sidecar.nvme")

# Large enough that per-call overhead vanishes, small enough to check the budget often.
CHUNK_BYTES = 4 << 20
# The probe starts this soon after the sidecar: the operator wants a figure early.
FIRST_PROBE_DELAY_S = 0.5


@dataclass(frozen=True, slots=True)
class ProbeResult:
    write_gbps: float
    read_gbps: float
    nbytes: int
    direct_io: bool
    partial: bool
    elapsed_s: float
    measured_at_s: float  # wall clock

    @property
    def measured_gbps(self) -> float:
        """What a fetch from this disk would get: its read bandwidth."""
        return self.read_gbps


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def _open(path: Path, flags: int, direct: bool) -> int:
    return os.open(path, flags | (os.O_DIRECT if direct else 0), 0o600)


def measure(directory: str | os.PathLike[str], nbytes: int, budget_s: float) -> ProbeResult:
    """One write+fsync+read-back of `nbytes` under `directory` (created if missing)."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f".kvtier-probe-{os.getpid()}"
    chunks = max(1, nbytes // CHUNK_BYTES)
    buf = mmap.mmap(-1, CHUNK_BYTES)  # page-aligned: what O_DIRECT needs
    buf.write(os.urandom(CHUNK_BYTES))  # incompressible, so no device shortcut
    started = time.monotonic()
    deadline = started + budget_s
    try:
        direct = hasattr(os, "O_DIRECT")
        written, write_s, direct = _write(target, buf, chunks, deadline, direct)
        read, read_s = _read(target, buf, written // CHUNK_BYTES, deadline, direct)
    finally:
        buf.close()
        target.unlink(missing_ok=True)
    return ProbeResult(
        write_gbps=round(gbps(written, write_s), 3), read_gbps=round(gbps(read, read_s), 3), nbytes=read,
        direct_io=direct, partial=read < chunks * CHUNK_BYTES, elapsed_s=round(time.monotonic() - started, 3),
        measured_at_s=time.time(),
    )


def _write(target: Path, buf: mmap.mmap, chunks: int, deadline: float, direct: bool) -> tuple[int, float, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = _open(target, flags, direct)
    except OSError as exc:
        if not direct or exc.errno != errno.EINVAL:
            raise
        direct, fd = False, _open(target, flags, False)  # the filesystem refuses O_DIRECT
    try:
        t0 = time.monotonic()
        written = 0
        for _ in range(chunks):
            try:
                written += os.write(fd, buf)
            except OSError as exc:
                if not (direct and written == 0 and exc.errno == errno.EINVAL):
                    raise
                os.close(fd)  # O_DIRECT accepted at open, refused at write: go buffered
                direct, fd = False, _open(target, flags, False)
                t0 = time.monotonic()
                written += os.write(fd, buf)
            if time.monotonic() > deadline:
                break
        os.fsync(fd)
        elapsed = time.monotonic() - t0
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the read must hit the device
    finally:
        os.close(fd)
    return written, elapsed, direct


def _read(target: Path, buf: mmap.mmap, chunks: int, deadline: float, direct: bool) -> tuple[int, float]:
    fd = _open(target, os.O_RDONLY, direct)
    try:
        t0 = time.monotonic()
        read = 0
        for _ in range(chunks):
            n = os.readv(fd, [buf])
            if n <= 0:
                break
            read += n
            if time.monotonic() > deadline:
                break
        return read, time.monotonic() - t0
    finally:
        os.close(fd)


class NvmeProbe:
    """Repeats `measure` every `probe_interval_s` (first soon after start); keeps the last
    result or error for stats. Never serves a block, whatever the mode."""

    def __init__(self, config: NvmeConfig) -> None:
        self.config = config
        self.last: ProbeResult | None = None
        self.error: str | None = None
        self.samples = 0

    async def run(self) -> None:
        await asyncio.sleep(FIRST_PROBE_DELAY_S)
        while True:
            await self.probe_once()
            await asyncio.sleep(self.config.probe_interval_s)

    async def probe_once(self) -> None:
        c = self.config
        try:
            self.last = await asyncio.to_thread(measure, c.path, c.probe_bytes, c.probe_budget_s)
            self.samples += 1
            self.error = None
            log.info("nvme probe", extra={"read_gbps": self.last.read_gbps, "write_gbps": self.last.write_gbps,
                                          "direct_io": self.last.direct_io, "path": c.path})
        except OSError as exc:  # a missing or full disk is a figure we do not have, not a crash
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("nvme probe failed", extra={"path": c.path, "error": self.error})

    def report(self) -> dict:
        out: dict = {"mode": self.config.mode, "path": self.config.path, "serving": False,
                     "samples": self.samples, "error": self.error, "measured_gbps": None}
        if self.last is not None:
            out.update(asdict(self.last), measured_gbps=self.last.measured_gbps)
        return out
