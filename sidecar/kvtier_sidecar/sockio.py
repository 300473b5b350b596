"""Exact reads from a stream socket (the engine socket and the peer tier): a short
read is waited out, a closed connection is a ConnectionError, never a short buffer."""
from __future__ import annotations

import socket


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    total = len(view)
    while got < total:
        k = sock.recv_into(view[got:], total - got)
        if k == 0:
            raise ConnectionError("the other end closed the connection")
        got += k
