"""Deterministic stand-in KV: what "prefill" of (key root, tokens) yields, block by block.

Block i's bytes are a pure function of the chained hash of blocks 0..i, so - like real
KV - they depend on the whole prefix. Tests and the fleet compare every hit against
this recompute byte for byte; the numpy reference transformer
(`kvtier_app.reference_transformer`) can replace it.
"""
from __future__ import annotations

import numpy as np

from kvtier.keys import KeyRoot, block_hashes


def block_kv(block_hash: bytes, block_bytes: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(block_hash, "little")))
    return rng.integers(0, 256, size=block_bytes, dtype=np.uint8)


def prefill_kv(root: KeyRoot, tokens: np.ndarray, block_size: int, block_bytes: int) -> np.ndarray:
    """KV of every full block of the prompt, back to back: (n_blocks * block_bytes,) uint8."""
    hashes = block_hashes(root, tokens, block_size)
    if not hashes:
        return np.zeros(0, dtype=np.uint8)
    return np.concatenate([block_kv(h, block_bytes) for h in hashes])
