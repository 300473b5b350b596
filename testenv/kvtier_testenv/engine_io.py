"""What an engine does per request on the kvtier side, for the test engines (traffic,
replays, fleet helpers): look the prompt up, load a hit (copy its blocks out of the
arena), and REPORT to the sidecar what it loaded, by tier, and the prompt's tokens,
as the vLLM connector does. The sidecar's hit figure (`kvtier_engine_loaded_tokens`,
/cache/stats "engine", what the operator's gate and `kubectl get kvcp` read) counts
only what an engine reported loading; lookups alone count as offered."""
from __future__ import annotations

import numpy as np

from kvtier import names
from kvtier.keys import KeyRoot
from kvtier_sidecar.client import EngineHit, Miss, SidecarClient


def report(client: SidecarClient, prompt_tokens: int, hit: EngineHit | Miss | None = None, loaded_blocks: int = 0,
           block_bytes: int = 0) -> bool:
    """Tell the sidecar this request's prompt tokens and the first `loaded_blocks` of
    `hit` that the engine loaded (by the tier each came from)."""
    counts = {"prompt_tokens": prompt_tokens}
    if isinstance(hit, EngineHit) and loaded_blocks:
        block_size = hit.matched_tokens // len(hit.blocks)
        for tier, n in hit.split(0, loaded_blocks * block_size).items():
            counts[f"loaded_tokens_{tier}"] = n
        counts["loaded_bytes"] = loaded_blocks * block_bytes
    return client.report(**counts)


def request(client: SidecarClient, root: KeyRoot, tokens: np.ndarray, block_bytes: int,
            load: bool = True, warmup: bool = False) -> tuple[EngineHit | Miss, np.ndarray | None]:
    """One request: lookup, the hit's blocks copied out (`load`), reported. Returns the
    hit (still pinned: release it) and the bytes loaded (None on a miss or no load).
    `warmup`: the rollout's warm-up request (`names.is_warmup` of its
    kv_transfer_params): looked up with purpose "warmup", and not reported (its prompt
    and loads are no part of the hit figure), as the connector does."""
    hit = client.lookup(root, tokens, purpose=names.WARMUP_PURPOSE if warmup else None)
    loaded = None
    if isinstance(hit, EngineHit) and load:
        loaded = np.zeros(len(hit.blocks) * block_bytes, np.uint8)
        client.materialize(hit, loaded)
    if not warmup:
        report(client, len(tokens), hit, len(hit.blocks) if loaded is not None else 0, block_bytes)
    return hit, loaded


def hit_rate(stats: list[dict]) -> float | None:
    """The loaded hit rate of sidecars' `GET /cache/stats` answers: prompt tokens their
    engines loaded from kvtier over the prompt tokens they looked up, rounded as the
    operator's status is (None before any prompt was reported)."""
    loaded = sum(sum((s.get("engine") or {}).get("loaded_tokens_by_tier", {}).values()) for s in stats)
    prompt = sum((s.get("engine") or {}).get("prompt_tokens", 0) for s in stats)
    return round(loaded / prompt, 4) if prompt else None


def offered_rate(stats: list[dict]) -> float | None:
    """What the same sidecars' lookups offered, per request (hits over lookups)."""
    lookups = sum(s["lookups"] for s in stats)
    return round(sum(s["hits"] for s in stats) / lookups, 4) if lookups else None
