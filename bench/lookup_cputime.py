"""CPU time per request of both processes, engine lookup vs bare round trip (no valgrind).

    python -m bench.lookup_cputime [N]

The engine process (`SidecarClient.lookup`, 200-token cached prompt) and the sidecar,
against a client doing `sendall` + `recv_exact` of the same sizes and bench_sidecar's
asyncio echo process: user + system CPU time of both processes of each side
(`process_time`, `/proc/PID/stat`), N requests a side, 5 alternating rounds, median.
Less moved by other jobs than wall time (no waiting counted), more than instructions
(`bench.lookup_icount`).
"""
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
import numpy as np
from bench import bench_sidecar as bs
from kvtier_sidecar.client import SidecarClient
from kvtier_sidecar.sockio import recv_exact
from kvtier_testenv.fleet import SidecarHandle, sidecar_config
from kvtier_testenv.redis_fixtures import RedisServer

import statistics as st


def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def main():
    N = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    work = Path(tempfile.mkdtemp(prefix="kvtier-cputime-"))
    (work / "secret").write_bytes(bs.BENCH_SECRET)
    tokens = np.random.default_rng(0).integers(0, 30_000, 201).astype(np.uint32)
    kv = np.random.default_rng(1).integers(0, 256, 12 * bs.BLOCK_BYTES, dtype=np.uint8)
    root = bs._root()
    with RedisServer() as r:
        cfg = sidecar_config("cputime", "127.0.0.4", work, bs._Oracle, r.url, str(work / "secret"),
                             dram_capacity_bytes=64 * bs.BLOCK_BYTES, peer_timeout_s=30.0)
        sc = SidecarHandle("cputime", "127.0.0.4", work, cfg).start(180)
        try:
            c = SidecarClient(sc.socket)
            bs._seed(c, tokens, kv)
            frame, reply_bytes = bs._lookup_sizes(sc.socket, root, tokens)
            for _ in range(300):
                c.release(c.lookup(root, tokens))
            res = {"lookup": [], "bare": []}
            echo_path = str(work / "echo.sock")
            echo = subprocess.Popen([sys.executable, "-c", bs._ECHO, echo_path, str(reply_bytes)], stdout=subprocess.PIPE)
            assert echo.stdout.readline().strip() == b"ready"
            s = socket.socket(socket.AF_UNIX); s.connect(echo_path)
            for rnd in range(5):
                hits = []
                c0, s0 = time.process_time(), cpu(sc.proc.pid)
                for _ in range(N):
                    hits.append(c.lookup(root, tokens))
                res["lookup"].append((time.process_time() - c0 + cpu(sc.proc.pid) - s0) / N)
                for h in hits: c.release(h)
                c0, s0 = time.process_time(), cpu(echo.pid)
                for _ in range(N):
                    s.sendall(frame); recv_exact(s, reply_bytes)
                res["bare"].append((time.process_time() - c0 + cpu(echo.pid) - s0) / N)
            echo.kill(); echo.wait()
        finally:
            sc.stop()
    L, B = st.median(res["lookup"]), st.median(res["bare"])
    print(f"lookup {L*1e6:.1f} us CPU/request, bare {B*1e6:.1f} us, ratio {L/B:.2f}; per round {[round(a/b,2) for a,b in zip(res['lookup'],res['bare'])]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
