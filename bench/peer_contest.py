"""Peer-fetch throughput against its baselines: same bytes, same machine, interleaved.

Every contestant moves the same bytes (the bench's KV run) from another process into
a preallocated, already-touched buffer of this process:

    peer fetch        TcpTransport.fetch from a sidecar's arena (auth, token match,
                      per-block checksums verified): the figure under test
    raw TCP, fresh    a child process sendall()s the bytes from one buffer; we
                      recv_into() the destination; a connection per transfer, as a fetch
    raw TCP, kept     the same over one long-lived connection
    TLS, fresh/kept   the same two over TLS 1.3 (Python's ssl, OpenSSL, the suite it
                      negotiates: TLS_AES_256_GCM_SHA384, the fetch's cipher), the
                      standard encrypted transport: what an encrypted peer path costs
                      when nobody writes one
    Redis, LMCache    LMCache's redis connector (lmcache/v1/storage_backend/connector/
                      redis_connector.py, RedisConnector): the KV is cut into chunks of
                      LMCACHE_CHUNK_TOKENS tokens; a chunk is two keys, `<key>metadata`
                      and `<key>kv_bytes`; a batched get is asyncio.gather over the
                      chunks, each chunk a GET of its metadata then a GET of its bytes on
                      redis.asyncio (hiredis parser), then a copy into the destination
    Redis, sync GET   context: the simplest redis-py loop, one blocking GET per chunk of
                      the same keys, copied into the destination

A round runs every contestant once, in an order rotated from round to round, so a
burst of load from the shared machine hits all of them alike; a warm-up round (which
also checks every contestant delivered exactly the bytes) is not timed. Each figure is
the median over the rounds, with its spread (min..max).
"""
from __future__ import annotations

import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

# LMCache's default `chunk_size` (tokens per KV chunk, one Redis value per chunk).
LMCACHE_CHUNK_TOKENS = 256
# LMCache's RemoteMetadata (length, shape, dtype, format) is a few ints: a few dozen bytes;
# its exact size does not move the figure (the second GET's round trip does).
LMCACHE_METADATA_BYTES = 28
# LMCache's RedisConnector connection-pool bound.
LMCACHE_MAX_CONNECTIONS = 150

# The raw-TCP sender: serves the bytes of the file at argv[1] to every 1-byte request,
# a thread per connection (the kept connection stays open while fresh ones come).
# Tuned as well as we could measure: sendall of RAW_SEND_SLICE_BYTES slices of one
# buffer (one 64 MiB sendall measured slower and costlier in sender kernel time here),
# kernel buffer autotuning left on (fixed 4-32 MiB SO_SNDBUF/SO_RCVBUF were no faster),
# no sendfile() (slower on loopback here).
_SENDER = r"""
import os, socket, sys, threading
path, ready, SLICE = sys.argv[1], sys.argv[2], int(sys.argv[3])
cert = sys.argv[4] if len(sys.argv) > 4 else ""
with open(path, "rb") as f:
    buf = memoryview(bytearray(f.read()))
server = socket.create_server(("127.0.0.1", 0))
if cert:  # TLS 1.3 with this key and certificate
    import ssl
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cert, cert + ".key")
with open(ready + ".tmp", "w") as f:
    f.write(str(server.getsockname()[1]))
os.replace(ready + ".tmp", ready)
done = threading.Event()
# The parent holds our stdin: when it dies, however it dies, we go with it.
threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()

def serve(conn):
    if cert:
        try:
            conn = ctx.wrap_socket(conn, server_side=True)
        except OSError:
            conn.close()
            return
    with conn:
        try:
            while op := conn.recv(1):
                if op == b"q":
                    done.set()
                    server.close()
                    return
                for start in range(0, len(buf), SLICE):
                    conn.sendall(buf[start : start + SLICE])
        except OSError:  # the receiver went away (a TLS peer closing without close_notify)
            return

while not done.is_set():
    try:
        conn, _ = server.accept()
    except OSError:
        break
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""
SENDER_READY_TIMEOUT_S = 15.0
RAW_SEND_SLICE_BYTES = 4 << 20


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


@dataclass(slots=True)
class Contestant:
    """One way of moving the bytes: `transfer()` moves them once into `dst`."""

    name: str
    transfer: Callable[[], None]
    dst: np.ndarray
    samples_gbps: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, name: str, move: Callable[[np.ndarray], None], nbytes: int) -> "Contestant":
        """A contestant moving into its own touched buffer of `nbytes`."""
        dst = touched(nbytes)
        return cls(name, lambda: move(dst), dst)

    @property
    def median_gbps(self) -> float:
        return statistics.median(self.samples_gbps)

    def spread(self) -> str:
        return f"{min(self.samples_gbps):.2f}..{max(self.samples_gbps):.2f}"

    def summary(self) -> str:
        return f"{self.name} {self.median_gbps:.2f} GB/s (spread {self.spread()}, n={len(self.samples_gbps)})"


def touched(nbytes: int) -> np.ndarray:
    """A destination whose pages are already faulted in: page faults are not transfer."""
    return np.ones(nbytes, np.uint8)


def contest(contestants: list[Contestant], expected: np.ndarray, rounds: int) -> None:
    """Warm-up round checking every contestant's bytes, then `rounds` timed rounds."""
    for c in contestants:
        c.dst[:] = 0
        c.transfer()
        if not np.array_equal(c.dst, expected):
            raise AssertionError(f"{c.name} did not deliver the expected bytes")
    n = len(contestants)
    for r in range(rounds):
        for i in range(n):
            c = contestants[(r + i) % n]
            t0 = time.perf_counter()
            c.transfer()
            c.samples_gbps.append(_gbps(c.dst.nbytes, time.perf_counter() - t0))


def pooled_median(contestants: list[Contestant]) -> float:
    """Median over the samples of several contestants taken as one (variants of one baseline)."""
    return statistics.median(x for c in contestants for x in c.samples_gbps)


def paired_ratio(mine: Contestant, baselines: list[Contestant]) -> str:
    """Median and quartiles of mine / baseline taken round by round: the two ran within
    a fraction of a second of each other, so slow drifts in machine load cancel."""
    ratios = [x / statistics.median(b.samples_gbps[i] for b in baselines) for i, x in enumerate(mine.samples_gbps)]
    q1, q2, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return f"{q2:.2f}x (quartiles {q1:.2f}..{q3:.2f})"


def _self_signed(path: str) -> None:
    """A P-256 key and a certificate for 127.0.0.1 at `path` (+ ".key")."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvtier-bench")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    with open(path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(path + ".key", "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))


class RawTcp:
    """Raw Python TCP loopback between two processes: the ceiling a Python peer can reach.
    With `tls`, the same over TLS 1.3, the certificate verified."""

    def __init__(self, payload: np.ndarray, tls: bool = False) -> None:
        self.nbytes = payload.nbytes
        self._dir = tempfile.mkdtemp(prefix="kvtier-rawtcp-")
        path = os.path.join(self._dir, "payload")
        payload.tofile(path)
        ready = os.path.join(self._dir, "port")
        args = [sys.executable, "-c", _SENDER, path, ready, str(RAW_SEND_SLICE_BYTES)]
        self._tls = None
        if tls:
            import ssl

            cert = os.path.join(self._dir, "cert.pem")
            _self_signed(cert)
            args.append(cert)
            self._tls = ssl.create_default_context(cafile=cert)
            self._tls.minimum_version = ssl.TLSVersion.TLSv1_3
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE)
        deadline = time.monotonic() + SENDER_READY_TIMEOUT_S
        while not os.path.exists(ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("raw TCP sender did not start")
            time.sleep(0.01)
        self.port = int(open(ready).read())
        self._kept: socket.socket | None = None

    def _receive(self, conn: socket.socket, dst: np.ndarray) -> None:
        view = memoryview(dst)
        conn.sendall(b"g")
        got, total = 0, self.nbytes
        while got < total:
            k = conn.recv_into(view[got:], total - got)
            if k == 0:
                raise ConnectionError("raw TCP sender went away")
            got += k

    def _connect(self) -> socket.socket:
        conn = socket.create_connection(("127.0.0.1", self.port))
        return conn if self._tls is None else self._tls.wrap_socket(conn, server_hostname="127.0.0.1")

    def cipher(self) -> str:
        """The TLS suite a connection negotiates ("" for plain TCP)."""
        if self._tls is None:
            return ""
        with self._connect() as conn:
            return conn.cipher()[0]

    def fresh(self, dst: np.ndarray) -> None:
        with self._connect() as conn:
            self._receive(conn, dst)

    def kept(self, dst: np.ndarray) -> None:
        if self._kept is None:
            self._kept = self._connect()
        self._receive(self._kept, dst)

    def close(self) -> None:
        if self._kept is not None:
            self._kept.close()
        try:
            with self._connect() as conn:
                conn.settimeout(2)
                conn.sendall(b"q")
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.proc.stdin.close()
        for name in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, name))
        os.rmdir(self._dir)


class RedisKv:
    """The bytes stored in a real Redis the way LMCache's redis connector stores them."""

    def __init__(self, url: str, payload: np.ndarray, chunk_bytes: int, prefix: str = "bench@chunk") -> None:
        import redis

        self.url = url
        self.chunk_bytes = chunk_bytes
        self.nbytes = payload.nbytes
        self.keys = [f"{prefix}{i}" for i in range(-(-payload.nbytes // chunk_bytes))]
        with redis.Redis.from_url(url) as r:
            for i, key in enumerate(self.keys):
                chunk = payload[i * chunk_bytes : (i + 1) * chunk_bytes]
                r.set(key + "kv_bytes", chunk.tobytes())  # LMCache sets the bytes first
                r.set(key + "metadata", len(chunk).to_bytes(LMCACHE_METADATA_BYTES, "little"))
        self._sync = redis.Redis.from_url(url)
        self._loop = asyncio.new_event_loop()
        self._async = self._loop.run_until_complete(self._open_async())

    async def _open_async(self):
        import redis.asyncio as aredis

        pool = aredis.ConnectionPool.from_url(self.url, max_connections=LMCACHE_MAX_CONNECTIONS)
        return aredis.Redis.from_pool(pool)

    def lmcache(self, dst: np.ndarray) -> None:
        """RedisConnector.batched_get_non_blocking: gather of per-chunk _get."""
        self._loop.run_until_complete(self._lmcache(memoryview(dst)))

    async def _lmcache(self, view: memoryview) -> None:
        async def get_chunk(i: int, key: str) -> None:
            meta = await self._async.get(key + "metadata")
            length = int.from_bytes(meta, "little")
            kv = await self._async.get(key + "kv_bytes")
            start = i * self.chunk_bytes
            view[start : start + length] = kv

        await asyncio.gather(*(get_chunk(i, key) for i, key in enumerate(self.keys)))

    def sync_get(self, dst: np.ndarray) -> None:
        view = memoryview(dst)
        for i, key in enumerate(self.keys):
            kv = self._sync.get(key + "kv_bytes")
            view[i * self.chunk_bytes : i * self.chunk_bytes + len(kv)] = kv

    def close(self) -> None:
        self._sync.close()
        self._loop.run_until_complete(self._async.aclose())
        self._loop.close()


def hash_gbps(payload: np.ndarray, block_bytes: int, repeat: int = 3) -> float:
    """xxh3-64 over every block of the payload (what a receiver verifies), best of `repeat`."""
    import xxhash

    view = memoryview(payload)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for start in range(0, payload.nbytes, block_bytes):
            xxhash.xxh3_64_intdigest(view[start : start + block_bytes])
        best = min(best, time.perf_counter() - t0)
    return _gbps(payload.nbytes, best)


def _sealing(payload: np.ndarray, block_bytes: int, repeat: int, opening: bool) -> float:
    """One core sealing (or opening) every block of the payload as the peer session does
    (a record per block, into a reused buffer), best of `repeat`."""
    from kvtier_sidecar import wire
    from kvtier_sidecar.peer_session import PeerSession, sealed_size

    key = os.urandom(32)
    sender, receiver = PeerSession(key, key), PeerSession(key, key)
    view = memoryview(payload)
    blocks = [view[s : s + block_bytes] for s in range(0, payload.nbytes, block_bytes)]
    records = [memoryview(bytearray(sealed_size(block_bytes))) for _ in blocks]
    out = memoryview(bytearray(block_bytes))
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for block, record in zip(blocks, records):
            sender.seal_into(block, record)
        sealed_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for record in records:
            receiver.open_into(record[: wire.RECORD.size], record[wire.RECORD.size:], out)
        best = min(best, time.perf_counter() - t0 if opening else sealed_s)
    return _gbps(payload.nbytes, best)


def seal_gbps(payload: np.ndarray, block_bytes: int, repeat: int = 3) -> float:
    return _sealing(payload, block_bytes, repeat, opening=False)


def open_gbps(payload: np.ndarray, block_bytes: int, repeat: int = 3) -> float:
    return _sealing(payload, block_bytes, repeat, opening=True)
