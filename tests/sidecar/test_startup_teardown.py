"""A sidecar that cannot finish starting releases what it already took: the shared-
memory arena and the engine socket are gone once the process has exited."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvtier.sidecar_config import from_mapping
from kvtier_testenv.fleet import SidecarHandle, sidecar_config

SHM_DIR = Path("/dev/shm")


def test_a_start_that_fails_half_way_unlinks_the_arena(tmp_path, oracle, secret_file):
    with socket.socket() as taken:  # the HTTP port is busy: the last listener fails to bind
        taken.bind(("127.0.0.2", 0))
        taken.listen()
        busy_port = taken.getsockname()[1]
        cfg = sidecar_config("half", "127.0.0.2", tmp_path, oracle, None, secret_file, http_port=busy_port)
        arena = SHM_DIR / from_mapping(cfg).shm_name
        handle = SidecarHandle("half", "127.0.0.2", tmp_path, cfg)
        with pytest.raises(RuntimeError, match="exited with 1"):
            handle.start()
    assert "cannot start" in handle.log_tail()
    assert not arena.exists(), "the arena outlived a failed start"
    assert not Path(cfg["engine_socket"]).exists(), "the engine socket outlived a failed start"
