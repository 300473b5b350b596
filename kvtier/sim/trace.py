"""Request traces in the field's JSONL format, turned into prompts the caches can serve.

One JSON object per line (the Mooncake / Dynamo trace format):

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

`timestamp` is milliseconds from the start of the trace, lengths are tokens, and
`hash_ids` names the prompt's blocks of `block_tokens` tokens (512 in the published
traces), chained: two requests share their first j ids exactly when they share their
first j blocks. The last id may name a partial block.

Replay turns each hash id into one cache block of `block_elems` deterministic token
elements (one element stands for `block_tokens / block_elems` real tokens), so the
real prefix index matches tokens exactly as it would on the real prompt: requests
sharing their first j ids share exactly their first j blocks. A trailing partial
block becomes elements no other request has (a partial block is never cached).
Hit rates are reported in real tokens: matched full blocks x `block_tokens` over
`input_length`.
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_TRACE_BLOCK_TOKENS = 512
"""Tokens per hash id in the published Mooncake traces."""

DEFAULT_BLOCK_ELEMS = 16
"""Token elements per hash id in replay: the engine's 16-token page, so the prefix
index walks blocks of the size it walks in production."""

# Odd 32-bit multipliers: block tokens are an affine walk mod 2**32 from a start that
# is a bijection of the block id, so distinct ids differ in their first token.
_ID_MIX = 0x9E3779B1
_STEP_MIX = 0x85EBCA6B
_MASK32 = 0xFFFFFFFF
_MAX_ID = (1 << 31) - 1
"""Ids stay below 2**31 so the unique tail ids (above every trace id) never wrap."""


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the line and the fix."""


class TraceRecord(BaseModel):
    """One request of a trace file."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    timestamp: float = Field(ge=0, description="arrival, milliseconds from the start of the trace")
    input_length: int = Field(ge=1, description="prompt tokens")
    output_length: int = Field(ge=0, description="generated tokens")
    hash_ids: list[int] = Field(description="one id per prompt block, chained")


@dataclass(slots=True)
class Trace:
    """A parsed trace, sorted by arrival. `ids[i]` are request i's FULL blocks' ids."""

    time_s: np.ndarray
    input_length: np.ndarray
    output_length: np.ndarray
    ids: list[np.ndarray]
    block_tokens: int
    source: str = ""
    _unique: int | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.time_s)

    @property
    def prompt_tokens(self) -> int:
        return int(self.input_length.sum())

    def unique_blocks(self) -> int:
        """Distinct full blocks in the whole trace (what infinite capacity holds)."""
        if self._unique is None:
            self._unique = int(np.unique(np.concatenate(self.ids)).size) if self.ids else 0
        return self._unique

    def max_id(self) -> int:
        return max((int(a.max()) for a in self.ids if a.size), default=-1)

    def head(self, n: int) -> Trace:
        """The first n requests (quick runs)."""
        return Trace(self.time_s[:n], self.input_length[:n], self.output_length[:n], self.ids[:n],
                     self.block_tokens, self.source)


def check_block_tokens(block_tokens: int, block_elems: int = DEFAULT_BLOCK_ELEMS) -> None:
    if block_tokens < 1 or block_elems < 1:
        raise TraceError(f"tokens per hash id must be >= 1 (got {block_tokens}) and elements per "
                         f"block >= 1 (got {block_elems})")


def load_trace(path: str | Path, block_tokens: int = DEFAULT_TRACE_BLOCK_TOKENS) -> Trace:
    """Parse a JSONL trace (gzip if the name ends in .gz). Raises `TraceError` naming
    the first bad line; requests are sorted by timestamp (stable)."""
    check_block_tokens(block_tokens)
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from None
    return parse_trace(lines, block_tokens, source=str(path))


def parse_trace(lines: list[str], block_tokens: int = DEFAULT_TRACE_BLOCK_TOKENS, source: str = "") -> Trace:
    """Parse trace lines (blank lines are skipped)."""
    check_block_tokens(block_tokens)
    times, ins, outs, ids = [], [], [], []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        rec = _record(line, no, block_tokens)
        times.append(rec.timestamp / 1000.0)
        ins.append(rec.input_length)
        outs.append(rec.output_length)
        ids.append(np.asarray(rec.hash_ids[:rec.input_length // block_tokens], dtype=np.int64))
    if not times:
        raise TraceError(f"trace {source or '(input)'} has no requests")
    order = np.argsort(np.asarray(times), kind="stable")
    return Trace(np.asarray(times)[order], np.asarray(ins, dtype=np.int64)[order],
                 np.asarray(outs, dtype=np.int64)[order], [ids[i] for i in order], block_tokens, source)


def _record(line: str, no: int, block_tokens: int) -> TraceRecord:
    try:
        rec = TraceRecord.model_validate(json.loads(line))
    except json.JSONDecodeError as exc:
        raise TraceError(f"line {no}: not JSON ({exc.msg}); each line must be one JSON object") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(object)"
        raise TraceError(f"line {no}: {where}: {err['msg']}") from None
    want_full, want_max = rec.input_length // block_tokens, -(-rec.input_length // block_tokens)
    if not want_full <= len(rec.hash_ids) <= want_max:
        raise TraceError(f"line {no}: {len(rec.hash_ids)} hash_ids for input_length {rec.input_length}; at "
                         f"{block_tokens} tokens per id that needs {want_max} (set --trace-block-tokens to "
                         f"the block size the trace was written with)")
    if any(h < 0 or h > _MAX_ID for h in rec.hash_ids):
        raise TraceError(f"line {no}: hash_ids must be in [0, {_MAX_ID}]")
    return rec


class TracePrompts:
    """Token elements of each request's prompt, at `block_elems` elements per hash id.

    Block id h is the walk `start(h) + k * STEP` (k < block_elems) mod 2**32 with a
    start that differs for every id. A partial last block gets an id above every id
    of the trace, unique to its request, and as many elements as its share of a
    block (at least one).
    """

    def __init__(self, trace: Trace, block_elems: int = DEFAULT_BLOCK_ELEMS) -> None:
        check_block_tokens(trace.block_tokens, block_elems)
        self.trace = trace
        self.block_elems = block_elems
        self._steps = (np.arange(block_elems, dtype=np.uint64) * np.uint64(_STEP_MIX)) & np.uint64(_MASK32)
        tail_tokens = trace.input_length % trace.block_tokens
        self.tail_elems = np.where(tail_tokens > 0, np.maximum(1, tail_tokens * block_elems // trace.block_tokens), 0)
        self._tail_base = trace.max_id() + 1

    def __len__(self) -> int:
        return len(self.trace)

    def tokens(self, i: int) -> np.ndarray:
        """Request i's prompt as uint32 elements."""
        ids = self.trace.ids[i]
        tail = int(self.tail_elems[i])
        if tail:
            ids = np.append(ids, self._tail_base + i)
        starts = (ids.astype(np.uint64) * np.uint64(_ID_MIX)) & np.uint64(_MASK32)
        out = ((starts[:, None] + self._steps[None, :]) & np.uint64(_MASK32)).astype(np.uint32).reshape(-1)
        if tail:
            out = out[:len(out) - self.block_elems + tail]
        return out

    def prompt_elems(self) -> np.ndarray:
        return np.asarray([len(a) for a in self.trace.ids], dtype=np.int64) * self.block_elems + self.tail_elems
