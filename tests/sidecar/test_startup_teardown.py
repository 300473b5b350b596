"""A sidecar that cannot finish starting releases what it already took: the shared-
memory arena and the engine socket are gone once the process has exited."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvtier.sidecar_config import from_mapping
from kvtier_sidecar.client import SidecarClient
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


def test_a_second_sidecar_with_a_live_ones_identity_refuses_to_start_and_leaves_it_serving(tmp_path, oracle):
    first = SidecarHandle("same", "127.0.0.2", tmp_path, sidecar_config("same", "127.0.0.2", tmp_path, oracle)).start()
    try:
        other_dir = tmp_path / "other"
        other_dir.mkdir()
        cfg = sidecar_config("same", "127.0.0.3", tmp_path, oracle, engine_socket=str(other_dir / "s.sock"))
        second = SidecarHandle("same", "127.0.0.3", other_dir, cfg)
        try:
            second.start(timeout_s=60)
        except RuntimeError as exc:
            assert "another kvtier sidecar with identity" in str(exc)
        else:
            second.kill()
            raise AssertionError("a second sidecar with the same identity started")
        # the first one still serves its engine from its own arena
        client = SidecarClient(first.socket)
        assert client.connect() and client.info["shm_name"] == first.ready["shm_name"]
    finally:
        first.kill()
    # once it is gone, the identity is free again
    again = SidecarHandle("same", "127.0.0.2", tmp_path, sidecar_config("same", "127.0.0.2", tmp_path, oracle)).start()
    again.kill()
