"""Calling a sidecar's control API as the operator does: HTTPS to an IP, the
certificate verified against the operator's CA for the policy's name
(`kvtier.control_tls.server_name`), which is not the host in the URL. The standard
library's `urlopen` verifies the URL's host; this connects by IP and verifies the name."""
from __future__ import annotations

import http.client
import json
import socket
import ssl
from dataclasses import dataclass

from kvtier import control_tls

TIMEOUT_S = 5.0


def _no_delay(sock: socket.socket) -> socket.socket:
    """TCP_NODELAY, as aiohttp's client (the operator's) sets it: http.client writes a
    request's headers and its body apart, and with Nagle on the body waits for the
    server's delayed ACK, ~40 ms per request with a body."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class NoDelayHTTPConnection(http.client.HTTPConnection):
    """Plain HTTP with TCP_NODELAY (see `_no_delay`): for any request with a body."""

    def connect(self) -> None:
        super().connect()
        _no_delay(self.sock)


def post_json(host: str, port: int, path: str, body: dict, timeout_s: float) -> tuple[int, bytes]:
    """One JSON POST over plain HTTP with TCP_NODELAY: (status, body)."""
    conn = NoDelayHTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class _NamedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to (host, port) whose certificate must name `server_name`."""

    def __init__(self, host: str, port: int, server_name: str, context: ssl.SSLContext, timeout: float,
                 source_address: tuple[str, int] | None = None) -> None:
        super().__init__(host, port, timeout=timeout, context=context, source_address=source_address)
        self.server_name = server_name

    def connect(self) -> None:
        sock = _no_delay(socket.create_connection((self.host, self.port), self.timeout, self.source_address))
        self.sock = self._context.wrap_socket(sock, server_hostname=self.server_name)


@dataclass(frozen=True)
class ControlEndpoint:
    """One sidecar's control port. `ca_pem` None: plain HTTP (a sidecar configured with
    `control_tls.plain_http`)."""

    host: str
    port: int
    server_name: str = ""
    ca_pem: bytes | None = None

    def connection(self, timeout_s: float = TIMEOUT_S,
                   source_address: tuple[str, int] | None = None) -> http.client.HTTPConnection:
        """A connection (not yet connected) to the port, verifying as the operator does."""
        if self.ca_pem is None:
            return NoDelayHTTPConnection(self.host, self.port, timeout=timeout_s, source_address=source_address)
        return _NamedHTTPSConnection(self.host, self.port, self.server_name, control_tls.client_context(self.ca_pem),
                                     timeout_s, source_address)

    def exchange(self, method: str, path: str, body: dict | bytes | None = None,
                 headers: dict[str, str] | None = None, timeout_s: float = TIMEOUT_S,
                 source_address: tuple[str, int] | None = None) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body). `headers` None: a JSON Content-Type when there is a
        body; given, exactly those. TLS failures (a wrong CA or name) raise
        ssl.SSLError before anything is sent."""
        conn = self.connection(timeout_s, source_address)
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        if headers is None:
            headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def request(self, method: str, path: str, body: dict | bytes | None = None, **kw) -> tuple[int, bytes]:
        status, _, raw = self.exchange(method, path, body, **kw)
        return status, raw

    def get(self, path: str, **kw) -> tuple[int, bytes]:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: dict | bytes, **kw) -> tuple[int, bytes]:
        return self.request("POST", path, body, **kw)

    def get_json(self, path: str, **kw) -> dict:
        status, body = self.get(path, **kw)
        if status != 200:
            raise AssertionError(f"GET {path} on {self.host}:{self.port}: {status} {body[:300]!r}")
        return json.loads(body)
