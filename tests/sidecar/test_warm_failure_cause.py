"""A warm-up that fails on a peer's socket timeout says so in its job, with the peer
and the timeout, rather than passing for the job's own deadline."""
from __future__ import annotations

import json
import socket

from kvtier_sidecar.service import WARM_JOB_DEADLINE_S

from .test_sidecar_process import poll


def test_a_warm_job_failed_by_a_silent_peer_names_the_peer_timeout_not_the_job_deadline(spawn, secret_file):
    silent = socket.create_server(("127.0.0.4", 0))  # accepts, never greets: a stalled peer
    stalled = "%s:%d" % silent.getsockname()[:2]
    try:
        side = spawn("a", "127.0.0.3", None, secret_file, warm_peers=[stalled], peer_timeout_s=0.5)
        status, body = side.post("/cache/warm", {"tenant": "t", "from_peer": stalled, "max_bytes": 1 << 20})
        assert status == 202, body
        job = json.loads(body)["job"]
        record = poll(lambda: (r := json.loads(side.get("/cache/jobs")[1])[job])["state"] == "failed" and r)
        assert f"peer {stalled} did not answer within peer_timeout_s=0.5s" in record["error"], record
        assert f"not finished within {WARM_JOB_DEADLINE_S:.0f}s" not in record["error"]
        assert side.get("/healthz")[0] == 200 and side.proc.poll() is None
    finally:
        silent.close()
