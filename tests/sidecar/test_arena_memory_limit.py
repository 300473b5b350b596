"""The injected sidecar's memory limit (arena + headroom, `arena_memory`) holds a real
sidecar: run under a real memory cgroup (v1 `memory` controller, or v2 where that is
what the machine has) set to exactly that limit, it fills its arena, evicts, serves
lookups and stats, and is never OOM-killed; the arena's pages are charged to it. A
limit below the arena stops it at start-up instead (the control that the limit bites)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from kvtier.sidecar_config import from_mapping
from kvtier_operator.arena_memory import headroom_for_slots
from kvtier_sidecar.client import SidecarClient
from kvtier_testenv.fleet import SidecarHandle, sidecar_config

ARENA_BYTES = 64 << 20
V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")


class MemoryCgroup:
    """A fresh memory cgroup with a hard limit; v1 or v2, whichever is writable here."""

    def __init__(self, limit: int) -> None:
        name = f"kvtier-test-{uuid.uuid4().hex[:8]}"
        if (V1_ROOT / "memory.limit_in_bytes").exists():
            self.path, self.v2 = V1_ROOT / name, False
        elif "memory" in (V2_ROOT / "cgroup.controllers").read_text().split():
            self.path, self.v2 = V2_ROOT / name, True
        else:  # fail loudly: this test needs a memory cgroup
            raise RuntimeError("no writable memory cgroup (v1 /sys/fs/cgroup/memory or v2 with the memory controller)")
        self.path.mkdir()
        (self.path / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(str(limit))
        swap = self.path / ("memory.swap.max" if self.v2 else "memory.memsw.limit_in_bytes")
        if swap.exists():  # no escape into swap: the limit is on memory itself
            swap.write_text("0" if self.v2 else str(limit))

    def enter(self) -> None:  # runs in the child before exec
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        return int((self.path / name).read_text())

    def oom_kills(self) -> int:
        name = "memory.events" if self.v2 else "memory.oom_control"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            try:
                self.path.rmdir()
                return
            except OSError:
                assert time.monotonic() < deadline, f"cgroup {self.path} still busy"
                time.sleep(0.05)


def start_in(cgroup: MemoryCgroup, handle: SidecarHandle) -> subprocess.Popen:
    handle.write_config()
    handle.ready_path.unlink(missing_ok=True)
    log = open(handle.workdir / f"{handle.name}.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "kvtier_sidecar", "--config", str(handle.config_path),
                             "--ready-file", str(handle.ready_path)], stdout=log, stderr=log,
                            preexec_fn=cgroup.enter)
    log.close()
    handle.proc = proc
    return proc


def wait_ready(handle: SidecarHandle, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not handle.ready_path.exists():
        if handle.proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, "sidecar neither ready nor exited"
        time.sleep(0.02)
    handle.ready = json.loads(handle.ready_path.read_text())
    return True


@pytest.fixture
def cgroups():
    made: list[tuple[MemoryCgroup, SidecarHandle]] = []
    yield made
    for cg, handle in made:
        handle.kill()
        cg.remove()


def test_sidecar_under_its_injected_memory_limit_fills_the_arena_and_is_never_oom_killed(tmp_path, oracle, cgroups):
    handle = SidecarHandle("m", "127.0.0.2", tmp_path, sidecar_config("m", "127.0.0.2", tmp_path, oracle,
                                                                      dram_capacity_bytes=ARENA_BYTES))
    limit = ARENA_BYTES + headroom_for_slots(from_mapping(handle.config).slots)
    cg = MemoryCgroup(limit)
    cgroups.append((cg, handle))
    start_in(cg, handle)
    assert wait_ready(handle), handle.log_tail()
    client = SidecarClient(handle.socket)
    for s in range(1200):  # ~2x the arena: it fills, then evicts
        tokens = np.random.default_rng(s).integers(0, 30_000, 200).astype(np.uint32)
        root = oracle.root(f"t{s % 50}")
        kv = oracle.kv(root, tokens)
        for _ in range(2):
            client.release(client.lookup(root, tokens))
            client.store(root, tokens, kv)
        if s % 50 == 0:
            assert handle.get("/cache/stats")[0] == 200 and handle.get("/metrics")[0] == 200
    cache = handle.stats()["cache"]
    assert cache["evictions"] > 0 and cache["bytes_used"] > ARENA_BYTES * 0.8
    assert handle.proc.poll() is None and cg.oom_kills() == 0
    assert ARENA_BYTES <= cg.peak() <= limit  # the arena is charged to the sidecar's cgroup


def test_limit_below_the_arena_stops_the_sidecar_at_start_up(tmp_path, oracle, cgroups):
    handle = SidecarHandle("s", "127.0.0.2", tmp_path, sidecar_config("s", "127.0.0.2", tmp_path, oracle,
                                                                      dram_capacity_bytes=ARENA_BYTES))
    cg = MemoryCgroup(ARENA_BYTES // 2)
    cgroups.append((cg, handle))
    start_in(cg, handle)
    assert not wait_ready(handle)
    assert handle.proc.returncode != 0
