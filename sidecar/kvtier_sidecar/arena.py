"""The DRAM tier's memory: one preallocated POSIX shared-memory segment of block slots.

The sidecar creates the segment (`Arena.create`) and hands its buffer to LocalCache;
engine processes map the same segment (`Arena.attach`) and copy block runs straight
out of it, so a local hit moves no KV bytes over a socket.

A segment is found by name, and a name can be taken over: a sidecar started with the
same identity on the same host unlinks the old segment and creates its own. So each
segment ends with a random tag (after the slots), the sidecar tells engines its tag
with the name, and `attach` refuses a segment whose tag differs: an engine must never
copy another sidecar's slots as its own sidecar's blocks.

We talk to `shm_open` directly instead of `multiprocessing.shared_memory`: before
Python 3.13 an *attaching* process registers the segment with its resource tracker,
which unlinks it when that engine exits — pulling the tier out from under the sidecar.
"""
from __future__ import annotations

import mmap
import os

import _posixshmem
import numpy as np


TAG_BYTES = 16
"""Random bytes after the slots naming one segment (collisions: 2^-128)."""


class ArenaError(RuntimeError):
    """The segment could not be created or mapped (e.g. /dev/shm too small), or the
    segment under the name is not the one the sidecar created."""


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
        self._mmap = mmap.mmap(fd, size + TAG_BYTES)
        os.close(fd)
        self._whole = memoryview(self._mmap)
        self.buffer = self._whole[:size]
        self.array = np.frombuffer(self._mmap, dtype=np.uint8, count=size)

    @property
    def tag(self) -> bytes:
        """The segment's identity (written once by its creator)."""
        return bytes(self._whole[self.size:self.size + TAG_BYTES])

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
            os.ftruncate(fd, size + TAG_BYTES)
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size + TAG_BYTES)
        except OSError as exc:
            os.close(fd)
            _posixshmem.shm_unlink("/" + name)
            raise ArenaError(
                f"arena {name}: cannot reserve {size} bytes of shared memory ({exc}); "
                "enlarge /dev/shm (an emptyDir with medium: Memory) or lower dram_capacity_bytes"
            ) from exc
        arena = cls(name, fd, size, block_bytes, owner=True)
        arena._whole[size:] = os.urandom(TAG_BYTES)
        return arena

    @classmethod
    def attach(cls, name: str, size: int, block_bytes: int, tag: bytes | None = None) -> "Arena":
        """Map an existing segment. With `tag` (what its creator reported), a segment
        that is not that creator's is refused with ArenaError."""
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        actual = os.fstat(fd).st_size
        if actual < size + TAG_BYTES:
            os.close(fd)
            raise ArenaError(f"arena {name}: segment holds {actual} bytes, expected {size + TAG_BYTES}")
        arena = cls(name, fd, size, block_bytes, owner=False)
        if tag is not None and arena.tag != tag:
            arena.close()
            raise ArenaError(f"arena {name}: the segment under this name belongs to another sidecar")
        return arena

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
            self._whole.release()
            self._mmap.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the process
        if self.owner:
            try:
                _posixshmem.shm_unlink("/" + self.name)
            except FileNotFoundError:
                pass


