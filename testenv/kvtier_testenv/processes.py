"""Stopping a child process the way every fixture here does: SIGTERM, wait, then SIGKILL."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

STOP_TIMEOUT_S = 15.0
"""How long a child gets to exit after SIGTERM, and again after SIGKILL."""


def stop(proc: subprocess.Popen | None, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Terminate `proc` (when it still runs) and reap it; SIGKILL after `timeout_s`."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)


def _group_alive(pgid: int) -> bool:
    """Some process of group `pgid` still runs (zombies waiting for a reaper do not
    count: they hold no memory mappings)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop_group(proc: subprocess.Popen | None, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop the process group `proc` leads (started with start_new_session=True) and every
    process in it: SIGTERM, wait until no member runs, SIGKILL after `timeout_s`. Waiting
    for the leader alone is not enough: an engine's worker processes outlive it by
    seconds and keep shared memory mapped (a sidecar's arena), so a sweep of what the
    test left behind would skip it and it would leak."""
    if proc is None:
        return
    pgid = proc.pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_alive(pgid):
                return
            time.sleep(0.05)
    proc.wait(timeout_s)
