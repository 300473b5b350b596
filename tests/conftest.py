"""Shared fixtures come from the test-environment plugins, so the demo can reuse them.

- kvtier_testenv.redis_fixtures: a real redis-server on a free loopback port.
- kvtier_testenv.k8s_fixtures: a real kube-apiserver + etcd (+ controller-manager),
  the node agent, per-test namespaces, the real kubectl and helm.
- kvtier_testenv.prometheus_fixtures: a real Prometheus (discovering the test's pods
  through the apiserver, loaded with the chart's alert rules) and Alertmanager.
A test that needs one of these fails loudly when it is missing; nothing is skipped.
"""

pytest_plugins = [
    "kvtier_testenv.redis_fixtures",
    "kvtier_testenv.k8s_fixtures",
    "kvtier_testenv.prometheus_fixtures",
]


import os
import shutil
from pathlib import Path

import pytest

from kvtier import _compiled

# A source edited since the last build runs from source for the whole session, its
# child processes included (scripts/setup.sh rebuilds it; the compiled tests flag it).
_compiled.run_stale_from_source()


_SHM = Path("/dev/shm")
# What the suite's processes leave in /dev/shm when SIGKILLed, large enough to matter:
# sidecar arenas (kvt-*), torch's shared-memory segments of vLLM engines (psm_*), and
# the control plane's etcd data directories (kvtier-etcd-*).
_LEFT_BY_KILLED = ("kvt-*", "psm_*", "kvtier-etcd-*")


def _in_use() -> set[str]:
    """Names under /dev/shm some other live process has open or mapped (another
    checkout's run on the same machine keeps its own). This process's own mappings do
    not count: they are the tests' engine clients of sidecars already gone, and a
    mapping outlives the name (unlinking it frees the memory once the last one goes)."""
    used: set[str] = set()
    me = str(os.getpid())
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or proc.name == me:
            continue
        try:
            used.update(line.split("/dev/shm/", 1)[1].split("/")[0].strip()
                        for line in (proc / "maps").read_text().splitlines() if "/dev/shm/" in line)
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    used.add(target[len("/dev/shm/"):].split("/")[0])
            cwd = os.readlink(proc / "cwd")
            if cwd.startswith("/dev/shm/"):
                used.add(cwd[len("/dev/shm/"):].split("/")[0])
        except OSError:
            continue
    return used


def _shm_entries() -> set[str]:
    return {p.name for pattern in _LEFT_BY_KILLED for p in _SHM.glob(pattern)}


def _unlink_unused(names: set[str]) -> None:
    for name in names - _in_use():
        path = _SHM / name
        try:
            shutil.rmtree(path) if path.is_dir() else os.unlink(path)
        except OSError:
            pass


@pytest.fixture(scope="session")
def _shm_before_session():
    """What /dev/shm held before the session; at its end, what the session made and no
    live process uses goes (the last module's, a session fixture's)."""
    before = _shm_entries()
    yield before
    _unlink_unused(_shm_entries() - before)


@pytest.fixture(autouse=True, scope="module")
def _unlink_shared_memory_left_by_killed_processes(_shm_before_session):
    """Tests SIGKILL sidecars and engines on purpose, and a killed process never unlinks
    its shared memory: a sidecar's arena is preallocated (64 MiB in the tests), so a
    whole suite's worth would fill /dev/shm (memory-backed) and the machine's memory
    with it. After every test module, what this session created and no live process
    still uses goes (a session-scoped fixture's processes keep theirs)."""
    yield
    _unlink_unused(_shm_entries() - _shm_before_session)
