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

The per-request path is kept to what the request needs: a LOOKUP or STORE_BEGIN
whose JSON bytes were seen before reuses their parse and key root (an engine sends
the same few payloads again and again), and a LOOKUP's answer JSON is written directly.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import struct

import numpy as np
from pydantic import ValidationError

from kvtier.keys import KeyRoot

from .engine_proto import (
    FRAME, MAX_REMOVED_PER_ANSWER, EngineOp, EngineReport, FrameError, decode_header, encode, encode_json, split_body,
)

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


class EngineServer:
    def __init__(self, service, path: str, hello: dict) -> None:
        self.service = service
        self.path = path
        self.hello = hello
        self._server: asyncio.AbstractServer | None = None
        self._roots: dict[str, KeyRoot] = {}
        # A root-only payload's JSON bytes -> (payload, its key root); never mutated.
        self._payloads: dict[bytes, tuple[dict, KeyRoot]] = {}
        # Connections with a frame's header in and its body not yet: -> (deadline, writer).
        self._partial: dict[object, tuple[float, asyncio.StreamWriter]] = {}
        self._sweeper: asyncio.Task | None = None
        self.connections = 0
        self.bad_frames = 0

    async def start(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        # backlog: a burst of engine connections (1,000 concurrent lookups) must not be refused.
        self._server = await asyncio.start_unix_server(self._serve, path=self.path, limit=1 << 20, backlog=2048)
        os.chmod(self.path, 0o660)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_late_frames())

    async def _sweep_late_frames(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(FRAME_SWEEP_S)
            now = loop.time()
            for conn, (deadline, writer) in list(self._partial.items()):
                if now >= deadline:
                    del self._partial[conn]
                    self.bad_frames += 1
                    log.warning("engine connection closed: a frame did not arrive whole within %.0fs",
                                FRAME_BODY_TIMEOUT_S)
                    writer.transport.abort()  # its reader sees the end, its _serve cleans up

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

    def _parse(self, op: int, rest: bytes, json_len: int) -> tuple[dict, np.ndarray, KeyRoot | None]:
        """(payload, tail, key root of a LOOKUP or STORE_BEGIN, else None)."""
        if op not in _ROOTED:
            payload, tail = split_body(rest, json_len)
            return payload, tail, None
        raw = rest[:json_len]
        known = self._payloads.get(raw)
        if known is not None:
            if (len(rest) - json_len) % 4:
                raise FrameError("tail is not a whole number of uint32")
            return known[0], np.frombuffer(rest, dtype="<u4", offset=json_len), known[1]
        payload, tail = split_body(rest, json_len)
        root = self._root(payload["root"])
        if len(payload) == 1:  # root only: the same bytes always parse to the same request
            if len(self._payloads) >= ROOT_CACHE_SIZE:
                self._payloads.clear()
            self._payloads[raw] = (payload, root)
        return payload, tail, root

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        owner = object()  # this connection: hits and tickets it made belong to it alone
        hits: set[int] = set()
        tickets: set[int] = set()
        partial = self._partial
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    header = await reader.readexactly(FRAME.size)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                try:
                    body_len, op, rid, json_len = decode_header(header)
                except (FrameError, struct.error):
                    self.bad_frames += 1
                    return  # framing is lost: the only safe answer is to hang up
                partial[owner] = (loop.time() + FRAME_BODY_TIMEOUT_S, writer)
                rest = await reader.readexactly(body_len - 4)
                partial.pop(owner, None)  # gone already when a sweep closed it meanwhile
                try:
                    payload, tail, root = self._parse(op, rest, json_len)
                    answer, out_tail = await self._handle(op, payload, tail, root, hits, tickets, owner)
                except (FrameError, ValueError, ValidationError, KeyError, TypeError, OverflowError) as exc:
                    self.bad_frames += 1
                    answer, out_tail = {"error": _message(exc)}, None
                if type(answer) is bytes:
                    writer.write(encode_json(op, rid, answer, out_tail))
                else:
                    writer.write(encode(op, rid, answer, out_tail))
                if writer.transport.get_write_buffer_size() > (1 << 20):
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the engine hung up, or the sidecar is shutting down
        except Exception:  # one broken engine connection must not take the sidecar down
            log.exception("engine connection failed")
        finally:
            partial.pop(owner, None)
            self.service.release_all(hits, tickets, owner)
            writer.close()

    async def _handle(self, op: int, payload: dict, tail: np.ndarray, root: KeyRoot | None, hits: set[int],
                      tickets: set[int], owner: object):
        svc = self.service
        if op in _NAMES_AN_INSTANCE and payload.get("instance", svc.instance) != svc.instance:
            raise ValueError(f"stale {EngineOp(op).name}: the hit or ticket was issued by another sidecar "
                             "process (this one restarted); look up or reserve again")
        if op == EngineOp.LOOKUP:
            tokens = _tokens(tail)
            local = _int(payload, "local_tokens", 0, len(tokens), default=0)
            answer = await svc.lookup(root, tokens, owner, local_tokens=local)
            if answer is None:
                return _MISS_JSON, None
            hits.add(answer.hit_id)
            slots = np.array(answer.slots, dtype="<u4")
            if payload.get("digests"):
                reply = {"hit": answer.hit_id, "matched_tokens": answer.matched_tokens, "tier": answer.tier,
                         "dram_tokens": answer.dram_tokens,
                         "digests": [int(d) for d in svc.tier.block_digests(answer.slots)]}
                return reply, slots
            # {"hit", "matched_tokens", "tier", "dram_tokens"}: integers and a tier name, as json.dumps writes them
            tier = _TIER_JSON.get(answer.tier) or json.dumps(answer.tier).encode()
            return (b'{"hit":%d,"matched_tokens":%d,"tier":%s,"dram_tokens":%d}'
                    % (answer.hit_id, answer.matched_tokens, tier, answer.dram_tokens), slots)
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
