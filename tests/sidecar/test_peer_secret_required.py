"""A sidecar never starts its peer tier without a usable secret: with the peer tier on,
a missing, unreadable, empty or short secret file stops the process at start-up with a
message saying what to fix (an empty key would accept anyone's handshake)."""
from __future__ import annotations

import pytest

from kvtier_testenv.fleet import SidecarHandle, sidecar_config


def _start(tmp_path, oracle, name: str, secret_file: str | None, **overrides) -> SidecarHandle:
    cfg = sidecar_config(name, "127.0.0.2", tmp_path, oracle, None, secret_file, **overrides)
    if secret_file is None:
        cfg["peer_secret_file"] = None  # no fleet default: the case under test
    return SidecarHandle(name, "127.0.0.2", tmp_path, cfg)


@pytest.mark.parametrize("content, said", [
    (b"", "is empty"),
    (b"\n  \n", "is empty"),
    (b"0123456789abcdef0123456789abcde", "holds 31 bytes"),
])
def test_an_empty_or_short_secret_file_stops_the_sidecar(tmp_path, oracle, content, said):
    path = tmp_path / "peer-secret"
    path.write_bytes(content)
    handle = _start(tmp_path, oracle, "weak", str(path))
    with pytest.raises(RuntimeError, match="exited with 2"):
        handle.start()
    log = handle.log_tail()
    assert said in log and "at least 32 bytes" in log and "peer_enabled: false" in log
    assert handle.ready == {}


def test_a_missing_secret_stops_the_sidecar_and_says_what_to_set(tmp_path, oracle):
    handle = _start(tmp_path, oracle, "unset", None)
    with pytest.raises(RuntimeError, match="exited with 2"):
        handle.start()
    assert "peer_secret_file is not set" in handle.log_tail()
    absent = _start(tmp_path, oracle, "absent", str(tmp_path / "no-such-file"))
    with pytest.raises(RuntimeError, match="exited with 2"):
        absent.start()
    assert "cannot be read" in absent.log_tail() and "no-such-file" in absent.log_tail()


def test_a_long_enough_secret_starts_and_a_disabled_peer_tier_needs_none(tmp_path, oracle):
    path = tmp_path / "peer-secret"
    path.write_bytes(b"0123456789abcdef0123456789abcdef\n")  # 32 bytes once the newline is dropped
    ok = _start(tmp_path, oracle, "ok", str(path)).start()
    assert ok.peer and ok.stats()["peer_enabled"] is True
    off = _start(tmp_path, oracle, "off", None, peer_enabled=False).start()
    assert off.stats()["peer_enabled"] is False and off.ready["peer"] == ""
    ok.stop(); off.stop()
