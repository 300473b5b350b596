"""The engine socket's bytes (Unix domain socket, one sidecar, many engine processes).

Every message, both directions:

    body_len u32 | op u8 | request_id u32 | json_len u32 | JSON | tail

`tail` is raw little-endian uint32: token ids in LOOKUP and STORE_BEGIN requests,
slot ids in their answers. KV bytes never cross this socket: the engine copies them
out of (or into) the shared-memory arena named in the HELLO answer.

    HELLO        {}                                   -> {arena..., instance}
    LOOKUP       {root, digests?, local_tokens?, purpose?, source_peer?} + tokens
                                                      -> {hit, matched_tokens, tier, digests?} + slots
    RELEASE      {hit, instance?}                     -> {}
    STORE_BEGIN  {root, tp, rank}  + tokens           -> {ticket, first_block} + slots (ticket 0: declined)
    STORE_COMMIT {ticket, rank, instance?}            -> {committed}
    STORE_ABORT  {ticket, instance?}                  -> {}
    REPORT       {loaded_bytes, load_errors, loaded_tokens_*, ...} -> {}

REPORT carries what only the engine knows (`EngineReport`): the KV bytes it really
copied in from the arena and the prompt tokens they hold (by tier: what the engine
really got from kvtier), the blocks it told its scheduler it could not load (a
failed copy or checksum: the engine recomputes them), its own prefix-cache hits, and
the lookups it gave up on. The sidecar counts them for its /metrics.

`local_tokens` (optional, default 0) is the engine's own prefix-cache hit: the
sidecar fetches blocks from a peer only when the peer holds more than that, so a
prompt the engine already holds costs no peer bytes.

`purpose` (optional, `kvtier.names.PURPOSE_FIELD`) says why the engine looks up:
"warmup" (`names.WARMUP_PURPOSE`) for the rollout's warm-up requests, which the sidecar
counts in its warm-up counters (`kvtier_warmup_lookups_total`,
`kvtier_warmup_tokens_total{result}`) and in none of the traffic's (lookups, hits, the
hit figure); their stores are stored as any. Absent, or a purpose the sidecar does not
know: traffic (so engines and sidecars of either release work together; an older
sidecar ignores the field and counts the lookup as traffic, as before). A LOOKUP with a
purpose is never the root-only payload of the sidecar's fast path.

`source_peer` (optional, `SOURCE_PEER_FIELD`) is the request's peer-pull hint
(`kvtier.names.source_peer`: a router's "this pod holds the prefix", a `host:port`):
when the local tiers fall short, the sidecar asks that peer first, if it is a member of
its own fleet (a peer listed in `warm_peers`, or a live member of the global index; the
address as the peer advertises itself, or its host alone when exactly one member has
it), and never dials an address it does not already trust. What the peer sends is
verified as any peer's; a hint that names no member, or whose peer has nothing or fails,
leaves the lookup to the global index as before (outcomes: `kvtier_peer_hint_total`).
Not a string: refused. Absent: the lookup is exactly as before (an older sidecar
ignores the field). A LOOKUP with a hint is never the root-only payload of the fast
path.

`instance` (optional) is the HELLO answer's: a sidecar refuses a hit or ticket
named for another process (ids restart with the process; a stale one must never
name a live one).

`digests` (optional) asks for each hit block's xxh3-64, as computed after its store,
so an engine can verify what it copies out of the arena.

An answer carrying {"error": ...} is a refused request (bad input); the connection
stays usable.
"""
from __future__ import annotations

import json
import struct
from enum import IntEnum
from typing import Annotated

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

FRAME = struct.Struct("<IBII")  # body_len (json_len field + json + tail), op, request_id, json_len
# A 1M-token prompt's ids plus its JSON; anything larger is a broken or hostile client.
MAX_BODY_BYTES = 8 << 20
# One report's deltas, at most: a petabyte of loads, four billion blocks — far above
# what an engine copies between two reports, far below what overflows a float counter's
# precision.
MAX_REPORT_BYTES = 1 << 50
MAX_REPORT_BLOCKS = 1 << 32
# A report's fields: strict JSON integers in range (1e30, true and 1.5 are refused).
ReportBytes = Annotated[int, Field(ge=0, le=MAX_REPORT_BYTES, strict=True)]
ReportCount = Annotated[int, Field(ge=0, le=MAX_REPORT_BLOCKS, strict=True)]


SOURCE_PEER_FIELD = "source_peer"
"""The LOOKUP's optional peer-pull hint (see the module doc)."""


class EngineOp(IntEnum):
    HELLO = 1
    LOOKUP = 2
    RELEASE = 3
    STORE_BEGIN = 4
    STORE_COMMIT = 5
    STORE_ABORT = 6
    REPORT = 7
    REMOVED = 8  # the blocks the DRAM tier removed since a position of its removal log


MAX_REMOVED_PER_ANSWER = 4096
"""Block hashes one REMOVED answer names at most (16 bytes each in the tail); the
engine asks again from the answer's `next`."""


class EngineReport(BaseModel):
    """The engine's own counts since its last report (deltas, never totals)."""

    model_config = ConfigDict(extra="forbid")

    loaded_bytes: ReportBytes = 0  # KV bytes copied from the arena into the engine
    load_errors: ReportCount = 0  # blocks reported to the engine's scheduler as not loaded
    # The one definition of a hit: prompt tokens the engine loaded from kvtier, by the
    # tier its lookup found them in, next to its own prefix-cache hits and the prompts.
    loaded_tokens_dram: ReportCount = 0
    loaded_tokens_peer: ReportCount = 0
    local_hit_tokens: ReportCount = 0  # tokens the engine's own prefix cache held
    prompt_tokens: ReportCount = 0  # prompt tokens of the requests it looked up
    lookup_timeouts: ReportCount = 0  # lookups the engine stopped waiting for (its budget)
    breaker_trips: ReportCount = 0  # times the engine stopped asking this sidecar for a while


class FrameError(ValueError):
    """Bytes that are not an engine-protocol frame."""


def encode(op: int, request_id: int, payload: dict, tail: np.ndarray | bytes | None = None) -> bytes:
    return encode_json(op, request_id, json.dumps(payload, separators=(",", ":")).encode(), tail)


def encode_json(op: int, request_id: int, head: bytes, tail: np.ndarray | bytes | None = None) -> bytes:
    """`encode` with the payload's JSON already encoded (`head`, a JSON object's bytes)."""
    tail_bytes = b"" if tail is None else (tail if isinstance(tail, bytes) else np.ascontiguousarray(tail, dtype="<u4").tobytes())
    return FRAME.pack(4 + len(head) + len(tail_bytes), op, request_id, len(head)) + head + tail_bytes


def decode_header(raw: bytes) -> tuple[int, int, int, int]:
    """(body_len, op, request_id, json_len); body_len counts json_len's own 4 bytes."""
    body_len, op, request_id, json_len = FRAME.unpack(raw)
    if body_len > MAX_BODY_BYTES or json_len + 4 > body_len:
        raise FrameError(f"frame lengths out of range (body {body_len}, json {json_len})")
    return body_len, op, request_id, json_len


def split_body(rest: bytes, json_len: int) -> tuple[dict, np.ndarray]:
    """Parse the JSON and the uint32 tail that follow a header."""
    try:
        payload = json.loads(rest[:json_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameError(f"bad JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise FrameError("payload must be a JSON object")
    tail = rest[json_len:]
    if len(tail) % 4:
        raise FrameError("tail is not a whole number of uint32")
    return payload, np.frombuffer(tail, dtype="<u4")
