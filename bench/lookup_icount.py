"""Instructions per engine lookup vs per bare Unix-socket round trip, both sides counted.

    python -m bench.lookup_icount [N]

Wall time on a shared 2-core machine moves with whatever else runs; instruction counts
do not. Each side of each comparison runs as its own process under
`valgrind --tool=callgrind` with instrumentation off (`--instr-atstart=no`) until the
warm-up is done:

- lookup: a real sidecar (the engine socket, the DRAM tier, its metrics) and an engine
  process calling `SidecarClient.lookup` for a cached 200-token prompt;
- bare: the asyncio echo process of `bench_sidecar` (the same transport and framing,
  no work behind it) and a client doing `sendall` + `recv_exact` of the lookup's exact
  request and answer sizes.

Both processes of a side are switched on together (`callgrind_control -i on`), run N
requests, and are switched off before anything else happens; the instructions each
process executed in that window, summed and divided by N, are the per-request figure.
The client of the lookup side does no RELEASE in the window (it releases afterwards),
so the figure is the lookup alone, as the wall-time figure is.

A server's timers run per second, not per request (the sidecar's config watch, ticket
sweep, index heartbeat and late-frame sweep; the echo has none), and under callgrind
the window lasts a hundred times longer than the requests do natively, so the same
timers would count more per request the slower (or busier) the machine. Each server
is therefore first counted idle for IDLE_S (switched on, then `callgrind_control -d`
writes that count to a file of its own and starts again from zero); its idle rate
times the request window's length is taken out of its window's count. Both sides are
measured this way; both numbers are reported.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

READY_TIMEOUT_S = 300.0  # a sidecar's imports under valgrind, on a busy 2-core machine
STEP_TIMEOUT_S = 600.0
# How long each server is counted idle before its requests (its timers' rate).
IDLE_S = 5.0

# The engine side, driven over stdin: "go N" runs N requests, answered "done"; "after 0"
# releases what they pinned (outside the counted window), answered "done".
_CLIENT = r"""
import json, socket, sys
import numpy as np
mode, path = sys.argv[1], sys.argv[2]
tokens = np.random.default_rng(0).integers(0, 30_000, int(sys.argv[3])).astype(np.uint32)
if mode == "lookup":
    from kvtier.keys import KeyRoot
    from kvtier_sidecar.client import SidecarClient
    root = KeyRoot.from_wire(json.loads(sys.argv[4]))
    client = SidecarClient(path)
    def run(n):
        hits = [client.lookup(root, tokens) for _ in range(n)]
        assert all(hits), "the bench prompt missed"
        return hits
    def after(hits):
        for h in hits:
            client.release(h)
else:
    from kvtier_sidecar.sockio import recv_exact
    frame, reply_bytes = bytes.fromhex(sys.argv[4]), int(sys.argv[5])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    def run(n):
        for _ in range(n):
            sock.sendall(frame)
            recv_exact(sock, reply_bytes)
    def after(_):
        pass
print("ready", flush=True)
pending = []
for line in sys.stdin:
    cmd, n = line.split()
    if cmd == "go":
        pending.append(run(int(n)))
    else:
        while pending:
            after(pending.pop())
    print("done", flush=True)
"""


@dataclass
class Counted:
    """Instructions per request of one side: engine process + server process (its
    idle timers' share of the window taken out, see `Window`)."""

    client: float
    server: float
    window: "Window | None" = None

    def server_counted(self, n: int) -> float:
        """Per request, the idle timers' share left in."""
        return self.window.server_instructions() / n if self.window else self.server

    @property
    def total(self) -> float:
        return self.client + self.server


def available() -> bool:
    return shutil.which("valgrind") is not None and shutil.which("callgrind_control") is not None


def _python() -> str:
    """The venv's interpreter (a link to the binary itself: valgrind follows no shim's exec)."""
    return sys.executable


def callgrind_argv(out: Path) -> list[str]:
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]


def _toggle(pids: list[int], state: str) -> None:
    for pid in pids:
        subprocess.run(["callgrind_control", "-i", state, str(pid)], check=True, capture_output=True,
                       timeout=STEP_TIMEOUT_S)


def instructions(out: Path) -> int:
    """Total instructions (Ir) callgrind recorded in `out` (written when its process exits)."""
    # "totals:", not "summary:": a run whose instrumentation was switched off before
    # its exit dump summarises 0 there, its totals are what was collected.
    found = re.findall(r"^totals:\s+(\d+)", out.read_text(), re.M)
    if not found:
        raise RuntimeError(f"no instruction total in {out}")
    return int(found[-1])


class _Engine:
    """The engine-side process under callgrind, one command at a time."""

    def __init__(self, argv: list[str], out: Path, env: dict) -> None:
        self.out = out
        self.proc = subprocess.Popen(callgrind_argv(out) + argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env, text=True)
        self._expect("ready")

    def _expect(self, word: str) -> None:
        line = self.proc.stdout.readline().strip()
        if line != word:
            raise RuntimeError(f"engine process said {line!r}, expected {word!r} (exit {self.proc.poll()})")

    def run(self, n: int) -> None:
        self._command(f"go {n}")

    def release(self) -> None:
        """Release what the runs so far pinned (the lookup side's RELEASEs)."""
        self._command("after 0")

    def _command(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        self._expect("done")

    def finish(self) -> int:
        self.proc.stdin.close()
        self.proc.wait(STEP_TIMEOUT_S)
        return instructions(self.out)


@dataclass
class Window:
    """What the server process executed while the engine ran its counted requests,
    and the part of it that was the server's own timers (what it executes idle)."""

    server_out: Path
    idle_instructions: int
    idle_s: float
    window_s: float

    counted: int | None = None  # read from server_out once the server has exited

    def server_instructions(self) -> int:
        if self.counted is None:
            self.counted = instructions(self.server_out)
        return self.counted

    def idle_share(self) -> float:
        """The server's idle rate over the request window: its timers' work (a sidecar's
        config watch, ticket sweep, index heartbeat, late-frame sweep), which runs per
        second, not per request, and which callgrind's slowdown stretches over a
        window a hundred times longer than the requests take natively."""
        return self.idle_instructions / self.idle_s * self.window_s

    def per_request(self, n: int) -> float:
        return max(0.0, self.server_instructions() - self.idle_share()) / n


def _dump(pid: int) -> None:
    """Write the server's counts so far into its next dump file and zero them."""
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True, timeout=STEP_TIMEOUT_S)


def _dump_instructions(out: Path) -> int:
    """Instructions in the first dump callgrind_control wrote next to `out`."""
    dumps = sorted(out.parent.glob(out.name + ".*"))
    if not dumps:
        raise RuntimeError(f"no callgrind dump next to {out}")
    return instructions(dumps[0])


def _measure(engine: _Engine, server_pid: int, server_out: Path, warmup: int, n: int) -> tuple[int, Window]:
    """Run `warmup` uncounted, then count the server idle for IDLE_S, then `n` counted
    requests; (the engine's instructions, the server's window)."""
    engine.run(warmup)
    engine.release()
    _toggle([server_pid], "on")
    t0 = time.monotonic()
    time.sleep(IDLE_S)
    _dump(server_pid)  # the idle window, in its own file; the counts start again from zero
    t1 = time.monotonic()
    _toggle([engine.proc.pid], "on")
    engine.run(n)
    _toggle([server_pid, engine.proc.pid], "off")
    t2 = time.monotonic()
    engine.release()  # not counted: the figure is the lookup alone, as the wall-time one is
    return engine.finish(), Window(server_out, _dump_instructions(server_out), t1 - t0, t2 - t1)


def lookup_vs_bare(n: int = 2000, warmup: int = 300, prompt_tokens: int = 201) -> tuple[Counted, Counted]:
    """(lookup, bare): instructions per request, each side's two processes counted alike."""
    import numpy as np

    from kvtier_sidecar.client import SidecarClient
    from kvtier_testenv.fleet import sidecar_config
    from kvtier_testenv.redis_fixtures import RedisServer

    from bench import bench_sidecar as bs

    work = Path(tempfile.mkdtemp(prefix="kvtier-icount-"))
    (work / "secret").write_bytes(bs.BENCH_SECRET)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    tokens = np.random.default_rng(0).integers(0, 30_000, prompt_tokens).astype(np.uint32)
    kv = np.random.default_rng(1).integers(0, 256, (prompt_tokens // 16) * bs.BLOCK_BYTES, dtype=np.uint8)
    root = bs._root()
    root_arg = json.dumps(root.to_wire())
    with RedisServer() as redis_server:
        cfg = sidecar_config("icount", "127.0.0.3", work, bs._Oracle, redis_server.url, str(work / "secret"),
                             dram_capacity_bytes=64 * bs.BLOCK_BYTES, peer_timeout_s=30.0)
        sc = _callgrind_sidecar_class()("icount", "127.0.0.3", work, cfg, out=work / "sidecar.cg")
        sc.start(READY_TIMEOUT_S)
        try:
            seeder = SidecarClient(sc.socket, timeout_s=60.0)
            bs._seed(seeder, tokens, kv)
            frame, reply_bytes = bs._lookup_sizes(sc.socket, root, tokens)
            seeder.close()
            engine = _Engine([_python(), "-c", _CLIENT, "lookup", sc.socket, str(prompt_tokens), root_arg],
                             work / "engine.cg", env)
            engine_ir, window = _measure(engine, sc.proc.pid, sc.out, warmup, n)
        finally:
            sc.stop(60.0)
        lookup = Counted(engine_ir / n, window.per_request(n), window)

    echo_path = str(work / "echo.sock")
    echo = subprocess.Popen(callgrind_argv(work / "echo.cg") + [_python(), "-c", bs._ECHO, echo_path, str(reply_bytes)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    try:
        if echo.stdout.readline().strip() != b"ready":
            raise RuntimeError("echo process did not start")
        engine = _Engine([_python(), "-c", _CLIENT, "bare", echo_path, str(prompt_tokens), frame.hex(),
                          str(reply_bytes)], work / "bare.cg", env)
        engine_ir, echo_window = _measure(engine, echo.pid, work / "echo.cg", warmup, n)
    finally:
        echo.terminate()
        echo.wait(60)
    bare = Counted(engine_ir / n, echo_window.per_request(n), echo_window)
    if min(lookup.client, lookup.server, bare.client, bare.server) <= 0:
        raise RuntimeError(f"a process counted no instructions (lookup {lookup}, bare {bare}): "
                           f"callgrind outputs kept in {work}")
    if os.environ.get("KVTIER_ICOUNT_KEEP"):  # for callgrind_annotate
        print(f"callgrind outputs kept in {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return lookup, bare


def _callgrind_sidecar_class():
    from kvtier_testenv.fleet import SidecarHandle

    class CallgrindSidecar(SidecarHandle):
        """A sidecar process started under callgrind (instrumentation off until toggled)."""

        def __init__(self, *args, out: Path, **kw) -> None:
            super().__init__(*args, **kw)
            self.out = out

        def start(self, timeout_s: float = READY_TIMEOUT_S) -> "CallgrindSidecar":
            self.write_config()
            self.ready_path.unlink(missing_ok=True)
            log = open(self.workdir / f"{self.name}.log", "ab")
            self.proc = subprocess.Popen(callgrind_argv(self.out) + [
                _python(), "-m", "kvtier_sidecar", "--config", str(self.config_path),
                "--ready-file", str(self.ready_path)], stdout=log, stderr=log,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
            log.close()
            deadline = time.monotonic() + timeout_s
            while not self.ready_path.exists():  # polled with a deadline, as SidecarHandle does
                if self.proc.poll() is not None:
                    raise RuntimeError(f"sidecar exited with {self.proc.returncode}:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sidecar not ready in {timeout_s}s:\n{self.log_tail()}")
                time.sleep(0.1)
            import json

            self.ready = json.loads(self.ready_path.read_text())
            return self

    return CallgrindSidecar


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    n = int(args[0]) if args else 2000
    lookup, bare = lookup_vs_bare(n)
    print(f"lookup: {lookup.total:,.0f} instructions/request (engine {lookup.client:,.0f}, sidecar {lookup.server:,.0f}; "
          f"{lookup.server_counted(n):,.0f} counted, timers' idle rate taken out)")
    print(f"bare:   {bare.total:,.0f} instructions/request (client {bare.client:,.0f}, echo {bare.server:,.0f}; "
          f"{bare.server_counted(n):,.0f} counted)")
    print(f"ratio:  {lookup.total / bare.total:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
