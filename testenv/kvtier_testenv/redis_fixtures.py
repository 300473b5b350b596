"""A real `redis-server` on a free loopback port, and a real Redis Cluster of several,
for tests and the demo.

`RedisServer` is the plain helper (start, kill -9, restart on the same port, stop);
`RedisCluster` joins several of them in cluster mode with `redis-cli --cluster create`.
The pytest fixtures wrap them:

- `redis_server` (session scoped): one server shared by the whole session.
- `redis_server_fn` (function scoped): a private server a test may kill and restart.
- `redis_url`: the session server's URL, with the database flushed before the test.
- `redis_cluster` (session scoped): a three-primary cluster, flushed and with every
  node up before each test that takes it (a test may kill and restart nodes).

A missing `redis-server` or `redis-cli` binary fails loudly: it is never a skip.
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

from kvtier_testenv.ports import free_port

REDIS_BINARY_ENV = "KVTIER_REDIS_SERVER"
REDIS_CLI_ENV = "KVTIER_REDIS_CLI"
# Long enough for a cold start on a loaded 2-core CI machine, short enough to fail fast.
READY_TIMEOUT_S = 15.0


def _binary(name: str, env_var: str, debian_package: str) -> str:
    """Path of a Redis program: $env_var, else PATH, else /usr/bin; RuntimeError with
    the fix when absent."""
    found = os.environ.get(env_var) or shutil.which(name) or (
        f"/usr/bin/{name}" if os.path.exists(f"/usr/bin/{name}") else None
    )
    if not found or not os.access(found, os.X_OK):
        raise RuntimeError(
            f"{name} not found: install it (apt-get install {debian_package}, or run "
            f"scripts/setup.sh) or point {env_var} at the binary"
        )
    return found


def redis_binary() -> str:
    return _binary("redis-server", REDIS_BINARY_ENV, "redis-server")


def redis_cli_binary() -> str:
    """redis-cli creates clusters."""
    return _binary("redis-cli", REDIS_CLI_ENV, "redis-tools")


class RedisServer:
    """One redis-server process with no persistence, bound to `host:port`.

    The port is fixed at construction, so `kill()` then `start()` brings the server
    back where clients expect it (empty: a restart loses the data, as in production
    without persistence).
    """

    def __init__(self, host: str = "127.0.0.1", port: int | None = None,
                 extra_args: tuple[str, ...] = (), password: str | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.binary = redis_binary()
        self.password = password  # requirepass: every client must AUTH first
        self.extra_args = extra_args + (("--requirepass", password) if password else ())
        self._dir = tempfile.mkdtemp(prefix="kvtier-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

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
            *self.extra_args,
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
                s.sendall(self._auth() + b"PING\r\n")
                answer = s.recv(64)
                return answer.startswith(b"+OK\r\n+PONG" if self.password else b"+PONG")
        except OSError:
            return False

    def _auth(self) -> bytes:
        return f"AUTH {self.password}\r\n".encode() if self.password else b""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self, *args: str, timeout_s: float = 2.0) -> bytes:
        """One command over a raw socket (inline protocol), the reply's raw bytes.
        Raw so the helper needs no client library and works on a half-started node."""
        with socket.create_connection((self.host, self.port), timeout=timeout_s) as s:
            if self.password:
                s.sendall(self._auth())
                if not s.recv(16).startswith(b"+OK"):
                    raise RuntimeError("redis-server refused the password")
            s.sendall(" ".join(args).encode() + b"\r\n")
            head = s.recv(65536)
            if not head.startswith(b"$"):
                return head
            size = int(head[1:head.index(b"\r\n")])
            body = head[head.index(b"\r\n") + 2:]
            while len(body) < size:
                chunk = s.recv(65536)
                if not chunk:
                    break
                body += chunk
            return body[:size]

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


# Node timeout: how long the others wait before marking a killed node failed. Short, so
# a test sees the failure quickly; still far above loopback round trips.
CLUSTER_NODE_TIMEOUT_MS = 1000
CLUSTER_SLOTS = 16384


class RedisCluster:
    """`n` redis-server primaries on loopback joined into one Redis Cluster (no replicas).

    Every node gets its own free client port and free cluster-bus port (`cluster-port`,
    so port + 10000 never has to be free) and its own temp dir holding `nodes.conf`, so
    `kill(i)` then `restart(i)` brings node i back with its slots on the same port, empty.
    `cluster-require-full-coverage no`: while a node is down the others keep serving
    their own slots (the index degrades per key root, not all at once).
    """

    def __init__(self, n: int = 3, host: str = "127.0.0.1") -> None:
        if n < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 primaries, got n={n}")
        self.host = host
        self.cli = redis_cli_binary()
        self.nodes = [RedisServer(host, extra_args=(
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-port", str(free_port(host)),
            "--cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS),
            "--cluster-require-full-coverage", "no",
        )) for _ in range(n)]

    @property
    def url(self) -> str:
        """A startup node for cluster clients (they discover the rest)."""
        return f"redis://{self.host}:{self.nodes[0].port}/0"

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    def start(self) -> "RedisCluster":
        for node in self.nodes:
            node.start()
        result = subprocess.run(
            [self.cli, "--cluster", "create", *(f"{self.host}:{p}" for p in self.ports),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=READY_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed ({result.returncode}): "
                               f"{result.stdout[-2000:]}{result.stderr[-2000:]}")
        self.wait_ok()
        return self

    def info(self, i: int) -> dict[str, str]:
        raw = self.nodes[i].command("CLUSTER", "INFO").decode(errors="replace")
        return dict(line.split(":", 1) for line in raw.splitlines() if ":" in line)

    def wait_ok(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until every running node reports cluster_state:ok with all slots assigned and
        knows every node (a client reading any of them sees the whole map)."""
        deadline = time.monotonic() + timeout_s
        last: dict[str, str] = {}
        while time.monotonic() < deadline:
            try:
                infos = [self.info(i) for i, node in enumerate(self.nodes) if node.running]
            except OSError:
                infos = []
            if infos and all(
                inf.get("cluster_state") == "ok"
                and inf.get("cluster_slots_assigned") == str(CLUSTER_SLOTS)
                and inf.get("cluster_known_nodes") == str(len(self.nodes))
                for inf in infos
            ):
                return
            last = infos[0] if infos else last
            time.sleep(0.05)
        raise RuntimeError(f"redis cluster on ports {self.ports} not ok in {timeout_s}s: {last}")

    def node_for_port(self, port: int) -> int:
        return self.ports.index(port)

    def dbsize(self, i: int) -> int:
        return int(self.nodes[i].command("DBSIZE").strip().lstrip(b":"))

    def flushall(self) -> None:
        for node in self.nodes:
            if node.running:
                node.command("FLUSHALL")

    def kill(self, i: int) -> None:
        """SIGKILL node i, as a crashed Redis pod would go."""
        self.nodes[i].kill()

    def wait_marked_failed(self, i: int, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until a surviving node has marked killed node i as failed (after the node
        timeout), so its slots read as down rather than merely slow."""
        port = str(self.nodes[i].port)
        observer = next(n for n in self.nodes if n.running)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in observer.command("CLUSTER", "NODES").decode(errors="replace").splitlines():
                fields = line.split()
                if len(fields) > 2 and fields[1].split("@")[0].endswith(f":{port}") and "fail" in fields[2].split(","):
                    return
            time.sleep(0.05)
        raise RuntimeError(f"node on port {port} not marked failed in {timeout_s}s")

    def restart(self, i: int) -> None:
        """Start node i again on its port; it rejoins from its nodes.conf, empty."""
        self.nodes[i].start()
        self.wait_ok()

    def heal(self) -> None:
        """Every node up and the cluster ok (a fixture's reset between tests)."""
        restarted = False
        for node in self.nodes:
            if not node.running:
                node.start()
                restarted = True
        if restarted:
            self.wait_ok()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> "RedisCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def redis_cluster_session() -> Iterator[RedisCluster]:
    with RedisCluster() as cluster:
        yield cluster


@pytest.fixture()
def redis_cluster(redis_cluster_session: RedisCluster) -> RedisCluster:
    """The session's cluster with every node up and no keys."""
    redis_cluster_session.heal()
    redis_cluster_session.flushall()
    return redis_cluster_session


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
