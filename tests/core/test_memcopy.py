"""kvtier.memcopy: the streaming copy moves exactly the bytes numpy's copy would, for
every way a KV load or save slices its arrays, and refuses what it cannot copy."""
from __future__ import annotations

import numpy as np
import pytest

from kvtier import _compiled, memcopy

STREAMED = memcopy.STREAM_MIN_TOTAL_BYTES
"""Passed as the transfer's total: these small copies take the streaming path."""


def _random(shape, dtype=np.uint8, seed=0) -> np.ndarray:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8).view(dtype).reshape(shape)


def test_the_set_up_built_the_streaming_copy():
    assert "kvtier._copy" in _compiled.NATIVE_MODULES
    assert memcopy.native(), "run scripts/setup.sh: it builds kvtier._copy"


def test_only_transfers_too_big_for_the_cache_stream():
    assert memcopy.stream_for(memcopy.STREAM_MIN_TOTAL_BYTES)
    assert not memcopy.stream_for(memcopy.STREAM_MIN_TOTAL_BYTES - 1)


def test_a_small_transfer_copies_exactly_without_streaming():
    src = _random((6, 3, 64 << 10), seed=4)
    dst = np.zeros((6, 64 << 10), dtype=np.uint8)
    memcopy.copy(dst, src[:, 2])  # its own 384 KiB as the total: ordinary stores
    assert np.array_equal(dst, src[:, 2])


@pytest.mark.parametrize("piece_bytes", [64 << 10, 128 << 10 | 48, 16 << 10, 1000])
def test_strided_pieces_land_exactly(piece_bytes):
    # a run of 5 blocks of 3 layers in the arena -> one layer's pages, and back
    blocks = _random((5, 3, piece_bytes))
    pages = np.zeros((9, piece_bytes), dtype=np.uint8)
    memcopy.copy(pages[2:7], blocks[:, 1], STREAMED)
    assert np.array_equal(pages[2:7], blocks[:, 1])
    assert not pages[:2].any() and not pages[7:].any()  # nothing beyond the pieces
    back = np.zeros_like(blocks)
    memcopy.copy(back[:, 2], pages[2:7], STREAMED)
    assert np.array_equal(back[:, 2], blocks[:, 1]) and not back[:, :2].any()


def test_an_unaligned_destination_and_a_ragged_tail_copy_exactly():
    src = _random(3 * (40 << 10) + 7, seed=1)
    dst = np.zeros(src.size + 64, dtype=np.uint8)
    memcopy.copy(dst[5 : 5 + src.size], src, STREAMED)  # 5: no 32-byte alignment, a tail under a vector
    assert np.array_equal(dst[5 : 5 + src.size], src)
    assert not dst[:5].any() and not dst[5 + src.size :].any()


def test_bits_of_one_width_copy_across_dtypes_unconverted():
    src = _random((4, 2, 8192), np.float16, seed=2)  # NaN patterns included: bits, not values
    dst = np.zeros((4, 2, 8192), dtype=np.int16)
    memcopy.copy(dst, src, STREAMED)
    assert np.array_equal(dst, src.view(np.int16))


def test_overlapping_arrays_copy_as_numpy_does():
    a = _random(256 << 10, seed=3)
    want = a.copy()
    memcopy.copy(a[64 << 10 :], a[: 192 << 10], STREAMED)
    np.copyto(want[64 << 10 :], want[: 192 << 10].copy())
    assert np.array_equal(a, want)


def test_mismatched_shapes_or_a_read_only_destination_are_refused_untouched():
    src = _random((4, 32 << 10))
    dst = np.zeros((4, 16 << 10), dtype=np.uint8)
    with pytest.raises(ValueError, match="shapes"):
        memcopy.copy(dst, src)
    assert not dst.any()
    ro = np.zeros_like(src)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        memcopy.copy(ro, src)
    assert not ro.any()
