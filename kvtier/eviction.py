"""Eviction policy: frequency-aware with exponential decay (TinyLFU-style).

The index evicts only unpinned leaves, tails first (see `kvtier.radix`); this module
only says WHICH evictable leaf goes first. Each node keeps a decayed hit frequency

    f(now) = f(t) * 2 ** (-(now - t) / half_life_s)

and a touch adds one. Two nodes compare the same way at every instant, because
log2 f(now) = log2 f(t) + t / half_life_s - now / half_life_s and the last term is
common to both. So the sortable key

    score = log2 f(t) + t / half_life_s

never changes between touches, which lets the index keep evictable leaves in a heap.
A prefix hit once a long time ago scores below one hit often and recently; a dead
conversation ages out by decay without anyone declaring it dead. Hot (pinned-tier)
nodes sort after every ordinary node.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_HALF_LIFE_S = 300.0
"""A prefix's frequency halves every five minutes unseen: long enough to keep a system
prompt across a quiet spell, short enough that a finished conversation ages out."""


@dataclass(slots=True)
class FrequencyState:
    """Decayed hit count of one node, as of time `t_s`."""

    freq: float = 0.0
    t_s: float = 0.0


class DecayedFrequencyPolicy:
    """The eviction strategy: `touch` on access, `score` to order victims (low first)."""

    __slots__ = ("half_life_s",)

    def __init__(self, half_life_s: float = DEFAULT_HALF_LIFE_S) -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self.half_life_s = float(half_life_s)

    def touch(self, state: FrequencyState, now_s: float, weight: float = 1.0) -> None:
        """Record one access at `now_s` (decaying what was there first)."""
        state.freq = self.frequency(state, now_s) + weight
        state.t_s = now_s

    def frequency(self, state: FrequencyState, now_s: float) -> float:
        """The decayed count at `now_s`."""
        if state.freq == 0.0:
            return 0.0
        return state.freq * math.exp2(-(now_s - state.t_s) / self.half_life_s)

    def score(self, state: FrequencyState) -> float:
        """Time-invariant sortable key: lower is evicted first."""
        if state.freq <= 0.0:
            return -math.inf
        return math.log2(state.freq) + state.t_s / self.half_life_s
