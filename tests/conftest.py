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
from pathlib import Path

import pytest

_SHM = Path("/dev/shm")


@pytest.fixture(autouse=True, scope="session")
def _unlink_arenas_left_by_killed_sidecars():
    """Tests SIGKILL sidecars on purpose, and a killed sidecar never unlinks its
    shared-memory arena: without this, every run would leave its arenas in /dev/shm
    (memory-backed) until the machine runs out. Only segments this session created go."""
    before = {p.name for p in _SHM.glob("kvt-*")}
    yield
    for p in _SHM.glob("kvt-*"):
        if p.name not in before:
            try:
                os.unlink(p)
            except OSError:
                pass
