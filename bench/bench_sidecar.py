"""Sidecar data-plane benchmarks: each figure against a baseline measured in this run.

    python -m bench.bench_sidecar [--quick]

- local materialize through shared memory vs numpy memcpy of the same bytes (>= 0.7x)
- peer fetch of a 64 MiB block run between two processes vs raw Python TCP loopback
  (>= 0.7x) and vs redis-py GETs of the same bytes from a real Redis (>= 2x)
- global-index longest-prefix query for a 2,000-token prompt: p50 <= 1 ms
- engine lookup over the Unix socket: p50 <= 200 us
- 1,000 concurrent engine lookups: no errors (p99 reported)
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import Result, best_of, machine, percentile

# A mid-size model's KV: 8 layers x 8 kv heads x 128 x fp16 = 32 KiB/token, 512 KiB blocks.
SHAPE = {"model_id": "bench", "weights_version": "v1", "layers": 8, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}
BLOCK_BYTES = 2 * 8 * 8 * 128 * 2 * 16
PROMPT_TOKENS_2K = 2000


class _Oracle:
    """Just enough of workload.SyntheticOracle's surface for fleet.sidecar_config."""

    block_size = 16
    shape = {**SHAPE, "kv_dtype": "float16", "rope_config_hash": "rope", "attn_impl_id": "sdpa"}


def _root(tenant: str = "bench"):
    from kvtier.keys import KeyRoot

    s = _Oracle.shape
    return KeyRoot(tenant, s["model_id"], s["weights_version"], s["kv_dtype"], s["rope_config_hash"], s["attn_impl_id"])


def _seed(client, tokens: np.ndarray, kv: np.ndarray) -> None:
    root = _root()
    for _ in range(2):
        client.release(client.lookup(root, tokens))
        client.store(root, tokens, kv)


def _raw_tcp_gbps(nbytes: int, repeat: int) -> float:
    """Raw Python TCP loopback: a child process sendall()s, we recv_into()."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    code = ("import socket,sys\n"
            f"s=socket.create_connection(('127.0.0.1',{port}))\n"
            f"s.setsockopt(socket.SOL_SOCKET,socket.SO_SNDBUF,8<<20)\n"
            f"buf=bytes({nbytes})\n"
            f"for _ in range({repeat}):\n"
            "    s.recv(1)\n    s.sendall(buf)\n")
    child = subprocess.Popen([sys.executable, "-c", code])
    conn, _ = server.accept()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    dst = np.ones(nbytes, np.uint8)
    view = memoryview(dst)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        conn.sendall(b"g")
        got = 0
        while got < nbytes:
            got += conn.recv_into(view[got:], nbytes - got)
        best = min(best, time.perf_counter() - t0)
    child.wait()
    conn.close()
    server.close()
    return nbytes / best / 1e9


def _redis_gbps(url: str, nbytes: int, repeat: int, value_bytes: int = 4 << 20) -> float:
    """What a Redis KV backend gives: GETs of 4 MiB chunks holding the same bytes."""
    import redis

    r = redis.Redis.from_url(url)
    chunks = max(1, nbytes // value_bytes)
    payload = os.urandom(value_bytes)
    for i in range(chunks):
        r.set(f"kv:{i}", payload)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for i in range(chunks):
            r.get(f"kv:{i}")
        best = min(best, time.perf_counter() - t0)
    return chunks * value_bytes / best / 1e9


class _Sink:
    def __init__(self, nbytes: int, block_bytes: int) -> None:
        self.buf = np.ones(nbytes, np.uint8)  # touched: no page faults inside the timing
        self.block_bytes = block_bytes

    def reserve(self, n: int):
        bb = self.block_bytes
        return [memoryview(self.buf)[i * bb:(i + 1) * bb] for i in range(n)]


async def _index_latency(url: str, samples: int) -> tuple[float, float]:
    from kvtier.keys import block_hashes
    from kvtier_sidecar.global_index import GlobalIndex

    root = _root("idx")
    tokens = np.random.default_rng(1).integers(0, 30_000, PROMPT_TOKENS_2K).astype(np.uint32)
    hashes = [h.hex() for h in block_hashes(root, tokens, 16)]
    tag = root.digest().hex()
    peer = GlobalIndex(url, "10.0.0.1:9")
    peer.register(tag, hashes[:100])
    await peer.flush()
    me = GlobalIndex(url, "10.0.0.2:9", timeout_s=1.0)
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        answer = await me.longest_prefix(tag, hashes)
        times.append(time.perf_counter() - t0)
    assert answer is not None and answer.matched_blocks == 100
    # Context: 125 per-key lookups in one pipeline (what a naive schema costs).
    pipe_times = []
    for _ in range(max(10, samples // 10)):
        t0 = time.perf_counter()
        pipe = me.redis.pipeline(transaction=False)
        for h in hashes:
            pipe.hgetall(me.block_key(tag, h))
        await pipe.execute()
        pipe_times.append(time.perf_counter() - t0)
    await peer.close()
    await me.close()
    return percentile(times, 0.5), percentile(pipe_times, 0.5)


async def _concurrent_lookups(path: str, n: int, tokens: np.ndarray) -> tuple[int, list[float]]:
    """n engine connections each with one LOOKUP in flight at the same moment."""
    from kvtier_sidecar.client import root_payload
    from kvtier_sidecar.engine_proto import FRAME, EngineOp, decode_header, encode, split_body

    frame = encode(EngineOp.LOOKUP, 1, {"root": root_payload(_root())}, tokens)
    conns = [await asyncio.open_unix_connection(path) for _ in range(n)]
    start = asyncio.Event()
    errors = 0

    async def one(reader, writer) -> float:
        nonlocal errors
        await start.wait()
        t0 = time.perf_counter()
        writer.write(frame)
        head = await reader.readexactly(FRAME.size)
        body_len, _, _, json_len = decode_header(head)
        answer, slots = split_body(await reader.readexactly(body_len - 4), json_len)
        if not answer.get("hit") or "error" in answer:
            errors += 1
        return time.perf_counter() - t0

    tasks = [asyncio.create_task(one(r, w)) for r, w in conns]
    await asyncio.sleep(0.05)
    start.set()
    latencies = await asyncio.gather(*tasks, return_exceptions=True)
    errors += sum(isinstance(x, BaseException) for x in latencies)
    for _, w in conns:
        w.close()
    return errors, [x for x in latencies if isinstance(x, float)]


def run(quick: bool = False) -> list[Result]:
    from kvtier_sidecar.client import SidecarClient
    from kvtier_sidecar.fleet import SidecarHandle, sidecar_config
    from kvtier_sidecar.peer_tcp import TcpTransport
    from kvtier_testenv.redis_fixtures import RedisServer

    run_bytes = (16 if quick else 64) << 20
    repeat = 3 if quick else 5
    n_blocks = run_bytes // BLOCK_BYTES
    tokens = np.random.default_rng(0).integers(0, 30_000, n_blocks * 16 + 1).astype(np.uint32)
    kv = np.random.default_rng(1).integers(0, 256, n_blocks * BLOCK_BYTES, dtype=np.uint8)
    results: list[Result] = []
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-"))
    (work / "secret").write_text("bench-secret")
    with RedisServer() as redis_server:
        cfg = sidecar_config("bench-a", "127.0.0.2", work, _Oracle, redis_server.url, str(work / "secret"),
                             dram_capacity_bytes=run_bytes + 8 * BLOCK_BYTES, peer_timeout_s=30.0)
        a = SidecarHandle("bench-a", "127.0.0.2", work, cfg).start()
        try:
            client = SidecarClient(a.socket)
            _seed(client, tokens, kv)
            hit = client.lookup(_root(), tokens)
            assert hit and len(hit.blocks) == n_blocks, "bench prompt was not cached"

            # 1. local materialize through shared memory vs memcpy
            dst = np.ones(run_bytes, np.uint8)
            src = np.ones(run_bytes, np.uint8)
            client.materialize(hit, dst)
            assert np.array_equal(dst, kv), "materialized bytes differ from what was stored"
            # Interleaved rounds, best of each: a noisy shared machine hits both alike.
            t_mat = t_cpy = float("inf")
            for _ in range(repeat * 2):
                t_mat = min(t_mat, best_of(lambda: client.materialize(hit, dst), repeat=1))
                t_cpy = min(t_cpy, best_of(lambda: np.copyto(dst, src), repeat=1))
            results.append(Result("local materialize via shared memory", run_bytes / t_mat / 1e9, "GB/s", 0.7,
                                  baseline=run_bytes / t_cpy / 1e9, baseline_name="numpy memcpy, same bytes",
                                  note=f"{run_bytes >> 20} MiB, {n_blocks} blocks of {BLOCK_BYTES >> 10} KiB"))
            client.release(hit)

            # 2. peer fetch between two processes vs raw TCP and vs Redis GET
            transport = TcpTransport(lambda: b"bench-secret", 1.0, 30.0)
            sink = _Sink(run_bytes, BLOCK_BYTES)
            root = _root()
            outcomes = []

            def fetch():
                outcomes.append(transport.fetch(a.peer, root, tokens, 16, BLOCK_BYTES, sink, max_blocks=n_blocks))
            fetch_gbps = tcp_gbps = redis_gbps = 0.0
            for _ in range(repeat):
                fetch_gbps = max(fetch_gbps, run_bytes / best_of(fetch, repeat=2) / 1e9)
                tcp_gbps = max(tcp_gbps, _raw_tcp_gbps(run_bytes, 2))
                redis_gbps = max(redis_gbps, _redis_gbps(redis_server.url, run_bytes, 2))
            assert all(o.verified_blocks == n_blocks and o.error is None for o in outcomes), outcomes[-1]
            assert np.array_equal(sink.buf, kv)
            results.append(Result("peer fetch of a block run vs raw TCP", fetch_gbps, "GB/s", 0.7, baseline=tcp_gbps,
                                  baseline_name="raw Python TCP loopback (sendall/recv_into)",
                                  note=f"{run_bytes >> 20} MiB, checksum per run, auth, between two processes"))
            results.append(Result("peer fetch of a block run vs Redis GET", fetch_gbps, "GB/s", 2.0, baseline=redis_gbps,
                                  baseline_name="redis-py GET of 4 MiB values, same bytes"))

            # 3. global index longest-prefix query, 2,000-token prompt
            p50, pipe_p50 = asyncio.run(_index_latency(redis_server.url, 200 if quick else 1000))
            results.append(Result("global index longest prefix, 2,000 tokens (p50)", p50 * 1e3, "ms", 1.0,
                                  direction="lower", kind="absolute", baseline=pipe_p50 * 1e3,
                                  baseline_name="pipeline of 125 per-key HGETALLs (context)"))

            # 4. engine lookup over the Unix socket
            short = tokens[:201]
            lat = []
            for _ in range(500 if quick else 3000):
                t0 = time.perf_counter()
                h = client.lookup(root, short)
                lat.append(time.perf_counter() - t0)
                client.release(h)
            results.append(Result("engine lookup over the Unix socket (p50)", percentile(lat, 0.5) * 1e6, "us", 200.0,
                                  direction="lower", kind="absolute",
                                  note=f"200-token prompt, hit; p99 {percentile(lat, 0.99) * 1e6:.0f} us"))

            # 5. 1,000 concurrent engine lookups
            errors, lats = asyncio.run(_concurrent_lookups(a.socket, 1000, short))
            results.append(Result("1,000 concurrent engine lookups: errors", float(errors), "errors", 0.0,
                                  direction="lower", kind="absolute",
                                  note=f"p50 {percentile(lats, 0.5) * 1e3:.1f} ms, p99 {percentile(lats, 0.99) * 1e3:.1f} ms "
                                       f"({len(lats)} answered)"))
            client.close()
        finally:
            a.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    quick = "--quick" in (sys.argv[1:] if argv is None else argv)
    results = run(quick=quick)
    print(f"# bench_sidecar on {machine()}")
    for r in results:
        ratio = f" ({r.ratio:.2f}x {r.baseline_name})" if r.ratio is not None and r.kind == "ratio" else ""
        print(f"{'PASS' if r.passed else 'FAIL'}  {r.name}: {r.value:.3f} {r.unit}{ratio}  target {r.target}  {r.note}")
    print(json.dumps([r.as_dict() for r in results]))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
