"""TTFT of `vllm serve` over HTTP (streamed completions, timed at the client from the
request to its first token): a prompt seen for the first time (cold: prefill), the same
prompt again once only kvtier's DRAM tier holds it (vLLM's own prefix cache emptied),
and a prompt only another pod's sidecar holds (found through the Redis index, fetched
over the peer tier). Tiny Llama on vLLM's CPU build, vLLM's prefix cache on (its
default), one kvtier sidecar per engine; every hit's first token must equal the cold
one's.

    .venv/bin/python -m bench.run_all --only vllm_serve
"""
from __future__ import annotations

import os
import random
import statistics
import tempfile
from pathlib import Path

from bench.common import Result

PROMPT_TOKENS = 2000
BLOCK = 32
TTFT_TARGET = 1.0
"""A hit, from DRAM or a peer, must not be slower than the prefill it replaces (the
tiny model's prefill is cheap, so the saving is small; what this guards is the cost of
the lookup, the peer fetch and the load)."""
WEIGHTS = "sha256:" + "be" * 32


def run(quick: bool = False) -> list[Result]:
    from kvtier_testenv.polling import wait_for
    from kvtier_testenv.redis_fixtures import RedisServer
    from kvtier_testenv.tiny_llama import TinyLlama, write_model
    from kvtier_testenv.vllm_engine import VllmEngine, connector_config
    from kvtier_testenv.vllm_serve import VllmServer, peer_sidecar

    trials = 3 if quick else 6
    shape = TinyLlama()
    rng = random.Random(31)
    hit_tokens = (PROMPT_TOKENS - 1) // BLOCK * BLOCK

    def prompt() -> list[int]:
        return [rng.randrange(3, shape.vocab) for _ in range(PROMPT_TOKENS)]

    cold, dram, peer_ttft = [], [], []
    with tempfile.TemporaryDirectory(prefix="kvb-", dir="/tmp") as tmp, RedisServer() as redis_server:
        wd = Path(tmp)
        secret = wd / "peer-secret"
        secret.write_text(os.urandom(32).hex())
        model = write_model(wd / "model", seed=0)
        sources = [prompt() for _ in range(trials)]
        peer = peer_sidecar(wd, "bench-peer-a", "127.0.0.2", shape, WEIGHTS, redis_server.url, str(secret),
                            dram_capacity_bytes=256 << 20)
        own = peer_sidecar(wd, "bench-peer-b", "127.0.0.3", shape, WEIGHTS, redis_server.url, str(secret),
                           dram_capacity_bytes=256 << 20, peer_timeout_s=5.0)
        server = None
        try:
            # another pod's engine computes the peer prompts into its sidecar, then exits
            source = VllmEngine(wd, model, connector_config(peer.socket, WEIGHTS, model_id="tiny-llama",
                                                            block_size=BLOCK), name="bench-source").start()
            try:
                expected = source.generate(sources, salts=["bench"] * trials, max_tokens=1)["outputs"]
            finally:
                source.close()
            blocks = trials * (PROMPT_TOKENS // BLOCK)
            wait_for("the peer's blocks in the index",
                     lambda: peer.stats()["index"]["counters"].get("registered_blocks", 0) >= blocks, 120)
            ktc = connector_config(own.socket, WEIGHTS, model_id="tiny-llama", block_size=BLOCK,
                                   lookup_budget_ms=5000.0, lookup_timeout_s=10.0)
            server = VllmServer(wd, model, ktc, name="bench-serve").start()
            server.complete(prompt(), "warm-up", max_tokens=1)  # first-use costs out of the way
            for i in range(trials):
                p = prompt()
                stored = own.stats("bench")["cache"]["stored_blocks"]
                first = server.complete(p, "bench", max_tokens=1)
                if first["cached"]:
                    raise AssertionError(f"a fresh prompt came back {first['cached']} tokens cached")
                wait_for("the cold prompt stored",
                         lambda: own.stats("bench")["cache"]["stored_blocks"] >= stored + PROMPT_TOKENS // BLOCK, 60)
                server.reset_prefix_cache()  # only kvtier holds it now
                again = server.complete(p, "bench", max_tokens=1)
                from_peer = server.complete(sources[i], "bench", max_tokens=1)
                if again["cached"] != hit_tokens or again["tokens"] != first["tokens"]:
                    raise AssertionError(f"DRAM hit: {again} against cold {first}")
                if from_peer["cached"] != hit_tokens or from_peer["tokens"] != expected[i]:
                    raise AssertionError(f"peer hit: {from_peer} against {expected[i]}")
                cold.append(first["ttft_s"])
                dram.append(again["ttft_s"])
                peer_ttft.append(from_peer["ttft_s"])
            loaded = server.metrics()
        finally:
            if server is not None:
                server.close()
            own.kill()
            peer.kill()
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    note = (f"median of {trials}; {hit_tokens} of {PROMPT_TOKENS} tokens loaded per hit "
            f"(vLLM loaded {loaded.get('vllm:kvtier_loaded_tokens_dram_total', 0):,.0f} from DRAM, "
            f"{loaded.get('vllm:kvtier_loaded_tokens_peer_total', 0):,.0f} over the peer tier)")
    return [
        Result(f"vllm serve TTFT over HTTP, {PROMPT_TOKENS}-token prompt held in kvtier DRAM", med(dram), "ms",
               TTFT_TARGET, direction="lower", baseline=med(cold), baseline_name="same prompt cold (prefill)",
               note=note),
        Result(f"vllm serve TTFT over HTTP, {PROMPT_TOKENS}-token prompt held by a peer sidecar", med(peer_ttft),
               "ms", TTFT_TARGET, direction="lower", baseline=med(cold), baseline_name="a prompt cold (prefill)",
               note="fetched over the encrypted peer tier, found in the Redis index"),
    ]


if __name__ == "__main__":
    for r in run(quick=True):
        print(r.as_dict())
