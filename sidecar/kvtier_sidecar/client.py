"""The engine-side library: talk to the local sidecar, copy KV straight out of shared memory.

    client = SidecarClient("/tmp/kvtier-....sock")
    hit = client.lookup(root, token_ids)            # EngineHit | Miss, never raises for faults
    if hit: client.materialize(hit, dst)            # block runs copied out of the arena
    client.release(hit)                             # when the request finishes
    client.store(root, token_ids, kv_blocks)        # best effort; admission applies

Faults (sidecar gone, restarted, slow, arena unmapped) are misses: every public call
catches them, drops the connection and reconnects on a later call (at most once per
RECONNECT_BACKOFF_S), mapping the new sidecar's arena. Bad input from the engine
(wrong token ids, a destination too small, KV bytes that are not exactly the prompt's
full blocks) raises ValueError: that is a caller bug.

Hits and store reservations belong to the connection that made them: the sidecar
releases a connection's pins and aborts its stores when it goes away. So a hit or a
reservation from before a reconnect is stale: `materialize` refuses it (`StaleHit`,
the blocks may have been reused since), `commit_store` answers False without asking
(re-reserve), and `release`/`abort_store` have nothing left to do.

Several engine processes (one per TP rank) may share one sidecar: `materialize(...,
tp, rank)` takes the rank's kv heads (kvtier.layout.shard_for_rank) of each canonical
block, and `store(..., tp=tp, rank=rank)` writes the rank's heads; the sidecar commits
the blocks once every rank has written its part.
"""
from __future__ import annotations

import json
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from kvtier.blockpool import slot_runs
from kvtier.keys import BLOCK_HASH_BYTES, KeyRoot, as_token_array
from kvtier.layout import shard_for_rank
from kvtier.names import PURPOSE_FIELD

from .arena import Arena, ArenaError
from .engine_proto import (
    FRAME, MAX_BODY_BYTES, SOURCE_PEER_FIELD, EngineOp, FrameError, encode, encode_json, split_body,
)

# How long a dead sidecar is left alone before the next reconnect attempt.
RECONNECT_BACKOFF_S = 0.5
# Longer than the sidecar's peer timeout: a lookup may include a peer fetch.
DEFAULT_TIMEOUT_S = 5.0
# The Miss reason of a fault (no answer, connection lost), as opposed to a cache miss.
UNAVAILABLE = "sidecar unavailable"
# The receive buffer's starting size: a lookup's whole answer (header, JSON, slot ids
# of a ~16k-token hit) arrives with one recv into it; a larger answer grows it.
RECV_BUFFER_BYTES = 1 << 16
# Key roots whose LOOKUP JSON is kept ready (an engine serves a handful).
ROOT_JSON_CACHE = 256
# The sidecar's LOOKUP answer without digests, exactly as engine_server formats it
# (anything else is parsed as JSON): hit id, matched tokens, tier, DRAM tokens.
_PLAIN_HIT = re.compile(rb'\{"hit":(0|[1-9][0-9]{0,18}),"matched_tokens":(0|[1-9][0-9]{0,18}),"tier":"(dram|peer)",'
                        rb'"dram_tokens":(0|[1-9][0-9]{0,18})\}')
_U32 = np.dtype("<u4")
_TIERS = {b"dram": "dram", b"peer": "peer"}


@dataclass(slots=True)
class EngineHit:
    """What `SidecarClient.lookup` gives the engine: `matched_tokens` leading tokens are
    cached in arena `blocks` (one slot per block), pinned until `release`. Truthy,
    unlike `Miss`."""

    matched_tokens: int
    blocks: list[int]
    tier: str
    hit_id: int
    arena: Arena = field(repr=False)
    generation: int = 0
    instance: str = ""
    # xxh3-64 of each block as the sidecar stored it (lookup(..., digests=True)).
    digests: list[int] | None = None
    connection: int = 0  # the client's connection that holds the pins
    # Leading tokens the sidecar held itself before the lookup: in a "peer" hit only
    # the tokens past these came from a peer (None: all of them are `tier`'s).
    dram_tokens: int | None = None

    def __bool__(self) -> bool:
        return True

    def split(self, start: int, end: int) -> dict[str, int]:
        """Tokens [start, end) of the hit by the tier they came from ("dram", "peer")."""
        local = self.matched_tokens if self.tier == "dram" else (self.dram_tokens or 0)
        dram = max(0, min(end, local) - start)
        return {"dram": dram, "peer": max(0, end - start) - dram}


@dataclass(slots=True)
class Miss:
    reason: str = "miss"
    matched_tokens: int = 0

    def __bool__(self) -> bool:
        return False


def root_payload(root: KeyRoot) -> dict:
    return root.to_wire()


class SidecarUnavailable(ConnectionError):
    pass


class StaleHit(SidecarUnavailable):
    """The hit's pins went with a connection that is gone: its blocks may hold other
    bytes now. A fault, like a miss: the engine recomputes."""


class _BackingOff(SidecarUnavailable):
    """No attempt was made: the last fault was under RECONNECT_BACKOFF_S ago."""


class SidecarClient:
    """One engine process's connection; thread-safe (one request in flight at a time)."""

    def __init__(self, socket_path: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._next_id = 1
        self._retry_at = 0.0
        self.arena: Arena | None = None
        self.info: dict = {}
        self.generation = 0
        self.faults = 0
        self.connection = 0  # bumped on every (re)connect: pins and tickets are per connection
        self.last_store_cached = False  # the last begin_store found every block cached
        self.last_store_removals: int | None = None  # its answer's removal-log position
        self._rbuf = bytearray(RECV_BUFFER_BYTES)
        self._lookup_json: dict[KeyRoot, bytes] = {}  # root -> the plain LOOKUP's JSON payload
        self._json_len = 0  # the last answer's JSON length (`_exchange`)
        self._last_lookup: tuple[KeyRoot | None, bytes] = (None, b"")  # the last root and its JSON
        self._instance_name = ""  # str(info["instance"])

    # -- connection ---------------------------------------------------------------------

    def _connect(self) -> None:
        if time.monotonic() < self._retry_at:
            raise _BackingOff("sidecar unavailable (backing off)")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.socket_path)
            _kernel_timeouts(sock, self.timeout_s)
        except OSError:
            sock.close()
            self._retry_at = time.monotonic() + RECONNECT_BACKOFF_S
            # Nobody answers: the sidecar is gone. Unmap its arena (hits handed out keep
            # their own reference until released): a memory-backed volume sized for one
            # arena has no room for its restarted successor's while this mapping holds
            # the old pages.
            self.arena = None
            raise
        self._sock = sock
        self.connection += 1
        info, _ = self._call_locked(EngineOp.HELLO, {})
        if self.arena is None or info.get("instance") != self.info.get("instance"):
            # A new sidecar: map its arena. The old mapping stays alive for hits that
            # still reference it (their bytes were pinned when they were handed out).
            # The tag proves the segment under the name is this sidecar's own.
            self.arena = Arena.attach(info["shm_name"], info["arena_bytes"], info["block_bytes"],
                                      bytes.fromhex(info["arena_tag"]))
            self.generation += 1
        self.info = info
        self._instance_name = str(info.get("instance", ""))

    def _drop(self) -> None:
        self.faults += 1
        self.connection += 1  # before the close: a copy checked against it held its pins
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
        self._retry_at = time.monotonic() + RECONNECT_BACKOFF_S

    def _call_locked(self, op: EngineOp, payload: dict | bytes, tail=None) -> tuple[dict, np.ndarray]:
        """One request, one answer. `payload`: a dict, or its JSON already encoded."""
        end = self._exchange(op, payload, tail)
        answer, tail_out = split_body(bytes(self._rbuf[FRAME.size : end]), self._json_len)
        if "error" in answer:
            raise ValueError(f"sidecar refused {op.name}: {answer['error']}")
        return answer, tail_out

    def _exchange(self, op: EngineOp, payload: dict | bytes, tail=None) -> int:
        """Send one request and receive its answer whole into `_rbuf`: the answer's end
        there (its JSON's length in `_json_len`)."""
        if self._sock is None:
            self._connect()
        sock = self._sock
        rid = self._next_id
        self._next_id = (rid + 1) & 0xFFFFFFFF
        if type(payload) is bytes:
            if type(tail) is np.ndarray and tail.dtype is _U32:  # token ids, as as_token_array makes them
                sock.sendall(FRAME.pack(4 + len(payload) + tail.nbytes, op, rid, len(payload)) + payload
                             + tail.tobytes())
            else:
                sock.sendall(encode_json(op, rid, payload, tail))
        else:
            sock.sendall(encode(op, rid, payload, tail))
        # The answer usually arrives whole in one recv; the header says how much is left.
        buf = self._rbuf
        got = sock.recv_into(buf)
        if got < FRAME.size:
            view = memoryview(buf)
            while got < FRAME.size:
                got = self._recv_more(sock, view, got)
            view.release()
        body_len, rop, rrid, json_len = FRAME.unpack_from(buf)
        if body_len > MAX_BODY_BYTES or json_len + 4 > body_len:
            raise FrameError(f"frame lengths out of range (body {body_len}, json {json_len})")
        total = FRAME.size + body_len - 4
        if got < total:
            if total > len(buf):
                grown = bytearray(max(total, 2 * len(buf)))
                grown[:got] = buf[:got]
                buf = self._rbuf = grown
            view = memoryview(buf)
            while got < total:
                got = self._recv_more(sock, view, got)
            view.release()
        if got != total:
            raise FrameError("the sidecar sent more than one answer")
        if rop != op or rrid != rid:
            raise FrameError("answer does not match the request")
        self._json_len = json_len
        return total

    @staticmethod
    def _recv_more(sock: socket.socket, view: memoryview, got: int) -> int:
        """The next piece of an answer that did not arrive whole (a loaded sidecar's
        answer may come in several writes): into `view` past the `got` bytes so far."""
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the sidecar closed the connection")
        return got + k

    def _lookup_answer(self, end: int) -> "EngineHit | Miss":
        """The LOOKUP answer in `_rbuf` as an EngineHit or a Miss (under the lock)."""
        buf = self._rbuf
        head = FRAME.size + self._json_len
        m = _PLAIN_HIT.fullmatch(buf, FRAME.size, head)  # the sidecar's usual answer, read without json
        if m is None:
            answer, slots = split_body(bytes(buf[FRAME.size : end]), self._json_len)
            if "error" in answer:
                raise ValueError(f"sidecar refused LOOKUP: {answer['error']}")
            if not answer.get("hit"):
                return Miss(answer.get("reason", "miss"))
            sums = answer.get("digests")
            return EngineHit(int(answer["matched_tokens"]), slots.tolist(), answer["tier"],
                             int(answer["hit"]), self.arena, self.generation, self._instance_name,
                             [int(d) for d in sums] if sums is not None else None, self.connection,
                             int(answer["dram_tokens"]) if "dram_tokens" in answer else None)
        if (end - head) % 4:
            raise FrameError("tail is not a whole number of uint32")
        hit_id, matched, tier, dram = m.groups()
        if hit_id == b"0":
            return Miss()
        return EngineHit(int(matched), np.frombuffer(buf, _U32, (end - head) >> 2, head).tolist(), _TIERS[tier],
                         int(hit_id), self.arena, self.generation, self._instance_name, None, self.connection, int(dram))

    def _lookup_payload(self, root: KeyRoot) -> bytes:
        last = self._last_lookup  # one attribute read: callers on other threads replace it whole
        if last[0] is root:  # the same root object as the last lookup's: no hashing
            return last[1]
        raw = self._lookup_json.get(root)
        if raw is None:
            if len(self._lookup_json) >= ROOT_JSON_CACHE:
                self._lookup_json.clear()
            raw = self._lookup_json[root] = json.dumps({"root": root_payload(root)}, separators=(",", ":")).encode()
        self._last_lookup = (root, raw)  # a KeyRoot is immutable (frozen)
        return raw

    def _call(self, op: EngineOp, payload: dict | bytes, tail=None) -> tuple[dict, np.ndarray] | None:
        """One request; None on any fault (the connection is dropped for a later retry)."""
        with self._lock:
            try:
                return self._call_locked(op, payload, tail)
            except ValueError:
                raise
            except _BackingOff:
                return None  # not a new fault: dropping again would push the retry back forever
            except (OSError, ConnectionError, FrameError, ArenaError, KeyError, TypeError):
                self._drop()
                return None

    def _call_lookup(self, payload: dict | bytes, tokens: np.ndarray) -> "EngineHit | Miss | None":
        """`_call` of a LOOKUP, its answer read straight out of the receive buffer."""
        with self._lock:
            try:
                return self._lookup_answer(self._exchange(EngineOp.LOOKUP, payload, tokens))
            except ValueError:
                raise
            except _BackingOff:
                return None
            except (OSError, ConnectionError, FrameError, ArenaError, KeyError, TypeError):
                self._drop()
                return None

    def connect(self) -> bool:
        """Connect now (optional; calls connect lazily). True when connected."""
        with self._lock:
            if self._sock is not None:
                return True
            try:
                self._connect()
                return True
            except _BackingOff:
                return False
            except (OSError, ConnectionError, FrameError, ArenaError, KeyError, TypeError, ValueError):
                self._drop()
                return False

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self.connection += 1
                self._sock.close()
                self._sock = None

    # -- engine API ---------------------------------------------------------------------

    def lookup(self, root: KeyRoot, token_ids, digests: bool = False, local_tokens: int = 0,
               purpose: str | None = None, source_peer: str | None = None) -> EngineHit | Miss:
        """The longest cached prefix, pinned. With `digests`, the hit carries each
        block's checksum so the engine can verify the bytes it copies. `local_tokens`:
        the leading tokens the engine already holds itself; the sidecar fetches from
        peers only what lies beyond them. `purpose`: why the engine asks, when it is not
        traffic (`kvtier.names.WARMUP_PURPOSE`: the rollout's warm-up, counted apart).
        `source_peer`: a router's hint of the peer holding the prefix (`host:port`,
        `kvtier.names.source_peer`), asked first if the sidecar trusts it."""
        tokens = as_token_array(token_ids)
        if digests or local_tokens or purpose or source_peer:
            payload = {"root": root_payload(root)}
            if digests:
                payload["digests"] = True
            if local_tokens:
                payload["local_tokens"] = int(local_tokens)
            if purpose:
                payload[PURPOSE_FIELD] = str(purpose)
            if source_peer:
                payload[SOURCE_PEER_FIELD] = str(source_peer)
        else:
            payload = self._lookup_payload(root)  # the same bytes as the dict's JSON, kept
        got = self._call_lookup(payload, tokens)
        return Miss(UNAVAILABLE) if got is None else got

    def report(self, loaded_bytes: int = 0, load_errors: int = 0, **counts: int) -> bool:
        """Tell the sidecar what only the engine knows since the last report (see
        `engine_proto.EngineReport`: `counts` names its other fields); False when the
        sidecar did not take it."""
        payload = {name: int(v) for name, v in {"loaded_bytes": loaded_bytes, "load_errors": load_errors,
                                                 **counts}.items() if v}
        if not payload:
            return True
        return self._call(EngineOp.REPORT, payload) is not None

    def _instance(self) -> dict:
        """Names the sidecar process a hit or ticket came from: another one refuses it."""
        return {"instance": str(self.info.get("instance", ""))}

    def release(self, hit: EngineHit | Miss) -> None:
        if not isinstance(hit, EngineHit) or hit.connection != self.connection:
            return  # a miss, or a hit whose connection is gone (its pins went with it)
        self._call(EngineOp.RELEASE, {"hit": hit.hit_id, **self._instance()})

    def materialize(self, hit: EngineHit, dst: np.ndarray, tp: int = 1, rank: int = 0) -> int:
        """Copy the hit's blocks into `dst` (uint8-viewable, C-contiguous, at least
        len(blocks) * block bytes of this rank's shard); returns bytes copied.

        tp == 1 copies each contiguous slot run with one copy; tp > 1 takes this rank's
        kv heads of each canonical block."""
        if not isinstance(hit, EngineHit):
            raise ValueError("materialize needs an EngineHit")
        self._check_pinned(hit)
        copied = self._copy_out(hit, _as_bytes(dst), tp, rank)
        self._check_pinned(hit)  # still pinned after the copy: it copied pinned bytes
        return copied

    def _check_pinned(self, hit: EngineHit) -> None:
        if hit.connection != self.connection:
            raise StaleHit("the hit's connection to the sidecar is gone (its pins with it); recompute")

    def _copy_out(self, hit: EngineHit, out: np.ndarray, tp: int, rank: int) -> int:
        arena = hit.arena
        bb = arena.block_bytes
        if tp == 1:
            need = len(hit.blocks) * bb
            if out.size < need:
                raise ValueError(f"dst holds {out.size} bytes, the hit needs {need}")
            for first, slot, count in slot_runs(hit.blocks):
                np.copyto(out[first * bb : (first + count) * bb], arena.slot_array(slot, count))
            return need
        shape = self._block_shape()
        shard_bytes = bb // tp
        need = len(hit.blocks) * shard_bytes
        if out.size < need:
            raise ValueError(f"dst holds {out.size} bytes, the rank's shard needs {need}")
        dtype = np.dtype(self.info["dtype"])
        for i, slot in enumerate(hit.blocks):
            block = arena.slot_array(slot).view(dtype).reshape(shape)
            shard = shard_for_rank(block, tp, rank)
            out[i * shard_bytes : (i + 1) * shard_bytes] = np.ascontiguousarray(shard).view(np.uint8).reshape(-1)
        return need

    def _block_shape(self) -> tuple[int, ...]:
        return tuple(self.info["block_shape"])

    def store(self, root: KeyRoot, token_ids, kv_blocks: np.ndarray, tp: int = 1, rank: int = 0) -> bool:
        """Offer the prompt's full blocks to the cache; True when they were committed.

        `kv_blocks` holds block i's canonical bytes at [i] (tp == 1), or this rank's
        heads of each block (tp > 1). Declined by admission, a full arena or a fault:
        False, nothing written. Never raises for a fault; KV bytes that are not exactly
        the prompt's full blocks (of this rank's shard) raise ValueError."""
        src = _as_bytes(kv_blocks)
        tokens = as_token_array(token_ids)
        self._check_kv_size(len(tokens), src.size, tp)
        reservation = self.begin_store(root, tokens, tp, rank)
        if reservation is None:
            return False
        try:
            self._write_slots(reservation.arena, reservation.slots, reservation.first_block, src, tp, rank)
        except (ValueError, ArenaError):
            self.abort_store(reservation)
            raise
        return self.commit_store(reservation)

    # Two-phase stores for engines that write straight into the arena (a KV connector
    # copying from its paged tensors): begin_store hands out the slots of the blocks
    # the sidecar does not hold yet, the engine writes them, commit_store publishes.

    def begin_store(self, root: KeyRoot, token_ids, tp: int = 1, rank: int = 0) -> "StoreReservation | None":
        """Slots for the prompt's uncached full blocks; None when declined, when every
        block is cached already (then `last_store_cached` is True), or on a fault."""
        tokens = as_token_array(token_ids)
        self.last_store_cached = False
        self.last_store_removals = None
        got = self._call(EngineOp.STORE_BEGIN, {"root": root_payload(root), "tp": tp, "rank": rank}, tokens)
        if got is None:
            return None
        answer, slots = got
        removals = answer.get("removals")
        self.last_store_removals = removals if type(removals) is int else None
        ticket = int(answer.get("ticket", 0))
        if not ticket:
            self.last_store_cached = bool(answer.get("cached"))
            return None
        return StoreReservation(ticket, int(answer.get("first_block", 0)), [int(s) for s in slots],
                                self.arena, rank, self.connection)

    def commit_store(self, reservation: "StoreReservation") -> bool:
        """Publish what this rank wrote; False when declined, on a fault, or when the
        reservation is stale (made on a connection that is gone: re-reserve)."""
        if reservation.connection != self.connection:
            return False  # the sidecar aborted it when that connection went away
        got = self._call(EngineOp.STORE_COMMIT, {"ticket": reservation.ticket, "rank": reservation.rank,
                                                 **self._instance()})
        return bool(got and got[0].get("committed"))

    def removed_since(self, since: int) -> tuple[int, list[bytes] | None] | None:
        """The DRAM tier's block removals since position `since` of its removal log:
        (the position to ask from next, their hashes oldest first), (position now, None)
        when the log cannot name them all (treat every block as removed), None on a
        fault or from a sidecar without the log. Hashes are the key chain's
        (`kvtier.keys.block_hashes`). Off the request path only."""
        got = self._call(EngineOp.REMOVED, {"since": int(since)})
        if got is None:
            return None
        answer, tail = got
        nxt = answer.get("next")
        if type(nxt) is not int:
            return None
        if not answer.get("complete"):
            return nxt, None
        raw = tail.tobytes()
        if len(raw) % BLOCK_HASH_BYTES:
            return None
        return nxt, [raw[i:i + BLOCK_HASH_BYTES] for i in range(0, len(raw), BLOCK_HASH_BYTES)]

    def abort_store(self, reservation: "StoreReservation") -> None:
        if reservation.connection != self.connection:
            return
        self._call(EngineOp.STORE_ABORT, {"ticket": reservation.ticket, **self._instance()})

    def _check_kv_size(self, n_tokens: int, n_bytes: int, tp: int) -> None:
        """KV for a prompt is exactly its full blocks, of this rank's shard."""
        if not self.info and not self.connect():
            return  # no sidecar to ask the shape of: begin_store declines anyway
        block_size, bb = int(self.info["block_size"]), int(self.info["block_bytes"])
        if tp < 1 or bb % tp:
            raise ValueError(f"tp={tp} does not divide a block of {bb} bytes")
        want = n_tokens // block_size * (bb // tp)
        if n_bytes != want:
            raise ValueError(f"kv_blocks hold {n_bytes} bytes; {n_tokens} tokens are {n_tokens // block_size} "
                             f"full blocks of {bb // tp} bytes = {want}")

    def _write_slots(self, arena: Arena, slots: list[int], first_block: int, src: np.ndarray, tp: int, rank: int) -> None:
        """Block first_block + i of the prompt goes into slots[i] (the sidecar only
        hands out slots for blocks it does not hold yet)."""
        bb = arena.block_bytes
        if tp == 1:
            src = src[first_block * bb :]
            need = len(slots) * bb
            if src.size < need:
                raise ValueError(f"kv_blocks hold {src.size} bytes, {len(slots)} blocks need {need}")
            for first, slot, count in slot_runs(slots):
                np.copyto(arena.slot_array(slot, count), src[first * bb : (first + count) * bb])
            return
        shape = self._block_shape()
        dtype = np.dtype(self.info["dtype"])
        shard_bytes = bb // tp
        src = src[first_block * shard_bytes :]
        if src.size < len(slots) * shard_bytes:
            raise ValueError("kv_blocks hold fewer bytes than this rank's shard of the blocks")
        for i, slot in enumerate(slots):
            block = arena.slot_array(slot).view(dtype).reshape(shape)
            target = shard_for_rank(block, tp, rank)  # a view: writes land in the slot
            target[...] = src[i * shard_bytes : (i + 1) * shard_bytes].view(dtype).reshape(target.shape)


@dataclass(slots=True)
class StoreReservation:
    """Block first_block + i of the prompt goes into arena slot slots[i]."""

    ticket: int
    first_block: int
    slots: list[int]
    arena: Arena = field(repr=False)
    rank: int = 0
    connection: int = 0  # the client's connection that holds the ticket


def _kernel_timeouts(sock: socket.socket, timeout_s: float) -> None:
    """Blocking I/O whose every send and recv gives up after `timeout_s` in the kernel
    (SO_SNDTIMEO / SO_RCVTIMEO; a timeout is an OSError, EAGAIN). A Python socket
    timeout would poll() before each send and recv: a system call more per step."""
    sec = int(timeout_s)
    tv = struct.pack("@ll", sec, int((timeout_s - sec) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.settimeout(None)


def _as_bytes(a) -> np.ndarray:
    arr = np.asarray(a) if not isinstance(a, np.ndarray) else a
    if not arr.flags.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    return arr.reshape(-1).view(np.uint8)


