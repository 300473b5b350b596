"""Synthetic traces in the replay format, with shapes unlike the shipped one.

The shipped trace is one shape of traffic (conversations over one system prompt).
These generators give others, so a policy is checked on more than the trace it was
measured on. Each is seeded and pure; `to_jsonl` writes the same format
`kvtier.sim.trace` reads.

- `documents`     hot system prompts in front of mostly one-shot documents (RAG over a
                  large corpus): frequency matters, recency barely.
- `scan`          a Zipf-hot working set with long one-shot scans streaming through
                  (batch jobs over fresh inputs): the classic case against LRU.
- `conversation`  multi-turn sessions on a few system prompts, with long and varied
                  gaps between turns (log-normal, unlike the shipped trace's).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvtier.sim.trace import DEFAULT_TRACE_BLOCK_TOKENS, Trace

SHAPES = ("documents", "scan", "conversation")


class _Ids:
    """Chained block ids: a block's id is decided by its parent's id and its content,
    so two prompts share their first j ids exactly when they share j blocks."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, tuple], int] = {}

    def chain(self, blocks: list[tuple]) -> list[int]:
        out, parent = [], -1
        for b in blocks:
            key = (parent, b)
            parent = self._ids.setdefault(key, len(self._ids))
            out.append(parent)
        return out


def _segment(kind: str, ident: int, n: int) -> list[tuple]:
    return [(kind, ident, i) for i in range(n)]


def _trace(times, blocks_per_request, ids: _Ids, rng, block_tokens: int, name: str) -> Trace:
    order = np.argsort(np.asarray(times), kind="stable")
    chains = [ids.chain(blocks_per_request[i]) for i in order]
    tails = rng.integers(1, block_tokens, size=len(chains))   # a partial last block
    inputs = np.asarray([len(c) * block_tokens + int(t) for c, t in zip(chains, tails)], dtype=np.int64)
    return Trace(np.asarray(times, dtype=np.float64)[order], inputs,
                 rng.integers(20, 800, size=len(chains)).astype(np.int64),
                 [np.asarray(c, dtype=np.int64) for c in chains], block_tokens, f"synthetic:{name}")


def _zipf(rng, n: int, s: float, size: int) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** s
    return rng.choice(n, size=size, p=w / w.sum())


def documents(n_requests: int = 6_000, seed: int = 0, block_tokens: int = DEFAULT_TRACE_BLOCK_TOKENS) -> Trace:
    """20 system prompts (Zipf 1.1, 2-8 blocks) each followed by a document: 75% of
    documents are seen once, the rest come from a pool of 300 (Zipf 0.9)."""
    rng = np.random.default_rng(seed)
    sys_len = rng.integers(2, 9, size=20)
    pool_len = rng.integers(4, 41, size=300)
    times = np.cumsum(rng.exponential(0.25, size=n_requests))
    prompts = _zipf(rng, 20, 1.1, n_requests)
    pooled = rng.random(n_requests) < 0.25
    pool_pick = _zipf(rng, 300, 0.9, n_requests)
    fresh_len = rng.integers(4, 41, size=n_requests)
    reqs = []
    for i in range(n_requests):
        p = int(prompts[i])
        doc = _segment("pool", int(pool_pick[i]), int(pool_len[pool_pick[i]])) if pooled[i] \
            else _segment("doc", i, int(fresh_len[i]))
        reqs.append(_segment("sys", p, int(sys_len[p])) + doc)
    return _trace(times, reqs, _Ids(), rng, block_tokens, "documents")


def scan(n_requests: int = 6_000, seed: int = 0, block_tokens: int = DEFAULT_TRACE_BLOCK_TOKENS) -> Trace:
    """A working set of 400 prompts (Zipf 0.8, 2-12 blocks) interleaved with scans:
    every fifth request is a one-shot input of 50-150 blocks."""
    rng = np.random.default_rng(seed)
    hot_len = rng.integers(2, 13, size=400)
    times = np.cumsum(rng.exponential(0.25, size=n_requests))
    pick = _zipf(rng, 400, 0.8, n_requests)
    scan_len = rng.integers(50, 151, size=n_requests)
    reqs = []
    for i in range(n_requests):
        if i % 5 == 4:
            reqs.append(_segment("scan", i, int(scan_len[i])))
        else:
            reqs.append(_segment("hot", int(pick[i]), int(hot_len[pick[i]])))
    return _trace(times, reqs, _Ids(), rng, block_tokens, "scan")


def conversation(n_requests: int = 6_000, seed: int = 0, block_tokens: int = DEFAULT_TRACE_BLOCK_TOKENS) -> Trace:
    """Sessions of 1-12 turns on 5 system prompts (4 blocks); each turn re-sends the
    transcript and adds 1-6 blocks; gaps between turns are log-normal (median 40 s,
    a long tail to many minutes); sessions start as a Poisson stream."""
    rng = np.random.default_rng(seed)
    times, reqs = [], []
    t = 0.0
    session = 0
    while len(reqs) < n_requests:
        t += rng.exponential(1.5)
        turns = int(rng.integers(1, 13))
        sys_prompt = int(rng.integers(0, 5))
        transcript = _segment("sys", sys_prompt, 4)
        at = t
        for turn in range(turns):
            transcript = transcript + _segment("turn", session * 100 + turn, int(rng.integers(1, 7)))
            times.append(at)
            reqs.append(list(transcript))
            at += float(rng.lognormal(np.log(40.0), 1.0))
        session += 1
    return _trace(times[:n_requests], reqs[:n_requests], _Ids(), rng, block_tokens, "conversation")


GENERATORS = {"documents": documents, "scan": scan, "conversation": conversation}


def generate(shape: str, n_requests: int = 6_000, seed: int = 0) -> Trace:
    if shape not in GENERATORS:
        raise ValueError(f"unknown trace shape {shape!r}; choose from {', '.join(SHAPES)}")
    return GENERATORS[shape](n_requests, seed)


def to_jsonl(trace: Trace, path: Path) -> Path:
    """Write a trace in the replay format (timestamps in whole milliseconds)."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(len(trace)):
            ids = trace.ids[i].tolist()
            if trace.input_length[i] % trace.block_tokens:
                ids.append(_TAIL_ID_BASE + i)  # the partial last block's id, unique
            f.write(json.dumps({"timestamp": int(round(trace.time_s[i] * 1000)),
                                "input_length": int(trace.input_length[i]),
                                "output_length": int(trace.output_length[i]), "hash_ids": ids}) + "\n")
    return path


_TAIL_ID_BASE = 1 << 30
"""Partial last blocks are written with ids above every chained id."""
