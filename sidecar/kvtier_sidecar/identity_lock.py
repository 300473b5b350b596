"""One live sidecar per identity on a host.

A sidecar's identity (namespace/pod) names its shared-memory arena and its default
engine socket. A second sidecar started with the same identity would unlink the first
one's arena and socket and take them over, leaving the first one's engine reading a
segment nobody writes any more. The first sidecar therefore holds an exclusive
`flock` on `<shm dir>/<shm name>.lock` for its lifetime (the kernel drops it when the
process dies, however it dies), and a second one refuses to start while it is held.
The lock file itself stays (0 bytes): removing it would race a starting sidecar.
"""
from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

from .arena import ArenaError

SHM_DIR = Path("/dev/shm")
"""Where POSIX shared memory lives on Linux (the pod's memory-backed emptyDir)."""


class IdentityLock:
    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = -1


def claim(shm_name: str, identity: str) -> IdentityLock:
    """Hold the identity's lock, or raise ArenaError naming what to change."""
    directory = SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir())
    path = directory / f"{shm_name}.lock"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ArenaError(f"another kvtier sidecar with identity {identity} is running on this host (it holds "
                         f"{path}); refusing to take over its arena and socket: give this sidecar its own "
                         "pod_name/pod_namespace") from None
    return IdentityLock(fd, path)
