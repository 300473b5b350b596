"""The peer tier over TCP: a threaded server streaming block runs out of the arena,
and the client that receives them into reserved arena slots.

Threads, not asyncio, on purpose: `sendmsg` of a staging buffer and `recv_into` one
release the GIL and copy once in the kernel, which is what keeps a fetch near raw
loopback throughput (asyncio's stream buffers add a copy). After the handshake every
frame travels sealed: the server encrypts each block from the arena into a per-worker
staging buffer and sends it; the client receives each block's record into a staging
buffer and decrypts it straight into its reserved slot (one pass over the bytes on
each side beyond the plain stream, no user-space copy).
Handshakes (see `wire`) run first on one non-blocking thread under an overall
deadline; only an authenticated connection takes a slot. Concurrency is bounded by a
semaphore and served by a fixed set of worker threads; a peer over the bound gets BUSY
at once. Every socket operation has a deadline, and every fetch (client) and request
(server) one for the whole of it. Framing lives in `wire`. Measurements:
bench/notes/peer-throughput.md.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import xxhash

from kvtier.blockpool import slot_runs
from kvtier.keys import KeyRoot
from kvtier.peer_address import parse_peer

from . import wire
from .counters import Count, Counters
from .peer_keys import PeerKeyring
from .peer_session import PeerSession, RecordAuthError, sealed_size
from .transport import CHECKSUM_MISMATCH, RECORD_AUTH_FAILED, FetchOutcome, FetchSink, HotPrefixes

log = logging.getLogger("kvtier.sidecar.peer")

# Blocks at least this big are verified on a helper thread while the next one arrives;
# smaller ones inline (a thread hand-off would cost more than the hash). With fewer
# than 4 cores the sender, the receiver and the hash already contend: inline wins.
THREADED_HASH_BYTES = 256 << 10 if (os.cpu_count() or 1) >= 4 else 1 << 62
# How long and how much a refusing server reads of what the client still sends (its
# AUTH and request are in flight): a well-behaved client closes within a round trip.
DRAIN_BEFORE_CLOSE_S = 0.2
DRAIN_BEFORE_CLOSE_BYTES = 1 << 20
# A real peer finishes the handshake in two round trips (well under a millisecond on
# one network); a connection still proving itself after this is cut.
HANDSHAKE_TIMEOUT_S = 1.0
# Connections proving themselves at once; a newcomer past this pushes out the oldest
# (an attacker must open connections faster than this many per handshake timeout).
MAX_PENDING_HANDSHAKES = 256
# Longest the handshake thread sleeps without looking at the stop flag.
HANDSHAKE_POLL_S = 0.2
# Refusals (BUSY, UNAUTHORIZED) waiting for the spare worker; beyond, hang up at once.
MAX_QUEUED_REFUSALS = 64
# Socket buffers big enough to keep a multi-MiB run in flight while the receiver hashes.
SOCKET_BUFFER_BYTES = 8 << 20


class PeerSource(Protocol):
    """What the server needs from the local tier."""

    block_bytes: int
    block_size: int

    def pin_for_peer(self, root: KeyRoot, token_ids: np.ndarray, max_blocks: int) -> tuple[int, list[int], object] | None:
        """Match by tokens and pin: (matched_tokens, slots of every matched block, handle)."""
    def unpin(self, handle: object) -> None: ...
    def slot_view(self, slot: int, count: int) -> memoryview: ...
    def block_digests(self, slots: list[int]) -> np.ndarray:
        """xxh3-64 of each slot's block (cached since the block was stored)."""
    def hot_prefixes(self, tenant: str, max_bytes: int) -> list[tuple[KeyRoot, np.ndarray]]: ...


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError:
            pass


def sendmsg_all(sock: socket.socket, views: list, deadline: float) -> None:
    """sendall() for a gather list (every byte of every view, in order) by `deadline`.

    Each sendmsg() waits at most the socket's timeout; the deadline bounds the whole
    frame, as sendall's timeout does, against a peer that reads a trickle."""
    views = [memoryview(v).cast("B") for v in views]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][sent:]
            if time.monotonic() > deadline:
                raise TimeoutError("peer stopped reading")


def _drain_before_close(conn: socket.socket) -> None:
    """Half-close, then read and drop what the client still sends, briefly.

    An answer sent before the request was read in full (BUSY, UNAUTHORIZED,
    BAD_REQUEST): closing with unread bytes makes the kernel send a reset, which can
    reach the client before it read the answer, turning "busy" into a reset error."""
    conn.shutdown(socket.SHUT_WR)
    deadline = time.monotonic() + DRAIN_BEFORE_CLOSE_S
    for _ in range(DRAIN_BEFORE_CLOSE_BYTES // 4096):
        left = deadline - time.monotonic()
        if left <= 0:
            return
        conn.settimeout(left)
        if not conn.recv(4096):
            return


@dataclass(slots=True)
class _Handshake:
    """One connection still proving itself: no peer slot, no worker thread yet."""

    conn: socket.socket
    deadline: float
    need: int
    buf: bytearray = field(default_factory=bytearray)
    stage: str = "hello"  # hello -> identity -> proof
    client_nonce: bytes = b""
    client_id: str = ""
    server_nonce: bytes = b""
    secrets: list[bytes] = field(default_factory=list)


def as_keyring(keys: PeerKeyring | bytes) -> PeerKeyring:
    """A fixed secret (tests, benchmarks) is a keyring that never rotates."""
    return keys if isinstance(keys, PeerKeyring) else PeerKeyring(keys, 0.0)


class PeerServer:
    """Serves FETCH and HOT to authenticated peers: at most `max_concurrency`
    connections at once, each on one of a fixed set of worker threads.

    Handshakes come first and cost no slot: one thread multiplexes every connection
    still proving itself (non-blocking sockets), each under an overall deadline of
    `handshake_timeout_s`, at most MAX_PENDING_HANDSHAKES at once (a newcomer pushes
    out the oldest). A client that trickles bytes holds a few hundred bytes of buffer
    until its deadline, never a slot a real peer needs."""

    def __init__(self, source: PeerSource, host: str, port: int, keys: PeerKeyring | bytes,
                 max_concurrency: int = 8, timeout_s: float = 2.0, endpoint: str | None = None,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        self.source = source
        self.keys = as_keyring(keys)
        self.timeout_s = timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.max_concurrency = max_concurrency
        self._slots_lock = threading.Lock()
        self._slots_held = 0
        self._sock = socket.create_server((host, port), reuse_port=False, backlog=128)
        self._sock.setblocking(False)
        self.address = "%s:%d" % self._sock.getsockname()[:2]
        # The address peers dial (the one they sign); the bound one unless advertised otherwise.
        self.endpoint = endpoint or self.address
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._handshake_loop, name="peer-handshake", daemon=True)
        self._pending: dict[int, _Handshake] = {}
        self._refusals = threading.BoundedSemaphore(MAX_QUEUED_REFUSALS)
        # Workers outlive connections: starting a thread per connection cost ~0.35 ms
        # here, on the path of every fetch. One spare serves the refusals.
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._local = threading.local()  # per worker: the staging buffer of sealed blocks
        self._workers = [threading.Thread(target=self._work, name="peer-conn", daemon=True)
                         for _ in range(max_concurrency + 1)]
        # The sidecar's counters, where the refusals an operator should see are counted
        # too (set once the sidecar's service exists).
        self.events: Counters | None = None
        self.counters = {"connections": 0, "fetches": 0, "bytes_sent": 0, "busy": 0, "unauthorized": 0,
                         "bad_requests": 0, "handshake_timeouts": 0, "handshakes_displaced": 0,
                         "request_timeouts": 0, "bad_records": 0, "old_protocol": 0}

    def start(self) -> "PeerServer":
        for worker in self._workers:
            worker.start()
        self._thread.start()
        return self

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job[0](*job[1:])
            except Exception:  # a worker outlives any one connection's bug
                log.exception("peer worker failed")

    def set_secret(self, secret: bytes | None) -> None:
        """Rotate to `secret` (the previous one stays accepted for the keyring's overlap)."""
        self.keys.rotate(secret)

    def close(self) -> None:
        self._stop.set()
        try:
            self._sock.close()
        except OSError:
            pass
        for _ in self._workers:
            self._jobs.put(None)

    # -- handshakes (one thread, non-blocking) -------------------------------------------

    def _handshake_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, None)
        try:
            while not self._stop.is_set():
                wait = HANDSHAKE_POLL_S
                if self._pending:
                    oldest = next(iter(self._pending.values()))
                    wait = max(0.0, min(wait, oldest.deadline - time.monotonic()))
                for key, _ in sel.select(wait):
                    if key.data is None:
                        self._accept(sel)
                    else:
                        self._advance(sel, key.data)
                self._expire(sel, time.monotonic())
        except OSError:
            pass  # the listening socket closed under us: shutting down
        finally:
            for hs in list(self._pending.values()):
                self._drop(sel, hs)
            sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            self.counters["connections"] += 1
            conn.setblocking(False)
            if len(self._pending) >= MAX_PENDING_HANDSHAKES:
                self.counters["handshakes_displaced"] += 1
                self._drop(sel, next(iter(self._pending.values())))
            hs = _Handshake(conn, time.monotonic() + self.handshake_timeout_s, wire.HELLO.size)
            self._pending[conn.fileno()] = hs
            sel.register(conn, selectors.EVENT_READ, hs)

    def _drop(self, sel: selectors.BaseSelector, hs: _Handshake) -> None:
        self._forget(sel, hs)
        hs.conn.close()

    def _forget(self, sel: selectors.BaseSelector, hs: _Handshake) -> None:
        self._pending.pop(hs.conn.fileno(), None)
        try:
            sel.unregister(hs.conn)
        except (KeyError, ValueError):
            pass

    def _expire(self, sel: selectors.BaseSelector, now: float) -> None:
        while self._pending:
            hs = next(iter(self._pending.values()))
            if hs.deadline > now:
                return
            self.counters["handshake_timeouts"] += 1
            self._drop(sel, hs)

    def _advance(self, sel: selectors.BaseSelector, hs: _Handshake) -> None:
        """Read what the current stage still needs (never more: the client's request
        may follow its proof in the same segment), then act on a complete stage."""
        try:
            chunk = hs.conn.recv(hs.need - len(hs.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(sel, hs)
            return
        if not chunk:
            self._drop(sel, hs)
            return
        hs.buf += chunk
        try:
            while len(hs.buf) >= hs.need:
                if self._stage_done(sel, hs):
                    return
        except wire.OldProtocolError as exc:
            self._count("old_protocol", Count.PEER_OLD_PROTOCOL)
            log.warning("peer refused: %s", exc)
            self._drop(sel, hs)
        except wire.ProtocolError:
            self.counters["bad_requests"] += 1
            self._drop(sel, hs)

    def _stage_done(self, sel: selectors.BaseSelector, hs: _Handshake) -> bool:
        """Act on a complete stage; True once the connection left the handshake."""
        raw, hs.buf = bytes(hs.buf), bytearray()
        if hs.stage == "hello":
            hs.client_nonce, hs.need = wire.decode_hello_head(raw)
            hs.stage = "identity"
            return False
        if hs.stage == "identity":
            hs.client_id = wire.decode_identity(raw)
            hs.server_nonce = os.urandom(wire.NONCE_BYTES)
            hs.secrets = self.keys.accepted()
            proofs = [wire.proof(k, wire.Role.SERVER, hs.client_nonce, hs.server_nonce, self.endpoint, hs.client_id)
                      for k in hs.secrets]
            challenge = wire.encode_challenge(hs.server_nonce, proofs)
            if hs.conn.send(challenge) != len(challenge):  # a fresh socket's buffer takes it whole
                raise wire.ProtocolError("client does not read")
            hs.stage, hs.need = "proof", wire.PROOF_BYTES
            return False
        self._forget(sel, hs)
        hs.conn.setblocking(True)
        hs.conn.settimeout(self.timeout_s)
        secret = wire.proof_matches(hs.secrets, raw, wire.Role.CLIENT, hs.client_nonce, hs.server_nonce,
                                    self.endpoint, hs.client_id)
        if secret is None:
            self.counters["unauthorized"] += 1
            self._refuse(hs.conn, wire.Status.UNAUTHORIZED, "bad peer credentials")
        elif not self._take_slot():
            self.counters["busy"] += 1
            self._refuse(hs.conn, wire.Status.BUSY, "peer at its concurrency limit")
        else:
            session = PeerSession.for_server(secret, hs.client_nonce, hs.server_nonce, self.endpoint, hs.client_id)
            self._jobs.put((self._serve, hs.conn, session))
        return True

    def _count(self, name: str, event: Count) -> None:
        self.counters[name] += 1
        if self.events is not None:
            self.events.add(event)

    def _take_slot(self) -> bool:
        with self._slots_lock:
            if self._slots_held >= self.max_concurrency:
                return False
            self._slots_held += 1
            return True

    def _give_slot(self) -> None:
        with self._slots_lock:
            self._slots_held -= 1

    @property
    def slots_in_use(self) -> int:
        """Authenticated connections being served now (a slot is given back when the
        worker sees the client hang up, a moment after the client's last read)."""
        return self._slots_held

    def _refuse(self, conn: socket.socket, status: wire.Status, why: str) -> None:
        """Answer on the spare worker; past MAX_QUEUED_REFUSALS just hang up (a flood of
        refusals must not queue sockets without bound)."""
        if not self._refusals.acquire(blocking=False):
            conn.close()
            return
        self._jobs.put((self._send_refusal, conn, status, why))

    def _send_refusal(self, conn: socket.socket, status: wire.Status, why: str) -> None:
        try:
            conn.sendall(wire.encode_response(status, {"error": why}))
            _drain_before_close(conn)
        except OSError:
            pass
        finally:
            conn.close()
            self._refusals.release()

    # -- authenticated connections (a slot and a worker each) ----------------------------

    def _serve(self, conn: socket.socket, session: PeerSession) -> None:
        """Requests in turn, each read in full within `timeout_s` of the moment the
        server began waiting for it (idle time included) and answered within
        `timeout_s` more; the body's buffer grows as its bytes arrive. An
        authenticated peer that announces a large request and trickles it holds its
        slot until that deadline and what it actually sent, never longer or more."""
        try:
            _tune(conn)
            while not self._stop.is_set():
                deadline = time.monotonic() + self.timeout_s
                try:
                    head = recv_by(conn, wire.RECORD.size, deadline)
                except (ConnectionError, TimeoutError):
                    return  # idle past the deadline, or gone
                length = wire.decode_record_header(head, wire.MAX_REQUEST_RECORD_BYTES)
                try:
                    sealed = recv_by(conn, length + wire.TAG_BYTES, deadline)
                except TimeoutError:
                    self._count("request_timeouts", Count.PEER_REQUEST_TIMEOUTS)
                    return
                frame = session.open(head, sealed)
                op, body_len = wire.decode_request_header(frame[: wire.REQUEST.size])
                if body_len != len(frame) - wire.REQUEST.size:
                    raise wire.ProtocolError("request length does not match its record")
                body = frame[wire.REQUEST.size:]
                answer_by = time.monotonic() + self.timeout_s
                if op is wire.Op.FETCH:
                    self._fetch(conn, session, body, answer_by)
                else:
                    self._hot(conn, session, body, answer_by)
        except RecordAuthError:
            self._count("bad_records", Count.PEER_BAD_RECORDS)  # forged, replayed or reordered: no answer
        except wire.ProtocolError as exc:
            self.counters["bad_requests"] += 1
            try:
                conn.sendall(session.seal(wire.encode_response(wire.Status.BAD_REQUEST, {"error": str(exc)})))
                _drain_before_close(conn)
            except (OSError, wire.ProtocolError):
                pass
        except (OSError, ConnectionError):
            pass  # the other side went away or stalled: nothing to clean but the socket
        except Exception:  # a bug must cost one connection, never the server
            log.exception("peer connection failed")
        finally:
            conn.close()
            self._give_slot()

    def _fetch(self, conn: socket.socket, session: PeerSession, body: bytes, deadline: float) -> None:
        request, tokens = wire.decode_fetch(body)
        src = self.source
        if request.block_bytes != src.block_bytes or request.block_size != src.block_size:
            raise wire.ProtocolError(
                f"shape mismatch: block of {request.block_size} tokens/{request.block_bytes} bytes, "
                f"this peer serves {src.block_size}/{src.block_bytes}")
        if tokens.size == 0:
            raise wire.ProtocolError("fetch without token ids")
        conn.settimeout(_left(deadline))
        pinned = src.pin_for_peer(request.root.key_root(), tokens, request.max_blocks)
        if pinned is None:
            conn.sendall(session.seal(wire.encode_response(wire.Status.MISS, wire.FetchHeader(
                matched_tokens=0, n_blocks=0, block_bytes=src.block_bytes))))
            return
        matched, slots, handle = pinned
        slots = slots[request.skip_blocks :]
        try:
            if not slots:
                conn.sendall(session.seal(wire.encode_response(wire.Status.MISS, wire.FetchHeader(
                    matched_tokens=matched, n_blocks=0, block_bytes=src.block_bytes))))
                return
            self.counters["fetches"] += 1
            header = wire.FetchHeader(matched_tokens=matched, n_blocks=len(slots), block_bytes=src.block_bytes)
            conn.sendall(session.seal(wire.encode_response(wire.Status.OK, header)))
            self._stream(conn, session, slots, deadline)
        finally:
            src.unpin(handle)

    def _stream(self, conn: socket.socket, session: PeerSession, slots: list[int], deadline: float) -> None:
        """Run chunks in block order: a sealed run header, then one sealed record per
        block, encrypted from the arena into a staging buffer (one per worker thread,
        reused) and sent with the header in one call."""
        bb = self.source.block_bytes
        per_chunk = wire.chunk_blocks(bb)
        record = sealed_size(bb)
        staging = self._staging(min(per_chunk, len(slots)) * record)
        for first, slot, count in slot_runs(slots):
            for off in range(0, count, per_chunk):
                n = min(per_chunk, count - off)
                digests = self.source.block_digests(list(range(slot + off, slot + off + n)))
                head = session.seal(wire.encode_run_header(first + off, digests))
                view = self.source.slot_view(slot + off, n)
                for i in range(n):
                    session.seal_into(view[i * bb:(i + 1) * bb], staging[i * record:(i + 1) * record])
                conn.settimeout(_left(deadline))
                sendmsg_all(conn, [head, staging[: n * record]], deadline)
                self.counters["bytes_sent"] += n * bb

    def _staging(self, nbytes: int) -> memoryview:
        """This worker thread's staging buffer, at least `nbytes` (at most a run chunk
        of sealed blocks: one per worker, so bounded by the worker count)."""
        buf = getattr(self._local, "staging", None)
        if buf is None or len(buf) < nbytes:
            buf = memoryview(bytearray(nbytes))
            self._local.staging = buf
        return buf

    def _hot(self, conn: socket.socket, session: PeerSession, body: bytes, deadline: float) -> None:
        try:
            request = wire.HotRequest.model_validate_json(body)
        except ValueError:
            raise wire.ProtocolError("bad hot-prefixes request") from None
        found = self.source.hot_prefixes(request.tenant, request.max_bytes)
        response = wire.HotResponse(prefixes=[
            wire.HotPrefix(root=wire.WireRoot.of(root), tokens=[int(t) for t in tokens]) for root, tokens in found
        ])
        conn.settimeout(_left(deadline))
        conn.sendall(session.seal(wire.encode_response(wire.Status.OK, response)))


def _left(deadline: float) -> float:
    """Seconds left before `deadline`; TimeoutError once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("peer fetch deadline passed")
    return left


# Bytes asked of the kernel per read while a frame's length is not yet backed by
# received bytes: a peer that announces a large frame and trickles it holds this much.
RECV_STEP_BYTES = 64 << 10


def recv_into_by(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill `view` by `deadline`: every wait is cut to what is left, so a peer that
    trickles a byte just inside each socket timeout still cannot stretch one frame."""
    got, total = 0, len(view)
    while got < total:
        sock.settimeout(_left(deadline))
        k = sock.recv_into(view[got:], total - got)
        if k == 0:
            raise ConnectionError("the other end closed the connection")
        got += k


def recv_by(sock: socket.socket, n: int, deadline: float) -> bytes:
    """`n` bytes by `deadline`, the buffer growing as they arrive (an announced length
    costs memory only once its bytes came)."""
    if n <= RECV_STEP_BYTES:
        buf = bytearray(n)
        recv_into_by(sock, memoryview(buf), deadline)
        return bytes(buf)
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(_left(deadline))
        chunk = sock.recv(min(RECV_STEP_BYTES, n - len(buf)))
        if not chunk:
            raise ConnectionError("the other end closed the connection")
        buf += chunk
    return bytes(buf)


def _read_record(sock: socket.socket, session: PeerSession, deadline: float, max_bytes: int) -> bytes:
    """The next sealed record's plaintext, by `deadline`."""
    head = recv_by(sock, wire.RECORD.size, deadline)
    length = wire.decode_record_header(head, max_bytes)
    return session.open(head, recv_by(sock, length + wire.TAG_BYTES, deadline))


def _read_reply(sock: socket.socket, session: PeerSession, deadline: float) -> tuple[wire.Status, bytes]:
    """The server's first answer: (status, body). Sealed, or a plain refusal the server
    sent before any session existed (bad proof, no free slot), which carries no data."""
    head = recv_by(sock, wire.RECORD.size, deadline)
    if head[:4] == wire.RESPONSE_MAGIC:
        status, length = wire.decode_response_header(head + recv_by(sock, wire.RESPONSE.size - len(head), deadline))
        if status not in REFUSALS:
            raise wire.ProtocolError(f"unsealed {status.name} answer")
        recv_by(sock, length, deadline)
        return status, b""
    length = wire.decode_record_header(head, wire.MAX_RESPONSE_RECORD_BYTES)
    frame = session.open(head, recv_by(sock, length + wire.TAG_BYTES, deadline))
    status, body_len = wire.decode_response_header(frame[: wire.RESPONSE.size])
    if body_len != len(frame) - wire.RESPONSE.size:
        raise wire.ProtocolError("response length does not match its record")
    return status, frame[wire.RESPONSE.size:]


# What a server may answer in the clear: its refusals at the handshake.
REFUSALS = frozenset({wire.Status.UNAUTHORIZED, wire.Status.BUSY})


class PeerAuthError(wire.ProtocolError):
    """The other side did not prove it holds a secret this sidecar accepts."""


class TcpTransport:
    """Client side. A connection per call: fetches are few and large, and a fresh
    connection never inherits a half-read stream from a failed transfer.

    `identity` is this sidecar's own advertised peer address (signed into both proofs)."""

    def __init__(self, keys: PeerKeyring | bytes, connect_timeout_s: float = 0.25, timeout_s: float = 2.0,
                 identity: str = "") -> None:
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="peer-verify")
        self.keys = as_keyring(keys)
        self.identity = identity
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s

    def _connect(self, peer: str, deadline: float) -> tuple[socket.socket, bytes, PeerSession]:
        """A connection whose server proved a shared secret for `peer`, this side's
        proof, to send ahead of the first request (one segment, no extra round trip),
        and the session that seals what follows."""
        addr = parse_peer(peer)  # "[v6]:port" too
        sock = socket.create_connection((addr.host, addr.port), timeout=min(self.connect_timeout_s, _left(deadline)))
        try:
            _tune(sock)
            sock.settimeout(_left(deadline))
            client_nonce = os.urandom(wire.NONCE_BYTES)
            sock.sendall(wire.encode_hello(client_nonce, self.identity))
            server_nonce, n = wire.decode_challenge_head(recv_by(sock, wire.CHALLENGE.size, deadline))
            proofs = recv_by(sock, n * wire.PROOF_BYTES, deadline)
            secrets = self.keys.accepted()
            for i in range(n):
                secret = wire.proof_matches(secrets, proofs[i * wire.PROOF_BYTES:(i + 1) * wire.PROOF_BYTES],
                                            wire.Role.SERVER, client_nonce, server_nonce, peer, self.identity)
                if secret is not None:
                    session = PeerSession.for_client(secret, client_nonce, server_nonce, peer, self.identity)
                    return sock, wire.proof(secret, wire.Role.CLIENT, client_nonce, server_nonce, peer,
                                            self.identity), session
            raise PeerAuthError(f"{peer} did not prove a shared peer secret for its address")
        except BaseException:
            sock.close()
            raise

    def fetch(self, peer: str, root: KeyRoot, token_ids: np.ndarray, block_size: int,
              block_bytes: int, sink: FetchSink, max_blocks: int, skip_blocks: int = 0,
              deadline: float | None = None) -> FetchOutcome:
        """Blocks [skip_blocks, matched) of the prompt into `sink`; never raises.

        The whole fetch (connect, handshake, request, every byte of the answer) ends by
        `deadline` (monotonic; default `timeout_s` from now): what arrived verified by
        then is kept, the rest is a miss."""
        outcome = FetchOutcome()
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        try:
            sock, client_proof, session = self._connect(peer, deadline)
        except PeerAuthError:
            outcome.error = "peer failed authentication"
            return outcome
        except (OSError, wire.ProtocolError, ValueError) as exc:
            outcome.error = f"connect: {exc.__class__.__name__}"
            return outcome
        try:
            request = wire.FetchRequest(root=wire.WireRoot.of(root), block_bytes=block_bytes,
                                        block_size=block_size, max_blocks=max_blocks,
                                        skip_blocks=skip_blocks)
            sock.settimeout(_left(deadline))
            sock.sendall(client_proof + session.seal(wire.encode_fetch(request, token_ids)))
            status, body = _read_reply(sock, session, deadline)
            if status is not wire.Status.OK:
                outcome.error = None if status is wire.Status.MISS else status.name.lower()
                return outcome
            header = wire.FetchHeader.model_validate_json(body)
            if header.block_bytes != block_bytes or header.n_blocks > max_blocks:
                outcome.error = "peer answered with the wrong shape"
                return outcome
            outcome.announced_blocks = header.n_blocks
            views = sink.reserve(header.n_blocks) if header.n_blocks else None
            if not views:
                outcome.error = "no room to receive"
                return outcome
            self._receive(sock, session, views, deadline, outcome)
        except RecordAuthError:
            outcome.error = RECORD_AUTH_FAILED
        except TimeoutError:  # socket.timeout is TimeoutError: the deadline passed mid-way
            outcome.error = "deadline"
        except (OSError, ConnectionError, wire.ProtocolError, ValueError) as exc:
            outcome.error = f"{exc.__class__.__name__}"
        finally:
            sock.close()
        return outcome

    def _receive(self, sock: socket.socket, session: PeerSession, views: list[memoryview], deadline: float,
                 outcome: FetchOutcome) -> None:
        """Receive run chunks in order, each block's record into a staging buffer and
        decrypted from there straight into its view; keep the blocks whose tags and
        digests match, stop at the first that does not (a failed tag raises).

        Each block is hashed as soon as it landed, while it is still in cache (on
        machines with >= 4 cores, on a helper thread while the next one arrives)."""
        digests_out = outcome.digests
        staging = memoryview(bytearray(sealed_size(len(views[0]))))
        head = staging[: wire.RECORD.size]
        while outcome.verified_blocks < len(views):
            run = _read_record(sock, session, deadline, wire.MAX_RUN_RECORD_BYTES)
            first, count = wire.decode_run_header(run[: wire.RUN.size])
            if first != outcome.verified_blocks or first + count > len(views) or len(run) != wire.RUN.size + 8 * count:
                raise wire.ProtocolError("run out of order")
            expected = np.frombuffer(run, dtype="<u8", offset=wire.RUN.size)
            pending = []
            for view in views[first : first + count]:
                recv_into_by(sock, staging, deadline)
                if wire.decode_record_header(head, len(view)) != len(view):
                    raise wire.ProtocolError("block record of the wrong length")
                session.open_into(head, staging[wire.RECORD.size:], view)
                outcome.bytes_received += len(view)
                pending.append(self._hasher.submit(xxhash.xxh3_64_intdigest, view) if len(view) >= THREADED_HASH_BYTES
                               else xxhash.xxh3_64_intdigest(view))
            for i, got in enumerate(pending):
                digest = got.result() if not isinstance(got, int) else got
                if digest != int(expected[i]):
                    outcome.error = CHECKSUM_MISMATCH
                    return
                digests_out.append(digest)
                outcome.verified_blocks += 1

    def hot_prefixes(self, peer: str, tenant: str, max_bytes: int) -> HotPrefixes:
        deadline = time.monotonic() + self.timeout_s
        sock, client_proof, session = self._connect(peer, deadline)
        try:
            sock.settimeout(_left(deadline))
            request = wire.HotRequest(tenant=tenant, max_bytes=max_bytes).model_dump_json().encode()
            sock.sendall(client_proof + session.seal(wire.encode_request(wire.Op.HOT, request)))
            status, body = _read_reply(sock, session, deadline)
            if status is not wire.Status.OK:
                raise ConnectionError(f"peer answered {status.name}")
            response = wire.HotResponse.model_validate_json(body)
            return HotPrefixes([(p.root.key_root(), np.asarray(p.tokens, dtype=np.uint32)) for p in response.prefixes])
        finally:
            sock.close()
