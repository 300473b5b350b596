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

SMALL = ("0.01", "0.02", "3M")
"""Capacities where admission matters: up to 3M tokens (~3.4% of the distinct blocks)."""
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
def test_on_the_shipped_trace_kvtier_beats_lru_by_15_percent_up_to_3m_tokens(shipped, capacity):
    assert _ratio(*shipped, capacity) >= 1.15


@pytest.mark.parametrize("capacity", SWEEP)
def test_on_the_shipped_trace_kvtier_stays_within_4_percent_of_lru_from_1_to_50_percent(shipped, capacity):
    # The target is >= 1.0 everywhere (docs/TRACE_REPLAY.md); measured, kvtier falls short between
    # 5% and 20% (worst 0.964x at 7.5%). This pins what holds so it cannot regress.
    assert _ratio(*shipped, capacity) >= 0.96


@pytest.mark.parametrize("capacity", ("0.01", "3M", "0.05"))
def test_a_window_that_is_the_whole_cache_is_plain_lru_on_the_shipped_trace(shipped, capacity):
    # The pinned tier lives in the main region and shrinks with it; with no main
    # region left, nothing is held against recency (it held ~10% of the slots for
    # finished conversations, 0.95x LRU at 3M tokens, before).
    assert 0.999 <= _ratio(*shipped, capacity, policy="kvtier-lru-window") <= 1.002


@pytest.mark.parametrize("capacity", SWEEP)
def test_steered_by_arc_ghost_lists_the_window_never_loses_to_lru_on_the_shipped_trace(shipped, capacity):
    # The ablation that meets the >= LRU target everywhere (it gives up most of the
    # gain at 3M tokens: 1.04x); the shipped steering keeps the gain and not this.
    assert _ratio(*shipped, capacity, policy="kvtier-arc-window") >= 1.0


@pytest.mark.parametrize("shape", ["documents", "scan"])
@pytest.mark.parametrize("share", ["0.01", "0.05", "0.1", "0.25"])
def test_where_admission_matters_kvtier_is_at_least_lru_on_synthetic_traces(shape, share):
    trace = tracegen.generate(shape, 4_000)
    assert _ratio(trace, replay.prepare(trace), share) >= 1.0


@pytest.mark.parametrize("share", ["0.01", "0.05", "0.1", "0.25"])
def test_on_synthetic_conversations_kvtier_stays_within_3_percent_of_lru(share):
    # Measured: 0.981-0.988x LRU from 5% to 25% (holding the window on a level
    # sample; it was 0.970-0.982x when a level sample shrank it); see docs/TRACE_REPLAY.md.
    trace = tracegen.conversation(4_000)
    assert _ratio(trace, replay.prepare(trace), share) >= 0.97
