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
import time
from pathlib import Path
from typing import Any

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


def _settled(names: set[str], min_age_s: float) -> set[str]:
    """Those of `names` last changed at least `min_age_s` ago. A name just made may not
    be open yet (an etcd directory between mkdtemp and etcd's start): in a parallel run
    the other worker's processes make theirs at any moment."""
    now = time.time()
    settled = set()
    for name in names:
        try:
            if now - (_SHM / name).stat().st_mtime >= min_age_s:
                settled.add(name)
        except OSError:
            pass
    return settled


def _worker(config: pytest.Config) -> bool:
    """True in a pytest-xdist worker (the controller and plain runs have no workerinput)."""
    return hasattr(config, "workerinput")


_SETTLE_S = 60.0
_SHM_AT_START = pytest.StashKey[set]()


def _unlink_made_since_start(config: pytest.Config, settled_only: bool) -> None:
    made = _shm_entries() - config.stash[_SHM_AT_START]
    _unlink_unused(_settled(made, _SETTLE_S) if settled_only else made)


def pytest_sessionstart(session: pytest.Session) -> None:
    """What /dev/shm held before the session (each worker's and the controller's own).
    The controller (or a plain run) first unlinks what a killed earlier run left there
    (settled, no live process using it): a machine made from a snapshot of one whose
    run was killed starts with gigabytes of dead arenas in memory."""
    if not _worker(session.config):
        _unlink_unused(_settled(_shm_entries(), _SETTLE_S))
    session.config.stash[_SHM_AT_START] = _shm_entries()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """At the end, what the session made and no live process uses goes. A worker of a
    parallel run leaves what has not settled (the other worker may still be making
    its own); its controller, once every worker is done, takes the rest."""
    if _SHM_AT_START in session.config.stash:
        _unlink_made_since_start(session.config, settled_only=_worker(session.config))


@pytest.fixture(autouse=True, scope="module")
def _unlink_shared_memory_left_by_killed_processes(pytestconfig: pytest.Config):
    """Tests SIGKILL sidecars and engines on purpose, and a killed process never unlinks
    its shared memory: a sidecar's arena is preallocated (64 MiB in the tests), so a
    whole suite's worth would fill /dev/shm (memory-backed) and the machine's memory
    with it. After every test module, what this session created and no live process
    still uses goes (a session-scoped fixture's processes keep theirs; in a parallel
    run, only what has settled)."""
    yield
    _unlink_made_since_start(pytestconfig, settled_only=_worker(pytestconfig))


# --- parallel runs -------------------------------------------------------------------
# scripts/test.sh runs the suite on two pytest-xdist workers. `WorkUnits` hands out work
# units: each runs whole, in order, on one worker, and units run side by side.
NODES_UNIT = "real-nodes"
NODES_PATHS = ("tests/nodes/", "tests/helm/test_demo_cluster.py")
"""The real-node cluster: one bridge, one set of CIDRs, host sysctls and iptables
chains, so one cluster at a time (tests/nodes' module cluster, the cluster demo's own)."""
LOOPBACK_UNIT = "fixed-loopback"
LOOPBACK_PATHS = ("tests/sidecar/", "tests/vllm/", "tests/router/", "tests/test_demo_fleet.py")
"""Tests whose servers bind fixed loopback addresses (127.0.0.2, .3, ...: sidecars,
fleets, the EPP's fake pods): two of them at once would take each other's ports."""


def work_unit(nodeid: str) -> str:
    """The work unit of a test: a shared unit above, else its module (whose module
    fixtures are then made once)."""
    if nodeid.startswith(NODES_PATHS):
        return NODES_UNIT
    if nodeid.startswith(LOOPBACK_PATHS):
        return LOOPBACK_UNIT
    return nodeid.split("::", 1)[0]


def _rank(nodeid: str) -> int:
    """The long shared units first (the real nodes ~10 min, the loopback unit longer),
    so that no worker is left with one of them at the end."""
    return {NODES_UNIT: 0, LOOPBACK_UNIT: 1}.get(work_unit(nodeid), 2)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The shared units first, in a stable sort (a module keeps its order). A real-node
    test outside NODES_PATHS would run beside the cluster's own: refused here."""
    stray = [i.nodeid for i in items if not i.nodeid.startswith(NODES_PATHS)
             and ("node_cluster" in getattr(i, "fixturenames", ()) or i.get_closest_marker("nodes"))]
    if stray:
        raise pytest.UsageError(f"real-node tests outside {NODES_PATHS} (tests/conftest.py): {stray}")
    items[:] = [item for _, _, item in sorted(((_rank(i.nodeid), n, i) for n, i in enumerate(items)),
                                               key=lambda r: r[:2])]


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's scope scheduling over `work_unit`s, in collection order (the
    shared units first): a worker takes the next unit whenever it runs out."""
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return WorkUnits(config, log)
