"""The decayed-frequency eviction policy."""
from __future__ import annotations

import math

import pytest

from kvtier.eviction import DecayedFrequencyPolicy, FrequencyState


def test_frequency_halves_every_half_life():
    p = DecayedFrequencyPolicy(half_life_s=10.0)
    s = FrequencyState()
    for _ in range(8):
        p.touch(s, 100.0)
    assert p.frequency(s, 100.0) == 8.0
    assert math.isclose(p.frequency(s, 110.0), 4.0)
    assert math.isclose(p.frequency(s, 130.0), 1.0)


def test_score_order_is_the_same_at_every_instant():
    p = DecayedFrequencyPolicy(half_life_s=10.0)
    often_long_ago, once_recently = FrequencyState(), FrequencyState()
    for _ in range(8):
        p.touch(often_long_ago, 0.0)
    p.touch(once_recently, 25.0)
    # 8 hits 2.5 half-lives ago ~ 1.41 now, above one hit now.
    for now in (25.0, 40.0, 1000.0):
        assert (p.frequency(often_long_ago, now) > p.frequency(once_recently, now)) == \
               (p.score(often_long_ago) > p.score(once_recently))
    p.touch(once_recently, 26.0)  # two recent hits overtake
    assert p.score(once_recently) > p.score(often_long_ago)


def test_untouched_state_sorts_first():
    p = DecayedFrequencyPolicy()
    touched = FrequencyState()
    p.touch(touched, 0.0)
    assert p.score(FrequencyState()) < p.score(touched)


@pytest.mark.parametrize("bad", [0, -1.0])
def test_half_life_must_be_positive(bad):
    with pytest.raises(ValueError, match="half_life_s"):
        DecayedFrequencyPolicy(bad)
