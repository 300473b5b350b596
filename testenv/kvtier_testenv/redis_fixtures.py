"""A real `redis-server` on a free loopback port, for tests and the demo.

`RedisServer` is the plain helper (start, kill -9, restart on the same port, stop);
the pytest fixtures wrap it:

- `redis_server` (session scoped): one server shared by the whole session.
- `redis_server_fn` (function scoped): a private server a test may kill and restart.
- `redis_url`: the session server's URL, with the database flushed before the test.

A missing `redis-server` binary fails loudly: it is never a skip.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REDIS_BINARY_ENV = "KVTIER_REDIS_SERVER"
# Long enough for a cold start on a loaded 2-core CI machine, short enough to fail fast.
READY_TIMEOUT_S = 15.0


def redis_binary() -> str:
    """Path of redis-server; raises RuntimeError with the fix when it is absent."""
    explicit = os.environ.get(REDIS_BINARY_ENV)
    found = explicit or shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None
    )
    if not found or not os.access(found, os.X_OK):
        raise RuntimeError(
            "redis-server not found: install it (apt-get install redis-server, or run "
            f"scripts/setup.sh) or point {REDIS_BINARY_ENV} at the binary"
        )
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process with no persistence, bound to `host:port`.

    The port is fixed at construction, so `kill()` then `start()` brings the server
    back where clients expect it (empty: a restart loses the data, as in production
    without persistence).
    """

    def __init__(self, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.binary = redis_binary()
        self._dir = tempfile.mkdtemp(prefix="kvtier-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> "RedisServer":
        if self.proc is not None and self.proc.poll() is None:
            return self
        args = [
            self.binary,
            "--bind", self.host,
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "no",
            "--dir", self._dir,
            "--logfile", str(Path(self._dir) / "redis.log"),
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}{self.log_tail()}")
            if self.ping():
                return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on {self.host}:{self.port} not ready in {READY_TIMEOUT_S}s")

    def ping(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def log_tail(self, n: int = 20) -> str:
        path = Path(self._dir) / "redis.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])

    def kill(self) -> None:
        """SIGKILL, as a crashed or evicted Redis pod would go; waits until it is gone."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def restart(self) -> "RedisServer":
        self.kill()
        return self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture()
def redis_server_fn() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture()
def redis_url(redis_server: RedisServer) -> str:
    if not redis_server.ping():
        redis_server.start()
    with socket.create_connection((redis_server.host, redis_server.port), timeout=2) as s:
        s.sendall(b"FLUSHALL\r\n")
        s.recv(16)
    return redis_server.url
