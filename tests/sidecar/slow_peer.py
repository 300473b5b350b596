"""A peer that proves the fleet's secret and then answers a trickle: an insider (or a
sick host) that is slow, not silent. It speaks the real handshake so the sidecar under
test gets past authentication, announces a large answer, and sends it a byte at a time
until the sidecar hangs up."""
from __future__ import annotations

import os
import socket
import threading
import time

from kvtier_sidecar import wire
from kvtier_sidecar.sockio import recv_exact


class TricklingPeer:
    """Serves every connection on its own thread; `active` is how many it is trickling
    to now, `peak` the most at once, `lifetimes_s` how long each lasted until the other
    side hung up (a trickle is never finished by this side)."""

    def __init__(self, host: str, secret: bytes, every_s: float) -> None:
        self.secret = secret
        self.every_s = every_s
        self.sock = socket.create_server((host, 0))
        self.address = "%s:%d" % self.sock.getsockname()[:2]
        self._lock = threading.Lock()
        self.active = 0
        self.peak = 0
        self.accepted = 0
        self.lifetimes_s: list[float] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        opened = time.monotonic()
        with self._lock:
            self.accepted += 1
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            conn.settimeout(30)
            head = recv_exact(conn, wire.HELLO.size)
            client_nonce, id_len = wire.decode_hello_head(head)
            client_id = wire.decode_identity(recv_exact(conn, id_len))
            server_nonce = os.urandom(wire.NONCE_BYTES)
            conn.sendall(wire.encode_challenge(server_nonce, [wire.proof(
                self.secret, wire.Role.SERVER, client_nonce, server_nonce, self.address, client_id)]))
            recv_exact(conn, wire.PROOF_BYTES)
            length = wire.decode_record_header(recv_exact(conn, wire.RECORD.size), wire.MAX_REQUEST_RECORD_BYTES)
            recv_exact(conn, length + wire.TAG_BYTES)  # the sealed request: read, never answered
            # The largest sealed answer a client accepts, a byte at a time.
            answer = wire.RECORD.pack(wire.RECORD_MAGIC, wire.MAX_RESPONSE_RECORD_BYTES)
            answer += bytes(wire.MAX_RESPONSE_RECORD_BYTES + wire.TAG_BYTES)
            for i in range(len(answer)):
                conn.sendall(answer[i:i + 1])
                if self._stop.wait(self.every_s):
                    return
        except OSError:
            pass  # the sidecar hung up: what a trickle should come to
        finally:
            conn.close()
            with self._lock:
                self.active -= 1
                self.lifetimes_s.append(time.monotonic() - opened)

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
