"""Copies of KV bytes between arrays at memory speed: big contiguous pieces move with
non-temporal stores.

A KV load or save is hundreds of MB in pieces of ~100 KiB (one block's layer).
glibc's memcpy streams only copies of several MiB; smaller ones use ordinary stores,
which read every destination line before writing it, so piece by piece a load runs
well below the speed of one memcpy of the same bytes (docs/VLLM.md). `copy` splits two
arrays of the same shape into their common contiguous trailing pieces and, where those are large,
hands all of them to one call of the compiled `kvtier._copy` (built by setup.py),
which streams each piece with the GIL released. Without the extension, or for small
pieces, it is `numpy.copyto`: the same bytes, only slower.
"""
from __future__ import annotations

import numpy as np

try:
    from kvtier import _copy as _native
except ImportError:  # a pure-Python build: numpy's copy does the work
    _native = None

STREAM_MIN_BYTES = 16 << 10
"""Pieces at least this large stream; below it the per-piece bookkeeping costs more
than the read-for-ownership it saves, and numpy's strided copy is as fast."""
STREAM_MIN_TOTAL_BYTES = 32 << 20
"""A copy (a whole request's, for a load or save made layer by layer) under this many
bytes uses ordinary stores: it lands in the last-level cache, which beats writing it
to memory (docs/VLLM.md). Copies of KV for real models are hundreds of MB."""


def stream_for(total_bytes: int) -> bool:
    """Whether a copy of `total_bytes` in all should stream."""
    return total_bytes >= STREAM_MIN_TOTAL_BYTES


def native() -> bool:
    """Whether the compiled streaming copy is loaded."""
    return _native is not None


def copy_pieces(dst_addrs: np.ndarray, src_addrs: np.ndarray, piece_bytes: int, stream: bool = True) -> None:
    """Copy `piece_bytes` from each source address to the matching destination, in
    one call (needs `native()`), streaming when `stream`. The caller derives every
    address from arrays it holds, each piece inside one of them, none overlapping."""
    if _native is None:
        raise RuntimeError("kvtier._copy is not built (scripts/setup.sh builds it); use copy()")
    _native.copy_pieces(np.ascontiguousarray(dst_addrs, dtype=np.int64),
                        np.ascontiguousarray(src_addrs, dtype=np.int64), int(piece_bytes), bool(stream))


def address(a: np.ndarray) -> int:
    """The address of `a`'s first element."""
    return a.__array_interface__["data"][0]


def _contiguous_tail(a: np.ndarray) -> int:
    """How many trailing axes of `a` lie in memory as one C-contiguous run."""
    expected = a.itemsize
    k = 0
    for size, stride in zip(reversed(a.shape), reversed(a.strides)):
        if size != 1 and stride != expected:
            break
        expected *= size
        k += 1
    return k


def _addresses(a: np.ndarray, outer: int) -> np.ndarray:
    """Start address of each piece of `a` over its first `outer` axes, C order."""
    offsets = np.zeros(1, dtype=np.int64)
    for size, stride in zip(a.shape[:outer], a.strides[:outer]):
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64) * stride).ravel()
    return offsets + address(a)


def copy(dst: np.ndarray, src: np.ndarray, total_bytes: int | None = None) -> None:
    """dst[...] = src for arrays of one shape and item size (bits, never converted).
    `total_bytes`: the whole transfer this copy is part of (default: this copy), which
    decides whether it streams (`stream_for`)."""
    if dst.shape != src.shape or dst.itemsize != src.itemsize:
        raise ValueError(f"copy between shapes {src.shape} and {dst.shape} (item sizes {src.itemsize}, "
                         f"{dst.itemsize})")
    if not dst.flags.writeable:
        raise ValueError("copy into a read-only array")
    tail = min(_contiguous_tail(dst), _contiguous_tail(src))
    outer = dst.ndim - tail
    piece_bytes = int(np.prod(dst.shape[outer:], dtype=np.int64)) * dst.itemsize
    if _native is None or piece_bytes < STREAM_MIN_BYTES or dst.size == 0 or \
            not stream_for(dst.nbytes if total_bytes is None else total_bytes):
        np.copyto(dst, src.view(dst.dtype) if src.dtype != dst.dtype else src)
        return
    if np.may_share_memory(dst, src):  # streaming assumes distinct memory, as memcpy does
        np.copyto(dst, src.view(dst.dtype) if src.dtype != dst.dtype else src)
        return
    _native.copy_pieces(_addresses(dst, outer), _addresses(src, outer), piece_bytes)
