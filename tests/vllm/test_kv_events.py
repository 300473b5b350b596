"""vLLM's own KV event stream (`--kv-events-config`, ZMQ) tells a router what kvtier
holds: `vllm serve` with the connector publishes, next to vLLM's own events, a
`BlockStored` of medium "KVTIER" for each prompt its sidecar committed — vLLM's block
hashes, token ids, block size and cache_salt, so a consumer keys it as it keys vLLM's —
and only once the sidecar holds the blocks; and a `BlockRemoved` of the same medium
when they leave (here: the sidecar restarted with an empty DRAM tier; eviction itself
is pinned by the sidecar's removal-log tests). Two consumers read the one stream:
vLLM's own `KVEventBatch` decoder, and llm-d's precise prefix-cache producer, the real,
unmodified one (llm-d-kv-cache's pool, vLLM adapter, index and scorer:
`kvtier_testenv.llmd_index`), which must name this pod's kvtier tier for a prefix that
vLLM's GPU cache no longer holds, and drop it when kvtier does."""
from __future__ import annotations

import json
import os
import random

import pytest

from kvtier_testenv.kv_events import KvEventSubscriber, kv_events_config
from kvtier_testenv.llmd_index import LlmdIndex, topic
from kvtier_testenv.polling import wait_for
from kvtier_testenv.tiny_llama import TinyLlama, write_model
from kvtier_testenv.vllm_engine import VLLM_BLOCK_SIZE, connector_config
from kvtier_testenv.vllm_serve import VllmServer, peer_sidecar

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow]

SHAPE = TinyLlama()
WEIGHTS = "sha256:" + "e5" * 32
BLOCK = 32
PROMPT_TOKENS = 200
STORED_TOKENS = PROMPT_TOKENS // BLOCK * BLOCK
MEDIUM = "KVTIER"
# llm-d files events under the pod and model of the stream's topic, and under the
# event's medium, lower-cased, as the device tier.
POD = "vllm-events-0"
MODEL = "tiny-llama"
LLMD_TIER = "kvtier"
KVTIER_WEIGHT = 0.8  # its weight in llm-d's scorer (kvCacheBackendConfigs), as for "cpu"
# A small GPU cache (80 blocks of 16, the model length cut to fit) so a few long
# prompts evict vLLM's own copy of a prefix, and only kvtier's is left.
GPU_BLOCKS = 80
MAX_MODEL_LEN = 1024
FILLER_TOKENS = 1000


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, SHAPE.vocab) for _ in range(PROMPT_TOKENS)]


def _filler(rng: random.Random) -> list[int]:
    return [rng.randrange(3, SHAPE.vocab) for _ in range(FILLER_TOKENS)]


def _kvtier_events(sub: KvEventSubscriber, tokens: list[int]) -> list[dict]:
    return [e for e in sub.events() if e["type"] == "BlockStored" and e.get("medium") == MEDIUM
            and e["token_ids"] == tokens]


def test_kvtier_block_stored_events_on_vllms_stream(tmp_path, redis_url):
    rng = random.Random(5)
    secret = tmp_path / "peer-secret"
    secret.write_text(os.urandom(32).hex())
    model = write_model(tmp_path / "model", seed=0)
    sidecar = peer_sidecar(tmp_path, "events-a", "127.0.0.2", SHAPE, WEIGHTS, redis_url, str(secret))
    # vLLM binds the stream (ipc: loopback by construction); both consumers dial it.
    endpoint = f"ipc://{tmp_path}/kv-events.sock"
    sub = KvEventSubscriber(tmp_path, endpoint, bind=False).start()
    server = llmd = None
    try:
        ktc = connector_config(sidecar.socket, WEIGHTS, model_id="tiny-llama", block_size=BLOCK)
        server = VllmServer(tmp_path, model, ktc, name="events",
                            extra_args=["--kv-events-config", json.dumps(kv_events_config(endpoint, topic(POD, MODEL))),
                                        "--num-gpu-blocks-override", str(GPU_BLOCKS),
                                        "--max-model-len", str(MAX_MODEL_LEN)])
        server.start()
        llmd = LlmdIndex(tmp_path, endpoint, VLLM_BLOCK_SIZE, tiers=f"gpu=1.0,{LLMD_TIER}={KVTIER_WEIGHT}").start()

        # ZMQ drops what is published before a connection is up: until a request's
        # events reach both consumers, send another (each a fresh prompt: vLLM stores it).
        def stream_up() -> bool:
            warm = _prompt(rng)
            server.complete(warm, "warm-up", max_tokens=1)
            return (any(e["type"] == "BlockStored" for e in sub.events())
                    and any(llmd.holders(MODEL, warm, "warm-up")[:1]))
        wait_for("vLLM's KV event stream reaching both subscribers", stream_up, 120, 0.5)

        prompt = _prompt(rng)
        stored_before = sidecar.stats()["cache"]["stored_blocks"]
        first = server.complete(prompt, "tenant-a")
        # vLLM collects a connector's events at its scheduler steps: a store that
        # completes after the request's last step is announced at the next one, so an
        # idle engine is kept stepping with one-token requests until it is.
        def announced(tenant: str):
            def seen():
                events = [e for e in _kvtier_events(sub, prompt[:STORED_TOKENS])
                          if tenant in (e["extra_keys"][0] or [])]
                if not events:
                    server.complete(_prompt(rng), "tick", max_tokens=1)
                return events
            return seen
        kvtier = wait_for("kvtier's BlockStored for the prompt", announced("tenant-a"), 60)
        # Announced only once the sidecar holds the blocks.
        assert sidecar.stats()["cache"]["stored_blocks"] >= stored_before + STORED_TOKENS // BLOCK
        ev = kvtier[0]
        assert ev["block_size"] == VLLM_BLOCK_SIZE
        assert len(ev["block_hashes"]) == STORED_TOKENS // VLLM_BLOCK_SIZE
        assert ev["parent_block_hash"] is None
        # The tenant (cache_salt) is in the first block's extra keys, as in vLLM's own events.
        assert ev["extra_keys"] and "tenant-a" in (ev["extra_keys"][0] or [])
        # vLLM's own events for the same blocks carry the same hashes: a router keys them alike.
        own = [h for e in sub.events() if e["type"] == "BlockStored" and e.get("medium") != MEDIUM
               for h in e["block_hashes"]]
        assert set(ev["block_hashes"]) <= set(own)

        # Another tenant's same tokens are other blocks (the salt is in the hash).
        server.complete(prompt, "tenant-b")
        other = wait_for("tenant-b's BlockStored", announced("tenant-b"), 60)
        assert not set(other[0]["block_hashes"]) & set(ev["block_hashes"])

        # llm-d's producer, reading the same stream, files every block of the prompt
        # under this pod's kvtier tier, beside vLLM's own (GPU) copy.
        blocks = STORED_TOKENS // VLLM_BLOCK_SIZE
        wait_for("llm-d's index naming the pod's kvtier tier for every block", lambda: (
            (held := llmd.holders(MODEL, prompt, "tenant-a")) and len(held) == blocks
            and all({(POD, LLMD_TIER), (POD, "gpu")} <= h for h in held)), 30, 0.2)
        # A tenant's blocks are its own in llm-d's index too (the salt is in the key).
        assert not any(llmd.holders(MODEL, prompt, "tenant-c"))

        # vLLM's GPU cache evicts its copies (long fillers; vLLM says BlockRemoved): llm-d
        # still sends the prefix to this pod, now for kvtier's copy alone.
        def gpu_copy_gone() -> bool:
            held = llmd.holders(MODEL, prompt, "tenant-a")
            if len(held) == blocks and all(h == {(POD, LLMD_TIER)} for h in held):
                return True
            server.complete(_filler(rng), "filler", max_tokens=1)
            return False
        wait_for("llm-d's index holding the prefix in kvtier alone", gpu_copy_gone, 120, 0.2)
        scores = llmd.score(MODEL, prompt, "tenant-a")["scores"]
        assert set(scores) == {POD}
        assert scores[POD] == pytest.approx(KVTIER_WEIGHT * blocks)  # the tier's weight, per block

        # vLLM's prefix cache emptied: the hit comes from kvtier, the tier the event named.
        server.reset_prefix_cache()
        again = server.complete(prompt, "tenant-a")
        assert again["tokens"] == first["tokens"]
        assert again["cached"] >= STORED_TOKENS - BLOCK

        # vLLM's reset said AllBlocksCleared, which llm-d applies to every tier of the
        # pod: a prompt stored after it is what llm-d knows kvtier holds now.
        later = _prompt(rng)
        server.complete(later, "tenant-a")

        def later_announced() -> bool:
            held = llmd.holders(MODEL, later, "tenant-a")
            if len(held) == blocks and all((POD, LLMD_TIER) in h for h in held):
                return True
            server.complete(_prompt(rng), "tick", max_tokens=1)  # a step, to announce the store
            return False
        wait_for("llm-d's index naming kvtier for a prompt stored after the reset", later_announced, 60, 0.2)

        # The sidecar restarts with an empty DRAM tier: what was announced is withdrawn
        # (BlockRemoved, medium KVTIER, vLLM's hashes), found when rank 0 next reads the
        # sidecar, which a step of any request gives it.
        announced = {h for e in _kvtier_events(sub, prompt[:STORED_TOKENS]) for h in e["block_hashes"]}
        sidecar.kill()
        sidecar.start()

        def withdrawn() -> set:
            server.complete(_prompt(rng)[:BLOCK - 1], "poke", max_tokens=1)  # a step; stores nothing
            return {h for e in sub.events() if e["type"] == "BlockRemoved" and e.get("medium") == MEDIUM
                    for h in e["block_hashes"]} & announced
        assert wait_for("kvtier's BlockRemoved for the restarted sidecar's blocks",
                        lambda: withdrawn() == announced, 120, 0.5)
        # llm-d drops the pod's kvtier tier for the prefix.
        wait_for("llm-d's index dropping the kvtier tier", lambda: (
            len(held := llmd.holders(MODEL, later, "tenant-a")) == blocks
            and all((POD, LLMD_TIER) not in h for h in held)), 30, 0.2)

    finally:
        if llmd is not None:
            llmd.close()
        if server is not None:
            server.close()
        sub.close()
        sidecar.kill()
