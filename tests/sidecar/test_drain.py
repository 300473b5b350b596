"""Graceful leave: after SIGTERM a sidecar drains — not ready, still serving peers and
its engine — until the operator says it may go, it sits idle, or its timeout passes."""
import json
import signal
import subprocess
import time

import numpy as np

from kvtier_sidecar.client import EngineHit, SidecarClient
from .test_sidecar_process import BB, poll, prompt, seed_cache


# Far longer than any drain here takes: a sidecar that exits well before it ended its
# drain for the reason under test, not for the timeout.
DRAIN_TIMEOUT_S = 60
DRAIN_IDLE_S = 0.5


def _exit_code_within(handle, timeout_s: float) -> int | None:
    try:
        return handle.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None


def test_sigterm_drains_not_ready_yet_serves_warm_ups_and_engine_until_drain_done(spawn, oracle, secret_file):
    leaver = spawn("leaver", "127.0.0.2", None, secret_file, drain_timeout_s=DRAIN_TIMEOUT_S, drain_idle_s=60)
    heir = spawn("heir", "127.0.0.3", None, secret_file)
    client = SidecarClient(leaver.socket)
    root, tokens = oracle.root("moved"), prompt(100, seed=3)
    seed_cache(client, oracle, "moved", tokens)
    assert leaver.get("/readyz")[0] == 200 and leaver.stats()["draining"] is False

    leaver.proc.send_signal(signal.SIGTERM)
    poll(lambda: leaver.get("/readyz")[0] == 503)
    assert leaver.stats()["draining"] is True and leaver.proc.poll() is None
    # The engine still hits while draining.
    hit = client.lookup(root, tokens)
    assert isinstance(hit, EngineHit) and hit.matched_tokens == 96
    client.release(hit)
    # A peer warms the leaver's tenant from it, byte-exact.
    status, body = heir.post("/cache/warm", {"tenant": "moved", "from_peer": leaver.peer, "max_bytes": 1 << 20})
    assert status == 202, body
    job = json.loads(body)["job"]
    done = poll(lambda: (j := json.loads(heir.get("/cache/jobs")[1])[job])["state"] != "running" and j)
    assert done["state"] == "done" and done["bytes"] == 6 * BB
    heir_client = SidecarClient(heir.socket)
    warmed = heir_client.lookup(root, tokens)
    assert isinstance(warmed, EngineHit) and warmed.matched_tokens == 96
    dst = np.zeros(6 * BB, np.uint8)
    heir_client.materialize(warmed, dst)
    assert np.array_equal(dst, oracle.kv(root, tokens)[: 6 * BB])

    client.close()
    status, _ = leaver.post("/cache/drain/done", {})
    assert status == 202
    assert _exit_code_within(leaver, DRAIN_TIMEOUT_S / 2) == 0  # released, not timed out


def test_drain_done_on_a_sidecar_that_is_not_draining_is_refused_with_409(spawn):
    side = spawn()
    status, body = side.post("/cache/drain/done", {})
    assert status == 409 and b"not draining" in body
    assert side.get("/readyz")[0] == 200


def test_draining_sidecar_nobody_talks_to_exits_after_the_idle_window(spawn, secret_file):
    side = spawn("idle", "127.0.0.4", None, secret_file, drain_timeout_s=DRAIN_TIMEOUT_S, drain_idle_s=DRAIN_IDLE_S)
    started = time.monotonic()
    side.proc.send_signal(signal.SIGTERM)
    assert _exit_code_within(side, DRAIN_TIMEOUT_S / 2) == 0  # idle, not timed out
    # It waited its idle window (the idle clock may start a moment before the signal).
    assert time.monotonic() - started >= 0.8 * DRAIN_IDLE_S


def test_second_signal_ends_the_drain_at_once(spawn, secret_file):
    side = spawn("twice", "127.0.0.5", None, secret_file, drain_timeout_s=DRAIN_TIMEOUT_S, drain_idle_s=60)
    side.proc.send_signal(signal.SIGTERM)
    poll(lambda: side.get("/readyz")[0] == 503)
    side.proc.send_signal(signal.SIGTERM)
    assert _exit_code_within(side, DRAIN_TIMEOUT_S / 2) == 0  # the second signal, not the timeout
