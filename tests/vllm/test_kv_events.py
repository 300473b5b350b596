"""vLLM's own KV event stream (`--kv-events-config`, ZMQ) tells a router what kvtier
holds: `vllm serve` with the connector publishes, next to vLLM's own events, a
`BlockStored` of medium "KVTIER" for each prompt its sidecar committed — vLLM's block
hashes, token ids, block size and cache_salt, so a consumer keys it as it keys vLLM's —
and only once the sidecar holds the blocks; and a `BlockRemoved` of the same medium
when they leave (here: the sidecar restarted with an empty DRAM tier; eviction itself
is pinned by the sidecar's removal-log tests). Decoded by vLLM's own `KVEventBatch`
decoder, as an events-driven router does."""
from __future__ import annotations

import json
import os
import random

import pytest

from kvtier_testenv.kv_events import KvEventSubscriber, kv_events_config
from kvtier_testenv.polling import wait_for
from kvtier_testenv.ports import free_port
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


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, SHAPE.vocab) for _ in range(PROMPT_TOKENS)]


def _kvtier_events(sub: KvEventSubscriber, tokens: list[int]) -> list[dict]:
    return [e for e in sub.events() if e["type"] == "BlockStored" and e.get("medium") == MEDIUM
            and e["token_ids"] == tokens]


def test_kvtier_block_stored_events_on_vllms_stream(tmp_path, redis_url):
    rng = random.Random(5)
    secret = tmp_path / "peer-secret"
    secret.write_text(os.urandom(32).hex())
    model = write_model(tmp_path / "model", seed=0)
    sidecar = peer_sidecar(tmp_path, "events-a", "127.0.0.2", SHAPE, WEIGHTS, redis_url, str(secret))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = KvEventSubscriber(tmp_path, endpoint).start()
    server = None
    try:
        ktc = connector_config(sidecar.socket, WEIGHTS, model_id="tiny-llama", block_size=BLOCK)
        server = VllmServer(tmp_path, model, ktc, name="events",
                            extra_args=["--kv-events-config", json.dumps(kv_events_config(endpoint))])
        server.start()

        # ZMQ drops what is published before the connection is up: until a request's
        # events arrive, send another (each is a fresh prompt: vLLM stores its blocks).
        def stream_up() -> bool:
            server.complete(_prompt(rng), "warm-up", max_tokens=1)
            return any(e["type"] == "BlockStored" for e in sub.events())
        wait_for("vLLM's KV event stream reaching the subscriber", stream_up, 120, 0.5)

        prompt = _prompt(rng)
        stored_before = sidecar.stats()["cache"]["stored_blocks"]
        first = server.complete(prompt, "tenant-a")
        # vLLM collects a connector's events at its scheduler steps: a store that
        # completes after the request's last step is announced at the next one, so an
        # idle engine is kept stepping with one-token requests until it is.
        def announced():
            seen = _kvtier_events(sub, prompt[:STORED_TOKENS])
            if not seen:
                server.complete(_prompt(rng), "tick", max_tokens=1)
            return seen
        kvtier = wait_for("kvtier's BlockStored for the prompt", announced, 60)
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
        other = wait_for("tenant-b's BlockStored", lambda: [
            e for e in _kvtier_events(sub, prompt[:STORED_TOKENS]) if "tenant-b" in (e["extra_keys"][0] or [])], 60)
        assert not set(other[0]["block_hashes"]) & set(ev["block_hashes"])

        # vLLM's prefix cache emptied: the hit comes from kvtier, the tier the event named.
        server.reset_prefix_cache()
        again = server.complete(prompt, "tenant-a")
        assert again["tokens"] == first["tokens"]
        assert again["cached"] >= STORED_TOKENS - BLOCK

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

    finally:
        if server is not None:
            server.close()
        sub.close()
        sidecar.kill()
