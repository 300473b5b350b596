"""The DRAM tier's memory: one preallocated POSIX shared-memory segment of block slots.

The sidecar creates the segment (`Arena.create`) and hands its buffer to LocalCache;
engine processes map the same segment (`Arena.attach`) and copy block runs straight
out of it, so a local hit moves no KV bytes over a socket.

We talk to `shm_open` directly instead of `multiprocessing.shared_memory`: before
Python 3.13 an *attaching* process registers the segment with its resource tracker,
which unlinks it when that engine exits — pulling the tier out from under the sidecar.
"""
from __future__ import annotations

import mmap
import os

import _posixshmem
import numpy as np


class ArenaError(RuntimeError):
    """The segment could not be created or mapped (e.g. /dev/shm too small)."""


class Arena:
    """`slots` fixed-size slots of `block_bytes`, slot i at byte offset i * block_bytes.

    Only the creator unlinks the segment; attachers just unmap. The memory is reserved
    up front (posix_fallocate), so a too-small /dev/shm fails at start-up with a clear
    error instead of a SIGBUS on the first store.
    """

    def __init__(self, name: str, fd: int, size: int, block_bytes: int, owner: bool) -> None:
        self.name = name
        self.size = size
        self.block_bytes = block_bytes
        self.slots = size // block_bytes
        self.owner = owner
        self._mmap = mmap.mmap(fd, size)
        os.close(fd)
        self.buffer = memoryview(self._mmap)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)

    @classmethod
    def create(cls, name: str, slots: int, block_bytes: int) -> "Arena":
        size = slots * block_bytes
        if slots < 1:
            raise ArenaError(f"arena {name}: needs at least one slot of {block_bytes} bytes")
        try:
            _posixshmem.shm_unlink("/" + name)  # a crashed predecessor's segment
        except FileNotFoundError:
            pass
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, size)
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            _posixshmem.shm_unlink("/" + name)
            raise ArenaError(
                f"arena {name}: cannot reserve {size} bytes of shared memory ({exc}); "
                "enlarge /dev/shm (an emptyDir with medium: Memory) or lower dram_capacity_bytes"
            ) from exc
        return cls(name, fd, size, block_bytes, owner=True)

    @classmethod
    def attach(cls, name: str, size: int, block_bytes: int) -> "Arena":
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        actual = os.fstat(fd).st_size
        if actual < size:
            os.close(fd)
            raise ArenaError(f"arena {name}: segment holds {actual} bytes, expected {size}")
        return cls(name, fd, size, block_bytes, owner=False)

    def slot_view(self, slot: int, count: int = 1) -> memoryview:
        start = slot * self.block_bytes
        return self.buffer[start : start + count * self.block_bytes]

    def slot_array(self, slot: int, count: int = 1) -> np.ndarray:
        start = slot * self.block_bytes
        return self.array[start : start + count * self.block_bytes]

    def close(self) -> None:
        """Unmap; the owner also unlinks. Views handed out must be gone by now."""
        if self._mmap.closed:
            return
        self.array = None  # type: ignore[assignment]
        try:
            self.buffer.release()
            self._mmap.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the process
        if self.owner:
            try:
                _posixshmem.shm_unlink("/" + self.name)
            except FileNotFoundError:
                pass


