"""Small peer fetch latency: connect + handshake + a 4-block fetch (token match,
checksums) vs a raw TCP connect + one request/answer of the same bytes, interleaved
in one process; medians. What the mutual, endpoint-bound handshake costs shows here
(a 64 MiB fetch in bench_sidecar hides it).

    python -m bench.peer_small_fetch [N]

Runs against whichever kvtier_sidecar is importable, so the same file measures an
older tree too (PYTHONPATH=<tree>:<tree>/sidecar:<tree>/testenv); the older peer
protocol (KVP1) took its secret as a callable."""
import os, random, socket, statistics, sys, threading, time
import numpy as np
from kvtier_sidecar import wire
from kvtier_sidecar.arena import Arena
from kvtier_sidecar.dram import DramTier
from kvtier_sidecar.peer_tcp import PeerServer, TcpTransport
from kvtier_testenv.workload import SyntheticOracle

O = SyntheticOracle(); BB = O.block_bytes
arena = Arena.create(f"kvt-bench-{os.getpid()}", 64, BB)
tier = DramTier(arena, 16, min_sightings=1, kv_heads=2)
toks = np.random.default_rng(0).integers(0, 30000, 80).astype(np.uint32)
root = O.root("a"); kv = O.kv(root, toks)
res = tier.reserve(root, toks, None, None, admit=False)
for i, s in enumerate(res.slots):
    tier.slot_array(s)[:] = kv[(res.first_block + i) * BB:(res.first_block + i + 1) * BB]
tier.commit(res, len(res.slots)); tier.compute_digests(res.slots) if hasattr(tier, "compute_digests") else None
KEY = b"s" * 32  # at least 32 bytes: newer trees refuse a shorter secret
server = PeerServer(tier, "127.0.0.1", 0, KEY, max_concurrency=8, timeout_s=5.0).start()
v1 = wire.HELLO_MAGIC == b"KVP1"
tr = TcpTransport(lambda: KEY, 1.0, 5.0) if v1 else TcpTransport(KEY, 1.0, 5.0)
payload = bytes(BB * 4)
raw = socket.create_server(("127.0.0.1", 0)); raddr = raw.getsockname()
def echo():
    while True:
        c, _ = raw.accept()
        c.recv(64); c.sendall(payload); c.close()
threading.Thread(target=echo, daemon=True).start()
class Sink:
    buf = np.zeros(8 * BB, np.uint8)
    def reserve(self, n): return [memoryview(self.buf)[i*BB:(i+1)*BB] for i in range(n)]
def peer():
    out = tr.fetch(server.address, root, toks, 16, BB, Sink(), max_blocks=4)
    assert out.verified_blocks == 4, out
def rawtcp():
    s = socket.create_connection(raddr); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(b"x" * 64); got = 0
    while got < len(payload):
        k = len(s.recv(1 << 20)); got += k
        if not k: break
    s.close()
N = int(sys.argv[1]) if len(sys.argv) > 1 else 1500
ps, rs = [], []
for i in range(N):
    for f, acc in ((peer, ps), (rawtcp, rs)) if i % 2 else ((rawtcp, rs), (peer, ps)):
        t = time.perf_counter(); f(); acc.append(time.perf_counter() - t)
p, r = statistics.median(ps) * 1e6, statistics.median(rs) * 1e6
print(f"{wire.HELLO_MAGIC.decode()} small fetch p50 {p:.0f} us, raw TCP p50 {r:.0f} us, ratio {p/r:.2f}")
server.close(); arena.close()
