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

LRU_EQUIVALENCE = 0.001
"""At a whole-cache window the cache is LRU to within 0.1% (the lru-window test
below): block-level differences in when a store lands and which tail goes first."""
SWEEP = ("0.01", "3M", "0.05", "0.075", "0.1", "0.15", "0.25", "0.5")
"""1% to 50% of the distinct blocks."""


@pytest.fixture(scope="module")
def shipped():
    trace = load_trace(SHIPPED)
    return trace, replay.prepare(trace)


def _ratio(trace, requests, capacity: str, policy: str = "kvtier") -> float:
    blocks = replay.capacity_blocks(capacity, trace)
    k = replay.replay_single(trace, requests, policy, blocks).hit_rate
    lru = replay.replay_single(trace, requests, "lru", blocks).hit_rate
    return k / lru


def test_the_shipped_trace_is_the_mooncake_conversation_trace(shipped):
    trace, _ = shipped
    assert len(trace) == 12_031 and trace.prompt_tokens == 144_793_823
    assert trace.unique_blocks() == 170_899


@pytest.mark.parametrize("capacity", SMALL)
def test_on_the_shipped_trace_kvtier_beats_lru_by_half_at_1_to_2_percent(shipped, capacity):
    assert _ratio(*shipped, capacity) >= 1.5       # measured 1.61-1.63x


def test_on_the_shipped_trace_kvtier_beats_lru_at_3m_tokens(shipped):
    # Measured 1.09x; the target is 1.15x (docs/TRACE_REPLAY.md): the steering that
    # reached 1.155x here lost to LRU by up to 3.6% at 7.5% (kvtier-symmetric-shadow).
    assert _ratio(*shipped, "3M") >= 1.08


@pytest.mark.parametrize("capacity", SWEEP)
def test_on_the_shipped_trace_kvtier_never_loses_to_lru_from_1_to_50_percent(shipped, capacity):
    # Measured >= 1.004x up to 15%; at 25% and 50% the window stays near the whole cache (LRU's
    # regime) and kvtier is 0.9998x-0.9999x, i.e. LRU to within its equivalence.
    assert _ratio(*shipped, capacity) >= 1.0 - LRU_EQUIVALENCE


@pytest.mark.parametrize("capacity", ("0.01", "3M", "0.05"))
def test_a_window_that_is_the_whole_cache_is_plain_lru_on_the_shipped_trace(shipped, capacity):
    # The pinned tier lives in the main region and shrinks with it; with no main
    # region left, nothing is held against recency (it held ~10% of the slots for
    # finished conversations, 0.95x LRU at 3M tokens, before).
    assert 1.0 - LRU_EQUIVALENCE <= _ratio(*shipped, capacity, policy="kvtier-lru-window") <= 1.002


@pytest.mark.parametrize("capacity", SWEEP)
def test_steered_by_arc_ghost_lists_the_window_never_loses_to_lru_on_the_shipped_trace(shipped, capacity):
    # The other ablation that never loses to LRU here; it gives up more of the gain
    # at small caches than the shipped steering (1.58x at 1%, 1.04x at 3M tokens).
    assert _ratio(*shipped, capacity, policy="kvtier-arc-window") >= 1.0


@pytest.mark.parametrize("shape", ["documents", "scan"])
@pytest.mark.parametrize("share", ["0.01", "0.05", "0.1", "0.25"])
def test_where_admission_matters_kvtier_is_at_least_lru_on_synthetic_traces(shape, share):
    trace = tracegen.generate(shape, 4_000)
    assert _ratio(trace, replay.prepare(trace), share) >= 1.0


@pytest.mark.parametrize("share", ["0.01", "0.05", "0.1", "0.25"])
def test_on_synthetic_conversations_kvtier_stays_within_1_5_percent_of_lru(share):
    # Measured: 0.990-0.998x LRU from 5% to 25% (it was 0.981-0.988x with the symmetric
    # steering from a 1% window); see docs/TRACE_REPLAY.md.
    trace = tracegen.conversation(4_000)
    assert _ratio(trace, replay.prepare(trace), share) >= 0.985
