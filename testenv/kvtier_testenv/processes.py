"""Stopping a child process the way every fixture here does: SIGTERM, wait, then SIGKILL."""
from __future__ import annotations

import subprocess

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
