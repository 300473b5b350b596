"""Peer secret rotation on running sidecar processes: the mounted file changes, no
restart; peers still on the old secret keep warming from a rotated one during the
overlap, and the old secret opens nothing once it ends."""
import json
import os
from pathlib import Path

from kvtier_sidecar.client import SidecarClient

from .test_sidecar_process import poll, prompt, seed_cache

BB = 8192
# Long enough for both sidecars to see the new file (they poll it every second) while
# the old secret is still accepted; short enough to wait out in a test.
OVERLAP_S = 8.0


def swap(path: Path, secret: str) -> None:
    """Replace the file atomically, as the kubelet swaps a mounted Secret."""
    tmp = path.with_suffix(".new")
    tmp.write_text(secret)
    tmp.replace(path)


def warm(target, source, tenant: str) -> dict:
    status, body = target.post("/cache/warm", {"tenant": tenant, "from_peer": source.peer, "max_bytes": 1 << 20})
    assert status == 202, body
    job = json.loads(body)["job"]
    return poll(lambda: (j := json.loads(target.get("/cache/jobs")[1])[job])["state"] != "running" and j)


def rotations(sidecar) -> int:
    return sidecar.stats()["sidecar"].get("peer_secret_rotations", 0)


def test_rotated_secret_file_is_picked_up_without_restart_and_the_old_one_expires(spawn, oracle, tmp_path):
    old, new = os.urandom(16).hex(), os.urandom(16).hex()
    files = {n: tmp_path / f"{n}-secret" for n in ("a", "b", "stale")}
    for f in files.values():
        f.write_text(old)
    a = spawn("a", "127.0.0.2", None, str(files["a"]), peer_secret_overlap_s=OVERLAP_S)
    b = spawn("b", "127.0.0.3", None, str(files["b"]), warm_peers=[a.peer], peer_secret_overlap_s=OVERLAP_S)
    stale = spawn("stale", "127.0.0.4", None, str(files["stale"]), warm_peers=[a.peer])
    for i, tenant in enumerate(("t0", "t1", "t2")):
        seed_cache(SidecarClient(a.socket), oracle, tenant, prompt(100, seed=i))
    pid_a = a.proc.pid

    swap(files["a"], new)  # a rotates first; b still holds only the old secret
    poll(lambda: rotations(a) == 1)
    # Within the overlap a proves with both: b (old) warms from it.
    assert warm(b, a, "t0")["bytes"] == 6 * BB
    swap(files["b"], new)
    poll(lambda: rotations(b) == 1)
    assert warm(b, a, "t1")["bytes"] == 6 * BB
    # Past the overlap, a accepts only the new secret: the stale sidecar gets nothing.
    # (each attempt asks a for its hot prefixes first: that handshake is what fails)
    job = poll(lambda: (j := warm(stale, a, "t2"))["state"] == "failed" and j, timeout_s=30)
    assert "did not prove a shared peer secret" in job["error"] and job["bytes"] == 0
    assert warm(b, a, "t2")["bytes"] == 6 * BB  # the new secret still works
    assert a.proc.pid == pid_a and a.proc.poll() is None  # never restarted
