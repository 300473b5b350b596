"""Sidecar test helpers: a workdir per test, sidecar processes that are always reaped."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier_testenv.fleet import SidecarHandle, sidecar_config
from kvtier_testenv.workload import SyntheticOracle


@pytest.fixture()
def oracle() -> SyntheticOracle:
    return SyntheticOracle()


@pytest.fixture()
def secret_file(tmp_path: Path) -> str:
    path = tmp_path / "peer-secret"
    path.write_text(os.urandom(16).hex())
    return str(path)


@pytest.fixture()
def spawn(tmp_path: Path, oracle):
    """spawn(name, ip, **config) -> started SidecarHandle; all are SIGKILLed at teardown."""
    handles: list[SidecarHandle] = []

    def start(name: str = "sc", ip: str = "127.0.0.2", redis_url: str | None = None,
              secret: str | None = None, **overrides) -> SidecarHandle:
        cfg = sidecar_config(name, ip, tmp_path, oracle, redis_url, secret, **overrides)
        h = SidecarHandle(name, ip, tmp_path, cfg)
        handles.append(h)
        return h.start()

    yield start
    for h in handles:
        h.kill()
