"""The cache policy on recorded and synthetic traffic, against plain LRU at the same capacity.

Deterministic: the replays are pure functions of the trace. The shipped trace is the
Mooncake FAST'25 conversation trace (bench/traces); the synthetic ones have other
shapes, so the policy is not judged only on the trace it was measured on.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.sim import replay, tracegen
from kvtier.sim.trace import load_trace

SHIPPED = Path(__file__).resolve().parents[2] / "bench" / "traces" / "mooncake_conversation_trace.jsonl.gz"

SMALL = ("0.01", "0.02")
"""Capacities where admission matters most: 1-2% of the distinct blocks."""

SWEEP = ("0.01", "3M", "0.05", "0.075", "0.1", "0.15", "0.25", "0.5")
"""1% to 50% of the distinct blocks."""


@pytest.fixture(scope="module")
def shipped():
    trace = load_trace(SHIPPED)
    return trace, replay.prepare(trace)


def _matched(trace, requests, capacity: str, policy: str) -> int:
    return replay.replay_single(trace, requests, policy, replay.capacity_blocks(capacity, trace)).matched_tokens


def _ratio(trace, requests, capacity: str, policy: str = "kvtier") -> float:
    return _matched(trace, requests, capacity, policy) / _matched(trace, requests, capacity, "lru")


def test_the_shipped_trace_is_the_mooncake_conversation_trace(shipped):
    trace, _ = shipped
    assert len(trace) == 12_031 and trace.prompt_tokens == 144_793_823
    assert trace.unique_blocks() == 170_899


@pytest.mark.parametrize("capacity", SMALL)
def test_on_the_shipped_trace_kvtier_beats_lru_by_three_fifths_at_1_to_2_percent(shipped, capacity):
    assert _ratio(*shipped, capacity) >= 1.6       # measured 1.70-1.73x


def test_on_the_shipped_trace_kvtier_beats_lru_by_15_percent_at_3m_tokens(shipped):
    assert _ratio(*shipped, "3M") >= 1.15          # measured 1.18x


@pytest.mark.parametrize("capacity", SWEEP)
def test_on_the_shipped_trace_kvtier_never_loses_to_lru_from_1_to_50_percent(shipped, capacity):
    # Measured 1.020-1.73x up to 10%; from 15% up the miniatures choose the whole-cache
    # window and kvtier matches exactly what LRU matches.
    assert _matched(*shipped, capacity, "kvtier") >= _matched(*shipped, capacity, "lru")


@pytest.mark.parametrize("capacity", ("0.01", "3M", "0.1", "0.5"))
def test_a_window_that_is_the_whole_cache_is_exactly_plain_lru_on_the_shipped_trace(shipped, capacity):
    # With no main region the least recent leaf goes, whichever region holds it; the
    # pinned tier lives in the main region and shrinks with it.
    assert _matched(*shipped, capacity, "kvtier-lru-window") == _matched(*shipped, capacity, "lru")


@pytest.mark.parametrize("shape", ["documents", "scan"])
@pytest.mark.parametrize("share", ["0.01", "0.05", "0.1", "0.25"])
def test_where_admission_matters_kvtier_beats_lru_on_synthetic_traces(shape, share):
    trace = tracegen.generate(shape, 4_000)
    assert _ratio(trace, replay.prepare(trace), share) >= 1.0    # measured 1.006-1.96x


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_on_synthetic_conversations_kvtier_stays_within_a_tenth_of_a_percent_of_lru(seed):
    # Measured: 1.04-1.21x LRU at 1-5% of the distinct blocks, LRU's own figure from 10%
    # up, except 0.9997x at 10% on seed 2 (docs/TRACE_REPLAY.md).
    trace = tracegen.conversation(4_000, seed=seed)
    requests = replay.prepare(trace)
    for share in ("0.01", "0.05", "0.1", "0.25"):
        assert _ratio(trace, requests, share) >= 0.999, share
