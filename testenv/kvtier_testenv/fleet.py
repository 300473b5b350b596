"""A fleet on loopback: Redis, N sidecar processes (127.0.0.2, .3, ...) and engine
processes replaying a multi-tenant workload through them.

`start_sidecar` / `SidecarHandle` are the process helpers the tests use too;
`run_fleet` is what the checkout's demo runs for `--mode fleet` (`kvtier_testenv.demo`):

    report = run_fleet(sidecars=3, engines_per_sidecar=1, tenants=6, requests=300)
    report["tiers"]  # per-tier hit rates and bytes moved
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier import control_api, control_tls
from kvtier_operator import control_ca

from .control_client import ControlEndpoint
from .workload import ReplayStats, Request, make_oracle, make_workload, replay

READY_TIMEOUT_S = 30.0


@dataclass
class SidecarHandle:
    name: str
    ip: str
    workdir: Path
    config: dict
    proc: subprocess.Popen | None = None
    ready: dict = field(default_factory=dict)

    @property
    def config_path(self) -> Path:
        return self.workdir / f"{self.name}.yaml"

    @property
    def ready_path(self) -> Path:
        return self.workdir / f"{self.name}.ready.json"

    @property
    def socket(self) -> str:
        return self.config["engine_socket"]

    @property
    def tls(self) -> FleetTls | None:
        """The fleet's control TLS when this sidecar serves HTTPS (the default)."""
        cert = (self.config.get("control_tls") or {}).get("cert_file")
        return fleet_tls(self.workdir) if cert else None

    @property
    def http(self) -> str:
        """The control API's base URL (https unless the config chose plain HTTP)."""
        return ("https://" if self.tls else "http://") + self.ready["http"]

    @property
    def control(self) -> ControlEndpoint:
        """The control API as the operator calls it (the fleet's CA and server name)."""
        host, port = self.ready["http"].rsplit(":", 1)
        tls = self.tls
        return ControlEndpoint(host, int(port), tls.server_name if tls else "", tls.ca_pem if tls else None)

    @property
    def peer(self) -> str:
        return self.ready["peer"]

    def write_config(self) -> None:
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.config))
        tmp.replace(self.config_path)

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> "SidecarHandle":
        self.write_config()
        self.ready_path.unlink(missing_ok=True)
        log = open(self.workdir / f"{self.name}.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtier_sidecar", "--config", str(self.config_path),
                                      "--ready-file", str(self.ready_path)], stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not self.ready_path.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"sidecar {self.name} not ready in {timeout_s}s:\n{self.log_tail()}")
            time.sleep(0.02)
        self.ready = json.loads(self.ready_path.read_text())
        return self

    def log_tail(self, n: int = 30) -> str:
        path = self.workdir / f"{self.name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no deregistration, no cleanup - a crashed pod."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM and wait: the graceful path (deregisters, unlinks the arena)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def get(self, path: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
        return self.control.get(path, timeout_s=timeout_s)

    def post(self, path: str, body: dict | bytes, timeout_s: float = 5.0) -> tuple[int, bytes]:
        return self.control.post(path, body, timeout_s=timeout_s)

    def stats(self, tenant: str | None = None) -> dict:
        status, body = self.get(control_api.STATS.url(tenant=tenant or None))
        assert status == 200, body
        return json.loads(body)


def fleet_namespace(workdir: Path) -> str:
    """One namespace per fleet directory: the arena's shared-memory name derives from
    (namespace, pod), so fleets run side by side on one host (tests in parallel) never
    take each other's segments; a sidecar restarted in the same fleet replaces its own."""
    return "kvtier-fleet-" + hashlib.blake2b(str(Path(workdir).resolve()).encode(), digest_size=4).hexdigest()


def fleet_secret(workdir: Path) -> str:
    """The peer secret file every sidecar of the fleet in `workdir` shares (written once:
    a sidecar never starts its peer tier without a secret)."""
    path = Path(workdir) / "fleet-peer-secret"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(os.urandom(32).hex())
        tmp.replace(path)
    return str(path)


@dataclass(frozen=True)
class FleetTls:
    """The fleet's control TLS: its own CA (as the operator's would be) and one serving
    certificate for `server_name`, the name every sidecar of the fleet presents."""

    ca_file: Path
    cert_file: Path
    key_file: Path
    server_name: str

    @property
    def ca_pem(self) -> bytes:
        return self.ca_file.read_bytes()

    def config(self) -> dict:
        return {"cert_file": str(self.cert_file), "key_file": str(self.key_file)}


# Long enough for any test or demo run; the operator's certificates are the short ones.
FLEET_CERT_LIFETIME = dt.timedelta(days=2)


def fleet_tls(workdir: Path) -> FleetTls:
    """The control TLS of the fleet in `workdir` (made once, shared by its sidecars)."""
    workdir = Path(workdir)
    name = control_tls.server_name(fleet_namespace(workdir), "fleet")
    tls = FleetTls(workdir / "fleet-ca.crt", workdir / "fleet-tls.crt", workdir / "fleet-tls.key", name)
    if not tls.key_file.exists():
        now = dt.datetime.now(dt.timezone.utc)
        ca = control_ca.new_ca(now)
        pair, _ = control_ca.issue(ca, (name, control_tls.SCRAPE_SERVER_NAME), now, FLEET_CERT_LIFETIME)
        for path, content in ((tls.ca_file, ca.cert_pem), (tls.cert_file, pair.cert_pem), (tls.key_file, pair.key_pem)):
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(content)
            tmp.replace(path)  # the key last: its presence says the set is whole
    return tls


def sidecar_config(name: str, ip: str, workdir: Path, oracle, redis_url: str | None = None,
                   secret_file: str | None = None, **overrides) -> dict:
    """A loopback sidecar's config; without `secret_file` (and with the peer tier on) the
    fleet's shared secret."""
    if secret_file is None and overrides.get("peer_enabled", True):
        secret_file = fleet_secret(workdir)
    config = {
        "pod_name": name, "pod_namespace": fleet_namespace(workdir), "pod_ip": ip,
        "http_port": 0, "peer_port": 0, "engine_socket": str(workdir / f"{name}.sock"),
        "model": dict(oracle.shape), "block_size": oracle.block_size,
        "dram_capacity_bytes": 64 << 20, "redis_url": redis_url, "peer_secret_file": secret_file,
        "peer_timeout_s": 1.0, "log_level": "WARNING",
        # Loopback fleets have no API server to review tokens: the control API is open
        # (and still served over TLS, with the fleet's CA).
        "control_auth": {"mode": "open"},
        "control_tls": fleet_tls(workdir).config(),
    }
    config.update(overrides)
    return config


def start_sidecars(n: int, workdir: Path, oracle, redis_url: str | None, secret_file: str | None = None,
                   first_ip: int = 2, **overrides) -> list[SidecarHandle]:
    handles = []
    try:
        for i in range(n):
            ip = f"127.0.0.{first_ip + i}"
            name = f"sidecar-{i}"
            h = SidecarHandle(name, ip, workdir, sidecar_config(name, ip, workdir, oracle, redis_url, secret_file, **overrides))
            handles.append(h.start())
    except BaseException:
        for h in handles:
            h.kill()
        raise
    return handles


def _replay_entry(args: tuple) -> ReplayStats:
    socket_path, requests, oracle_kind, block_size, deadline_s, stop_file = args
    return replay(socket_path, requests, oracle_kind, block_size, deadline_s=deadline_s, stop_file=stop_file)


def run_engines(assignments: list[tuple[str, list[Request]]], oracle_kind: str, block_size: int = 16,
                duration_s: float | None = None, stop_file: str | None = None) -> list[ReplayStats]:
    """One engine process per (socket, requests); returns each one's ReplayStats.
    Engines loop until `duration_s` has passed or `stop_file` exists, whichever
    comes first (with neither, they replay their requests once)."""
    ctx = multiprocessing.get_context("spawn")
    # One BLAS thread per engine: several engines on a few cores otherwise oversubscribe.
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    with ctx.Pool(len(assignments)) as pool:
        deadline = None
        jobs = []
        for socket_path, reqs in assignments:
            if duration_s is not None:
                # Monotonic clocks are per boot, shared by processes: one deadline for all.
                deadline = time.monotonic() + duration_s
            jobs.append(pool.apply_async(_replay_entry, ((socket_path, reqs, oracle_kind, block_size, deadline,
                                                               stop_file),)))
        return [j.get() for j in jobs]


def split_requests(requests: list[Request], n: int, seed: int = 0) -> list[list[Request]]:
    """Random routing: each request goes to any replica (the worst case for locality)."""
    rng = random.Random(seed)
    parts: list[list[Request]] = [[] for _ in range(n)]
    for r in requests:
        parts[rng.randrange(n)].append(r)
    return parts


def run_fleet(sidecars: int = 3, engines_per_sidecar: int = 1, tenants: int = 6, templates: int = 3,
              requests: int = 240, oracle: str = "reference", seed: int = 0, workdir: str | None = None) -> dict:
    """Start Redis + `sidecars` sidecars on loopback, replay a workload through them,
    and report per-tier hit rates and bytes moved. Everything is torn down after."""
    from kvtier_testenv.redis_fixtures import RedisServer

    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="kvtier-fleet-") as tmp:
            return run_fleet(sidecars, engines_per_sidecar, tenants, templates, requests, oracle, seed, tmp)
    ork = make_oracle(oracle)
    tmp = Path(workdir)
    tmp.mkdir(parents=True, exist_ok=True)
    secret = tmp / "peer-secret"
    secret.write_text(os.urandom(16).hex())
    with RedisServer() as redis:
        handles = start_sidecars(sidecars, tmp, ork, redis.url, str(secret))
        try:
            work = make_workload(tenants, templates, requests, seed=seed, vocab=ork.vocab)
            parts = split_requests(work, sidecars * engines_per_sidecar, seed)
            assignments = [(handles[i % sidecars].socket, part) for i, part in enumerate(parts)]
            t0 = time.monotonic()
            results = run_engines(assignments, oracle, ork.block_size)
            elapsed = time.monotonic() - t0
            per_sidecar = [h.stats() for h in handles]
        finally:
            for h in handles:
                h.stop()
    total = ReplayStats()
    for r in results:
        total.merge(r)
    return fleet_report(total, per_sidecar, ork.block_bytes, elapsed)


def fleet_report(total: ReplayStats, per_sidecar: list[dict], block_bytes: int, elapsed_s: float) -> dict:
    req = max(1, total.requests)
    tokens = max(1, total.prompt_tokens)
    tiers = {}
    for tier in sorted(set(total.hits) | {"dram", "peer"}):
        tiers[tier] = {"hit_rate": total.hits.get(tier, 0) / req,
                       "token_hit_rate": total.hit_tokens.get(tier, 0) / tokens,
                       "hits": total.hits.get(tier, 0)}
    return {
        "requests": total.requests,
        "hit_rate": sum(total.hits.values()) / req,
        "token_hit_rate": sum(total.hit_tokens.values()) / tokens,
        "tiers": tiers,
        "bytes_materialized": total.bytes_materialized,
        "bytes_from_peers": sum(s["peer_bytes_fetched"] for s in per_sidecar),
        "stores": total.stores,
        "wrong_kv": total.wrong_kv,
        "errors": total.errors,
        "error_samples": total.error_samples,
        "block_bytes": block_bytes,
        "elapsed_s": elapsed_s,
    }


if __name__ == "__main__":
    print(json.dumps(run_fleet(), indent=2))
