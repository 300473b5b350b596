"""The engine client's socket: its timeouts hold with blocking I/O (SO_RCVTIMEO)."""
from __future__ import annotations

import socket
import threading

import numpy as np

from kvtier.keys import KeyRoot
from kvtier_sidecar.client import UNAVAILABLE, Miss, SidecarClient
from kvtier_sidecar.engine_proto import FRAME, decode_header

ROOT = KeyRoot("t", "m", "v1", "float16", "rope", "sdpa")


def _server(tmp_path, answer):
    """A Unix socket that reads one request and lets `answer(conn, header)` reply (or not)."""
    path = str(tmp_path / "engine.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    conns = []

    def serve():
        conn, _ = listener.accept()
        conns.append(conn)
        head = conn.recv(FRAME.size, socket.MSG_WAITALL)
        body_len, op, rid, _ = decode_header(head)
        conn.recv(body_len - 4, socket.MSG_WAITALL)
        answer(conn, op, rid)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return path, listener, conns, t


def test_a_sidecar_that_never_answers_is_a_miss_after_the_clients_timeout(tmp_path):
    path, listener, conns, t = _server(tmp_path, lambda conn, op, rid: None)
    try:
        client = SidecarClient(path, timeout_s=0.2)
        got = client.lookup(ROOT, np.arange(40, dtype=np.uint32))
        assert isinstance(got, Miss) and got.reason == UNAVAILABLE
        assert client.faults == 1
    finally:
        t.join(5)
        for c in conns:
            c.close()
        listener.close()

