"""`kvtier-sidecar`: assemble the tiers and the listeners, serve until SIGTERM.

    kvtier-sidecar --config /etc/kvtier/sidecar.yaml [--ready-file PATH]

Start-up order: arena -> DRAM tier -> peer server -> global index -> engine socket ->
HTTP. `--ready-file` receives a JSON object with the bound addresses once everything
listens (tests and the fleet use port 0 and read it). SIGTERM/SIGINT: drain first —
`/readyz` fails (the pod drops out of membership) while the engine socket and the peer
server keep serving, so the operator can warm this pod's tenants on their new homes
from it — until `POST /cache/drain/done`, `drain_timeout_s`, `drain_idle_s` without a
peer connection, or a second signal; then stop taking requests, deregister from the
global index, unlink the socket and the arena.
The HTTP control port serves HTTPS with `control_tls.cert_file`/`key_file` (re-read
when either file changes), or plain HTTP only when `control_tls.plain_http` says so.
Exit status 2 names the bad flag or config field (a missing or unusable certificate too).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path

from aiohttp import web
from pydantic import ValidationError

from kvtier import control_tls
from kvtier import sidecar_config as cfgmod
from kvtier.sidecar_config import PeerSecretError, SidecarConfig

from . import identity_lock, logs
from .arena import Arena, ArenaError
from .control_auth import TokenReviewer
from .counters import Count
from .dram import DramTier
from .engine_server import EngineServer
from .global_index import GlobalIndex
from .http_api import make_app
from .nvme_probe import NvmeProbe
from .peer_keys import PeerKeyring, SecretFileWatch
from .peer_tcp import PeerServer, TcpTransport
from .service import Sidecar

log = logging.getLogger("kvtier.sidecar")

CONFIG_POLL_S = 1.0
TICKET_SWEEP_S = 1.0
# How often a draining sidecar checks whether it may go (small against drain_idle_s).
DRAIN_POLL_S = 0.1


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier-sidecar", description="kvtier per-pod cache sidecar")
    p.add_argument("--config", help="YAML/JSON config file (see kvtier.sidecar_config); default: built-in defaults")
    p.add_argument("--ready-file", help="write the bound addresses here as JSON once serving")
    return p.parse_args(argv)


def hello_for(config: SidecarConfig, arena: Arena) -> dict:
    m = config.model
    return {"shm_name": arena.name, "arena_tag": arena.tag.hex(), "arena_bytes": arena.size,
            "block_bytes": arena.block_bytes,
            "block_size": config.block_size, "slots": arena.slots, "dtype": f"u{m.dtype_bytes}",
            "block_shape": [m.layers, m.kv_planes, m.kv_heads, config.block_size, m.head_dim], "kv_heads": m.kv_heads,
            "weights_version": m.weights_version}


# A restarted sidecar's predecessor's arena holds the pod's memory-backed volume until its
# engine notices the predecessor is gone and unmaps it (at its next request): wait that
# long for the space before failing.
ARENA_SPACE_WAIT_S = 30.0
ARENA_SPACE_POLL_S = 0.25


async def create_arena(name: str, slots: int, block_bytes: int, wait_s: float = ARENA_SPACE_WAIT_S) -> Arena:
    """`Arena.create`, waiting up to `wait_s` while the volume is full (ENOSPC)."""
    deadline = time.monotonic() + wait_s
    logged = False
    while True:
        try:
            return Arena.create(name, slots, block_bytes)
        except ArenaError as exc:
            if not (isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.ENOSPC) \
                    or time.monotonic() >= deadline:
                raise
            if not logged:
                logged = True
                log.warning("arena %s: no room yet (%s); waiting up to %.0fs for the engine to release the "
                            "previous sidecar's arena", name, exc.__cause__, wait_s)
        await asyncio.sleep(ARENA_SPACE_POLL_S)


class SidecarProcess:
    def __init__(self, config: SidecarConfig, config_path: str | None) -> None:
        self.config = config
        self.config_path = config_path
        self._config_stamp = self._stamp()
        self._stop = asyncio.Event()
        self._force = asyncio.Event()  # a second signal: skip (the rest of) the drain

    def _stamp(self) -> tuple | None:
        if not self.config_path:
            return None
        try:
            st = os.stat(self.config_path)
            return (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            return None

    async def run(self, ready_file: str | None) -> None:
        """Serve until a signal, then drain and tear down. Every resource is registered
        for teardown as soon as it exists, so a failure half-way through start-up (a
        port in use, Redis misconfigured) still releases what was already taken —
        the arena above all — in reverse order."""
        async with contextlib.AsyncExitStack() as stack:
            await self._start(stack, ready_file)
            await self._stop.wait()
            await self._drain()
            log.info("sidecar shutting down")

    async def _start(self, stack: contextlib.AsyncExitStack, ready_file: str | None) -> None:
        c = self.config
        stack.callback(identity_lock.claim(c.shm_name, f"{c.pod_namespace}/{c.pod_name}").release)
        self.arena = await create_arena(c.shm_name, c.slots, c.block_bytes)
        stack.callback(self.arena.close)
        tier = DramTier(self.arena, c.block_size, c.min_sightings, c.model.kv_heads, c.thrash_ratio,
                        token_row_bytes=c.model.head_dim * c.model.dtype_bytes)
        # Peer tier off: no listener, no fetches, no warm-ups, and so no global index
        # (it only ever names peers to fetch from).
        self.peer_server = self.index = self.transport = None
        advertise = ""
        self.secret_watch = None
        if c.peer_enabled:
            self.keyring = PeerKeyring(c.peer_secret(), c.peer_secret_overlap_s)  # checked in main()
            self.secret_watch = SecretFileWatch(c.peer_secret_file, self.keyring)
            self.peer_server = PeerServer(tier, c.pod_ip, c.peer_port, self.keyring, c.peer_max_concurrency,
                                          c.peer_timeout_s)
            advertise = c.peer_advertise or self.peer_server.address
            self.peer_server.endpoint = advertise
            self.peer_server.start()
            stack.callback(self.peer_server.close)
            if c.redis_url:
                self.index = GlobalIndex(c.redis_url, advertise, c.index_key_prefix, c.index_ttl_s,
                                         c.index_lookup_timeout_s, c.redis_cluster)
                stack.push_async_callback(self._leave_index, self.index)
            self.transport = TcpTransport(self.keyring, c.peer_connect_timeout_s, c.peer_timeout_s, identity=advertise)
        self.service = Sidecar(c, tier, self.index, self.transport, instance=uuid.uuid4().hex)
        if self.peer_server is not None:
            self.peer_server.events = self.service.counters
        stack.callback(self.service.close)
        self.service.bind_loop(asyncio.get_running_loop())
        self.auth = TokenReviewer(c.control_auth, self.service.counters) if c.control_auth.mode == "tokenreview" else None
        if self.auth is None:
            log.warning("control API open: no token is checked (control_auth.mode=open)")
        else:
            stack.push_async_callback(self.auth.close)
        runner = web.AppRunner(make_app(self.service, self.auth, c.control_auth.protect_metrics),
                               access_log=None, handle_signals=False)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        socket_path = c.engine_socket_path()
        engine = EngineServer(self.service, socket_path, hello_for(c, self.arena))
        await engine.start()
        stack.push_async_callback(engine.close)  # the first to stop: no new engine requests
        site = web.TCPSite(runner, c.pod_ip, c.http_port, ssl_context=self._control_tls(c.control_tls))
        await site.start()
        http_port = runner.addresses[0][1]
        background = [asyncio.create_task(self._watch_config()), asyncio.create_task(self._sweep())]
        if self.index is not None:
            background.append(asyncio.create_task(self.index.run()))
        self._nvme_task: asyncio.Task | None = None
        stack.push_async_callback(self._cancel, background)
        stack.push_async_callback(lambda: self._cancel([self._nvme_task] if self._nvme_task else []))
        self._start_nvme_probe(c.nvme)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        ready = {"pid": os.getpid(), "http": f"{c.pod_ip}:{http_port}", "peer": advertise,
                 "peer_bound": self.peer_server.address if self.peer_server else "", "engine_socket": socket_path,
                 "shm_name": self.arena.name,
                 "instance": self.service.instance}
        if ready_file:
            tmp = Path(ready_file + ".tmp")
            tmp.write_text(json.dumps(ready))
            tmp.replace(ready_file)
        log.info("sidecar serving", extra=ready)

    def _control_tls(self, tls: cfgmod.ControlTlsConfig):
        """The control port's TLS context (None: plain HTTP, chosen explicitly). The
        certificate files are watched: a renewed pair is loaded for new handshakes."""
        self.tls_watch = None
        if not tls.enabled:
            log.warning("CONTROL API WITHOUT TLS: control_tls.plain_http is set, so requests, bearer tokens "
                        "and answers cross the network in the clear; use it on loopback only")
            return None
        ctx = control_tls.server_context(tls.cert_file, tls.key_file)
        self.tls_watch = CertFileWatch(ctx, tls.cert_file, tls.key_file)
        return ctx

    @staticmethod
    async def _cancel(tasks: list[asyncio.Task]) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    async def _leave_index(index: GlobalIndex) -> None:
        """Write what is queued, then take this sidecar's entries out of the index."""
        await index.flush()
        await index.deregister()
        await index.close()

    def _on_signal(self) -> None:
        (self._force if self._stop.is_set() else self._stop).set()

    async def _drain(self) -> None:
        """Keep serving peers while the fleet warms this pod's tenants elsewhere. Idle
        means no new peer connection (fetches and hot-prefix listings both connect) and
        no stats/jobs request (the operator reads stats before it starts warming)."""
        c = self.config
        if self.peer_server is None or c.drain_timeout_s <= 0:
            return
        self.service.start_drain()
        started = last_activity = time.monotonic()
        seen = self.peer_server.counters["connections"]
        log.info("sidecar draining", extra={"timeout_s": c.drain_timeout_s, "idle_s": c.drain_idle_s})
        why = "timeout"
        while time.monotonic() - started < self.config.drain_timeout_s:
            if self.service.drain_done.is_set() or self._force.is_set():
                why = "done" if self.service.drain_done.is_set() else "signal"
                break
            connections = self.peer_server.counters["connections"]
            if connections != seen:
                seen, last_activity = connections, time.monotonic()
            last_activity = max(last_activity, self.service.last_control_s)
            if time.monotonic() - last_activity >= self.config.drain_idle_s:
                why = "idle"
                break
            await asyncio.sleep(DRAIN_POLL_S)
        log.info("drain finished", extra={"reason": why, "drained_s": round(time.monotonic() - started, 3)})

    def _start_nvme_probe(self, nvme: cfgmod.NvmeConfig) -> None:
        """(Re)start the shadow probe for `nvme`; mode off stops it."""
        if self._nvme_task is not None:
            self._nvme_task.cancel()
            self._nvme_task = None
        self.service.nvme = None
        if not nvme.measuring:
            return
        if nvme.mode == "on":
            log.warning("nvme mode 'on': this sidecar does not serve from NVMe; measuring only (shadow)")
        self.service.nvme = NvmeProbe(nvme)
        self._nvme_task = asyncio.create_task(self.service.nvme.run())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(TICKET_SWEEP_S)
            self.service.expire_tickets()

    async def _watch_config(self) -> None:
        """Apply a changed config file without touching the cache; a bad file is
        logged and ignored (the running config stays)."""
        while True:
            await asyncio.sleep(CONFIG_POLL_S)
            if self.secret_watch is not None and self.secret_watch.poll():
                self.service.counters.add(Count.PEER_SECRET_ROTATIONS)
                log.info("peer secret rotated; the previous one stays accepted for the overlap",
                         extra={"overlap_s": self.keyring.overlap_s})
            if self.tls_watch is not None:
                self.tls_watch.poll()
            stamp = self._stamp()
            if stamp == self._config_stamp:
                continue
            self._config_stamp = stamp
            try:
                new = cfgmod.load(self.config_path)
            except (OSError, ValueError, ValidationError) as exc:
                log.warning("config reload rejected; keeping the running config", extra={"error": str(exc)})
                continue
            self.reload(new)

    def reload(self, new: SidecarConfig) -> None:
        applicable, restart = cfgmod.reload_diff(self.config, new)
        if "model" in applicable and _shape(new) != _shape(self.config):
            applicable.pop("model")
            restart.append("model (shape)")
        merged = self.config.model_copy(update=applicable)
        self.config = merged
        self.service.apply_config(merged)
        if "nvme" in applicable:
            self._start_nvme_probe(merged.nvme)
        if "log_level" in applicable:
            logs.set_level(merged.log_level)
        log.info("config reloaded", extra={"applied": sorted(applicable)})
        if restart:
            log.warning("config fields changed that only a restart applies; running with the old values",
                        extra={"needs_restart": sorted(restart)})


class CertFileWatch:
    """The control port's certificate and key files, reloaded into the serving context
    when either changes (the kubelet swaps a renewed Secret's files atomically). A pair
    that does not load is logged and the running one kept; it is tried again on the
    next change."""

    def __init__(self, ctx, cert_file: str, key_file: str) -> None:
        self.ctx, self.cert_file, self.key_file = ctx, cert_file, key_file
        self._stamp = self._read_stamp()

    def _read_stamp(self) -> tuple | None:
        try:
            return tuple((st.st_mtime_ns, st.st_size, st.st_ino) for st in map(os.stat, (self.cert_file, self.key_file)))
        except OSError:
            return None

    def poll(self) -> bool:
        """True when a changed pair was loaded."""
        stamp = self._read_stamp()
        if stamp == self._stamp or stamp is None:
            return False
        self._stamp = stamp
        try:
            # Tried on a scratch context first: a pair that fails half-way through
            # loading would leave the live one with a certificate and no key.
            control_tls.server_context(self.cert_file, self.key_file)
            control_tls.load_chain(self.ctx, self.cert_file, self.key_file)
        except control_tls.ControlTlsError as exc:
            log.warning("control TLS certificate change rejected; serving the previous one", extra={"error": str(exc)})
            return False
        log.info("control TLS certificate reloaded", extra={"cert_file": self.cert_file})
        return True


def _shape(c: SidecarConfig) -> tuple:
    m = c.model
    return (m.layers, m.kv_heads, m.head_dim, m.dtype_bytes, m.kv_planes)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = cfgmod.load(args.config)
        if config.peer_enabled:
            config.peer_secret()  # the peer tier never starts without a usable secret
        config.control_tls.require_choice()
        if config.control_tls.enabled:  # a bad pair is named before anything is taken
            control_tls.server_context(config.control_tls.cert_file, config.control_tls.key_file)
    except (PeerSecretError, control_tls.ControlTlsError) as exc:
        print(f"kvtier-sidecar: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"kvtier-sidecar: --config: {exc}", file=sys.stderr)
        return 2
    except (ValueError, ValidationError) as exc:
        print(f"kvtier-sidecar: --config {args.config}: {exc}", file=sys.stderr)
        return 2
    logs.configure(config.log_level, pod=config.pod_name, namespace=config.pod_namespace)
    try:
        asyncio.run(SidecarProcess(config, args.config).run(args.ready_file))
    except ArenaError as exc:
        log.error(str(exc))
        return 1
    except (PeerSecretError, control_tls.ControlTlsError) as exc:  # a file changed since the check above
        log.error(str(exc))
        return 2
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
