"""Sidecar processes for the connector's tests, reaped at teardown (as in tests/sidecar)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvtier_testenv.fleet import SidecarHandle, sidecar_config
from kvtier_testenv.workload import SyntheticOracle


@pytest.fixture()
def oracle() -> SyntheticOracle:
    return SyntheticOracle()


@pytest.fixture()
def spawn(tmp_path: Path, oracle):
    """spawn(name, ip="127.0.0.2", **config) -> a started SidecarHandle."""
    handles: list[SidecarHandle] = []

    def start(name: str = "sc", ip: str = "127.0.0.2", **overrides) -> SidecarHandle:
        h = SidecarHandle(name, ip, tmp_path, sidecar_config(name, ip, tmp_path, oracle, **overrides))
        handles.append(h)
        return h.start()

    yield start
    for h in handles:
        h.kill()
