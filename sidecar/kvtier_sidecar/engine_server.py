"""The engine socket: an asyncio Unix-socket server speaking `engine_proto`.

Each connection is one engine process. Its pinned hits and open store tickets are
remembered per connection and released when it goes away, so a crashed engine never
leaks pins (which would make blocks unevictable) or reserved slots. They also belong
to it: a RELEASE, STORE_COMMIT or STORE_ABORT naming another connection's hit or
ticket (or a rank another connection began) is answered with an error and changes
nothing, and so is one naming another sidecar process (`instance`: a predecessor's
hit or ticket, sent by an engine that has not noticed the restart). A frame whose
header arrived must arrive whole within FRAME_BODY_TIMEOUT_S, or the connection is
closed (an idle connection between frames is fine): one sweep every FRAME_SWEEP_S
closes the late ones, so a frame costs no timer of its own. The socket itself is
mode 0660 in the pod's private runtime directory.

The per-request path is kept to what the request needs. Each connection is a
`BufferedProtocol` (`_Connection`): the event loop reads straight into the
connection's buffer and hands it over, and every whole frame in it is answered right
there, in order; no stream reader, task, future or await per frame. A LOOKUP the
local tiers answer (`Sidecar.lookup_now`) is answered synchronously; one that asks a
peer runs as a task, and the connection reads nothing more until it is answered (so
answers keep the order of requests, as before). A LOOKUP or STORE_BEGIN whose JSON
bytes were seen before reuses their parse and key root (an engine sends the same few
payloads again and again), and a LOOKUP's answer is formatted directly.
"""
from __future__ import annotations

import array
import asyncio
import json
import logging
import os
import sys

import numpy as np
from pydantic import ValidationError

from kvtier.keys import KeyRoot
from kvtier.names import PURPOSE_FIELD, WARMUP_PURPOSE

from .engine_proto import (
    FRAME, MAX_BODY_BYTES, MAX_REMOVED_PER_ANSWER, SOURCE_PEER_FIELD, EngineOp, EngineReport, FrameError, encode,
    encode_json, split_body,
)
from .service import LookupAnswer

log = logging.getLogger("kvtier.sidecar.engine")

# Parsed key roots by their JSON text, and parsed root-only payloads by their bytes:
# engines send the same few roots again and again.
ROOT_CACHE_SIZE = 4096
# Hit and ticket ids come from one counter per sidecar process; 2**63 is never reached.
MAX_ID = (1 << 63) - 1
# Tensor-parallel degrees beyond this are not a real deployment (and would divide no kv-head count).
MAX_TP = 1024
# A frame's body, once its header arrived, comes within this or the connection goes:
# an engine writes a frame in one go, a 1M-token prompt's ids in milliseconds.
FRAME_BODY_TIMEOUT_S = 5.0
# How often the late frames are looked for: a late one is closed within
# FRAME_BODY_TIMEOUT_S + FRAME_SWEEP_S of its header.
FRAME_SWEEP_S = 0.5
# A connection's receive buffer: a lookup of a ~16k-token prompt arrives whole in it;
# a larger frame gets a buffer of its own size (at most MAX_BODY_BYTES) while it lasts.
RECV_BUFFER_BYTES = 1 << 16
# Answers queued on a connection past this and it reads no more frames until the
# engine has taken them (the transport calls pause_writing / resume_writing).
WRITE_HIGH_WATER = 1 << 20
# Errors that are the request's fault: answered {"error": ...}, the connection stays.
_REFUSED = (FrameError, ValueError, ValidationError, KeyError, TypeError, OverflowError)
_HEADER = FRAME.size
_LOOKUP = int(EngineOp.LOOKUP)
_U32 = np.dtype("<u4")


class EngineServer:
    def __init__(self, service, path: str, hello: dict) -> None:
        self.service = service
        self.path = path
        self.hello = hello
        self._server: asyncio.AbstractServer | None = None
        self._roots: dict[str, KeyRoot] = {}
        # A root-only payload's JSON bytes -> (payload, its key root); never mutated.
        self._payloads: dict[bytes, tuple[dict, KeyRoot]] = {}
        # Connections with a frame's header in and its body not yet: -> (deadline, transport).
        self._partial: dict[object, tuple[float, asyncio.BaseTransport]] = {}
        self._sweeper: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.connections = 0
        self.bad_frames = 0

    async def start(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        loop = self._loop = asyncio.get_running_loop()
        # backlog: a burst of engine connections (1,000 concurrent lookups) must not be refused.
        self._server = await loop.create_unix_server(lambda: _Connection(self), path=self.path, backlog=2048)
        os.chmod(self.path, 0o660)
        self._sweeper = loop.create_task(self._sweep_late_frames())

    async def _sweep_late_frames(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(FRAME_SWEEP_S)
            now = loop.time()
            for conn, (deadline, transport) in list(self._partial.items()):
                if now >= deadline:
                    del self._partial[conn]
                    self.bad_frames += 1
                    log.warning("engine connection closed: a frame did not arrive whole within %.0fs",
                                FRAME_BODY_TIMEOUT_S)
                    transport.abort()  # its connection_lost cleans up

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _root(self, raw) -> KeyRoot:
        key = repr(raw)
        root = self._roots.get(key)
        if root is None:
            root = KeyRoot.from_wire(raw)
            if len(self._roots) >= ROOT_CACHE_SIZE:
                self._roots.clear()
            self._roots[key] = root
        return root

    def _parse(self, op: int, raw: bytes, tail: bytes) -> tuple[dict, np.ndarray, KeyRoot | None]:
        """(payload, tail, key root of a LOOKUP or STORE_BEGIN, else None) of a frame's
        JSON bytes `raw` and its tail bytes."""
        if op not in _ROOTED:
            payload, tail_arr = split_body(raw + tail, len(raw))
            return payload, tail_arr, None
        known = self._payloads.get(raw)
        if known is not None:
            if len(tail) % 4:
                raise FrameError("tail is not a whole number of uint32")
            return known[0], np.frombuffer(tail, dtype="<u4"), known[1]
        payload, tail_arr = split_body(raw + tail, len(raw))
        root = self._root(payload["root"])
        if len(payload) == 1:  # root only: the same bytes always parse to the same request
            if len(self._payloads) >= ROOT_CACHE_SIZE:
                self._payloads.clear()
            self._payloads[raw] = (payload, root)
        return payload, tail_arr, root

    def _lookup(self, conn: "_Connection", rid: int, raw: bytes, tail: bytes):
        """`_answer` of a LOOKUP: a plain one (its root-only payload seen before) in the
        fewest steps, any other as every request."""
        known = self._payloads.get(raw)
        if known is None or not tail or len(tail) & 3:
            return self._answer(conn, EngineOp.LOOKUP, rid, raw, tail)
        try:
            # The ids as they arrived (a read-only array over this frame's own bytes):
            # a lookup keeps no token array past its answer.
            answer = self.service.lookup_now(known[1], np.frombuffer(tail, _U32), conn, 0)
            if answer is None:
                return FRAME.pack(4 + len(_MISS_JSON), EngineOp.LOOKUP, rid, len(_MISS_JSON)) + _MISS_JSON
            if type(answer) is not LookupAnswer:
                return self._answer_later(conn, rid, known[0], answer)
            conn.hits.add(answer.hit_id)
            head = (b'{"hit":%d,"matched_tokens":%d,"tier":%s,"dram_tokens":%d}'
                    % (answer.hit_id, answer.matched_tokens, _TIER_JSON.get(answer.tier) or json.dumps(answer.tier).encode(),
                       answer.dram_tokens))
            slots = _slot_bytes(answer.slots)
        except _REFUSED as exc:
            self.bad_frames += 1
            return encode(EngineOp.LOOKUP, rid, {"error": _message(exc)})
        return FRAME.pack(4 + len(head) + len(slots), EngineOp.LOOKUP, rid, len(head)) + head + slots

    def _answer(self, conn: "_Connection", op: int, rid: int, raw: bytes, tail: bytes):
        """The answer frame's bytes, or a coroutine that makes them (a LOOKUP that asks a peer)."""
        try:
            payload, tail_arr, root = self._parse(op, raw, tail)
            if op == EngineOp.LOOKUP:
                # The ids as they arrived (a read-only array over this frame's own bytes):
                # a lookup keeps no token array past its answer.
                if tail_arr.size == 0:
                    raise ValueError("token ids missing")
                tokens = tail_arr
                if len(payload) > 1:  # a root-only LOOKUP (the fast path's) has none of these
                    local = _int(payload, "local_tokens", 0, len(tokens), default=0)
                    warmup = _warmup(payload)
                    hint = _source_peer(payload)
                else:
                    local, warmup, hint = 0, False, None
                answer = self.service.lookup_now(root, tokens, conn, local, warmup, hint)
                if answer is not None and type(answer) is not LookupAnswer:
                    return self._answer_later(conn, rid, payload, answer)
                head, out_tail = self._lookup_reply(conn, payload, answer)
                return encode_json(op, rid, head, out_tail) if type(head) is bytes else encode(op, rid, head, out_tail)
            answer, out_tail = self._handle(op, payload, tail_arr, root, conn)
        except _REFUSED as exc:
            self.bad_frames += 1
            answer, out_tail = {"error": _message(exc)}, None
        return encode(op, rid, answer, out_tail)

    async def _answer_later(self, conn: "_Connection", rid: int, payload: dict, pending) -> bytes:
        op = EngineOp.LOOKUP
        try:
            head, out_tail = self._lookup_reply(conn, payload, await pending)
        except _REFUSED as exc:
            self.bad_frames += 1
            head, out_tail = {"error": _message(exc)}, None
        return encode_json(op, rid, head, out_tail) if type(head) is bytes else encode(op, rid, head, out_tail)

    def _lookup_reply(self, conn: "_Connection", payload: dict, answer: LookupAnswer | None):
        if answer is None:
            return _MISS_JSON, None
        conn.hits.add(answer.hit_id)
        slots = _slot_bytes(answer.slots)
        if payload.get("digests"):
            reply = {"hit": answer.hit_id, "matched_tokens": answer.matched_tokens, "tier": answer.tier,
                     "dram_tokens": answer.dram_tokens,
                     "digests": [int(d) for d in self.service.tier.block_digests(answer.slots)]}
            return reply, slots
        # {"hit", "matched_tokens", "tier", "dram_tokens"}: integers and a tier name, as json.dumps writes them
        tier = _TIER_JSON.get(answer.tier) or json.dumps(answer.tier).encode()
        return (b'{"hit":%d,"matched_tokens":%d,"tier":%s,"dram_tokens":%d}'
                % (answer.hit_id, answer.matched_tokens, tier, answer.dram_tokens), slots)

    def _handle(self, op: int, payload: dict, tail: np.ndarray, root: KeyRoot | None, conn: "_Connection"):
        """Every request but LOOKUP: (answer payload, answer tail)."""
        svc = self.service
        hits, tickets, owner = conn.hits, conn.tickets, conn
        if op in _NAMES_AN_INSTANCE and payload.get("instance", svc.instance) != svc.instance:
            raise ValueError(f"stale {EngineOp(op).name}: the hit or ticket was issued by another sidecar "
                             "process (this one restarted); look up or reserve again")
        if op == EngineOp.RELEASE:
            hit_id = _int(payload, "hit", 0, MAX_ID)
            svc.release(hit_id, owner)
            hits.discard(hit_id)
            return {}, None
        if op == EngineOp.STORE_BEGIN:
            tp, rank = _int(payload, "tp", 1, MAX_TP, default=1), _int(payload, "rank", 0, MAX_TP - 1, default=0)
            ticket, first_block, slots = svc.store_begin(root, _tokens(tail), tp, rank, owner)
            if ticket:
                tickets.add(ticket)
            # The removal log's position: a removal of these blocks comes after it.
            answer = {"ticket": ticket, "first_block": first_block, "removals": svc.tier.cache.removal_seq}
            if not ticket and first_block:
                answer["cached"] = True  # every full block is cached already: not a refusal
            return answer, np.asarray(slots, dtype="<u4")
        if op == EngineOp.STORE_COMMIT:
            ticket = _int(payload, "ticket", 0, MAX_ID)
            rank = _int(payload, "rank", 0, MAX_TP - 1, default=0)
            committed = svc.store_commit(ticket, rank, owner)
            tickets.discard(ticket)
            return {"committed": committed}, None
        if op == EngineOp.STORE_ABORT:
            ticket = _int(payload, "ticket", 0, MAX_ID)
            svc.store_abort(ticket, owner)
            tickets.discard(ticket)
            return {}, None
        if op == EngineOp.REPORT:
            try:
                report = EngineReport.model_validate(payload)
            except ValidationError as exc:
                raise ValueError("invalid report: " + "; ".join(
                    f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False))) from None
            svc.engine_report(report)
            return {}, None
        if op == EngineOp.REMOVED:
            since = _int(payload, "since", 0, MAX_ID)
            nxt, removed = svc.tier.cache.removed_since(since, MAX_REMOVED_PER_ANSWER)
            if removed is None:
                return {"next": nxt, "complete": False}, None
            return {"next": nxt, "complete": True}, b"".join(removed)
        if op == EngineOp.HELLO:
            return {**self.hello, "instance": svc.instance}, None
        raise ValueError(f"unknown op {op}")


class _Connection(asyncio.BufferedProtocol):
    """One engine connection: its receive buffer, its hits and tickets (it is their
    owner: the service compares owners by identity)."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray(RECV_BUFFER_BYTES)
        self.start = 0  # the first unanswered byte
        self.end = 0  # bytes received
        self.hits: set[int] = set()
        self.tickets: set[int] = set()
        self.waiting = False  # an answer is being made by a task: no frame is read meanwhile
        self.paused = False  # the engine is not taking its answers: no frame is read meanwhile
        self.late = False  # a frame's header is in and its body not yet (in server._partial)
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        self.server.connections += 1

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.end == len(self.buf):
            self._make_room(len(self.buf) + RECV_BUFFER_BYTES)
        return memoryview(self.buf)[self.end:]

    def buffer_updated(self, nbytes: int) -> None:
        self.end += nbytes
        if not (self.waiting or self.paused):
            self._serve()

    def _serve(self) -> None:
        """Answer every whole frame in the buffer, in order."""
        server, buf = self.server, self.buf
        try:
            while True:
                start = self.start
                have = self.end - start
                if have < _HEADER:
                    break
                body_len, op, rid, json_len = FRAME.unpack_from(buf, start)
                if body_len > MAX_BODY_BYTES or json_len + 4 > body_len:
                    server.bad_frames += 1
                    self.transport.close()  # framing is lost: the only safe answer is to hang up
                    return
                size = _HEADER - 4 + body_len
                if have < size:
                    if not self.late:
                        self.late = True
                        server._partial[self] = (server._loop.time() + FRAME_BODY_TIMEOUT_S, self.transport)
                    if start + size > len(self.buf):
                        self._make_room(size)
                    return
                if self.late:
                    self.late = False
                    server._partial.pop(self, None)
                body = start + _HEADER
                tail = start + size
                self.start = tail
                if op == _LOOKUP:
                    answer = server._lookup(self, rid, bytes(buf[body:body + json_len]), bytes(buf[body + json_len:tail]))
                else:
                    answer = server._answer(self, op, rid, bytes(buf[body:body + json_len]), bytes(buf[body + json_len:tail]))
                if type(answer) is bytes:
                    self.transport.write(answer)
                    if self.paused or self.transport.is_closing():
                        return  # resume_writing serves the rest
                else:
                    self.waiting = True
                    self.transport.pause_reading()
                    server._loop.create_task(self._answer_later(answer))
                    return
        except Exception:  # one broken engine connection must not take the sidecar down
            log.exception("engine connection failed")
            self.transport.close()
            return
        finally:
            if self.start == self.end:
                self.start = self.end = 0
                if len(self.buf) > RECV_BUFFER_BYTES:
                    self.buf = bytearray(RECV_BUFFER_BYTES)

    async def _answer_later(self, pending) -> None:
        try:
            answer = await pending
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("engine connection failed")
            self.transport.close()
            answer = None
        if self.closed:  # gone meanwhile: whatever the answer pinned goes with it
            self._release_all()
            return
        self.waiting = False
        if answer is not None:
            self.transport.write(answer)
            if not self.paused:
                self.transport.resume_reading()
                self._serve()

    def _make_room(self, size: int) -> None:
        """Move the unanswered bytes to the front of a buffer of at least `size` bytes
        (a new one: the loop may still hold a view of the old)."""
        new = bytearray(max(size, RECV_BUFFER_BYTES))
        new[: self.end - self.start] = self.buf[self.start:self.end]
        self.buf = new
        self.end -= self.start
        self.start = 0

    def pause_writing(self) -> None:
        self.paused = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if not self.waiting and not self.closed:
            self.transport.resume_reading()
            self._serve()

    def eof_received(self) -> bool:
        return False  # the engine hung up: close our end too

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.late:
            self.server._partial.pop(self, None)
        self._release_all()

    def _release_all(self) -> None:
        self.server.service.release_all(self.hits, self.tickets, self)
        self.hits.clear()
        self.tickets.clear()


# Requests that name a hit or a ticket, so the sidecar process that issued it.
_NAMES_AN_INSTANCE = frozenset({EngineOp.RELEASE, EngineOp.STORE_COMMIT, EngineOp.STORE_ABORT})
# Requests under a key root (payload["root"]).
_ROOTED = frozenset({EngineOp.LOOKUP, EngineOp.STORE_BEGIN})
_MISS_JSON = b'{"hit":0}'
# The tiers a lookup answers from, as JSON strings.
_TIER_JSON = {"dram": b'"dram"', "peer": b'"peer"'}


def _int(payload: dict, name: str, lo: int, hi: int, default: int | None = None) -> int:
    """A strict JSON integer in [lo, hi]: true, 1.5, "3" and 1e400 are refused (ValueError)."""
    value = payload.get(name, default)
    if value is None:
        raise KeyError(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in {lo}..{hi}, got {value}")
    return value


def _warmup(payload: dict) -> bool:
    """Whether a LOOKUP is the rollout's warm-up (`purpose`: "warmup"). No purpose, or
    one this sidecar does not know, is traffic (an older or newer engine's lookups keep
    being counted as they were); a purpose that is not a string is refused."""
    purpose = payload.get(PURPOSE_FIELD)
    if purpose is None:
        return False
    if not isinstance(purpose, str):
        raise ValueError(f"{PURPOSE_FIELD} must be a string, got {type(purpose).__name__}")
    return purpose == WARMUP_PURPOSE


def _source_peer(payload: dict) -> str | None:
    """A LOOKUP's peer-pull hint (`engine_proto.SOURCE_PEER_FIELD`), or None. Whether it
    names a peer worth asking is the service's to decide (only members of its fleet
    are); a hint that is not a string is refused, as any mistyped field."""
    hint = payload.get(SOURCE_PEER_FIELD)
    if hint is None or type(hint) is str:
        return hint or None
    raise ValueError(f"{SOURCE_PEER_FIELD} must be a string, got {type(hint).__name__}")


def _slot_bytes(slots: list[int]) -> bytes:
    """A hit's slot ids as the answer's tail: little-endian uint32."""
    if _NATIVE_U32:
        return array.array("I", slots).tobytes()
    return np.array(slots, dtype="<u4").tobytes()


# array("I") is the wire's little-endian uint32 on this machine.
_NATIVE_U32 = sys.byteorder == "little" and array.array("I").itemsize == 4


def _tokens(tail: np.ndarray) -> np.ndarray:
    if tail.size == 0:
        raise ValueError("token ids missing")
    return tail.astype(np.uint32)


def _message(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        return "invalid key root: " + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False))
    if isinstance(exc, KeyError):
        return f"missing field {exc}"
    return str(exc) or exc.__class__.__name__
