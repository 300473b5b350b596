"""vLLM KV events for what kvtier holds: a `BlockStored` on vLLM's own event stream
(`--kv-events-config`) for every prompt whose blocks a sidecar committed, so any
events-driven router (llm-d's precise prefix-cache scorer, vllm-router's `kv_aware`)
learns which pod's kvtier tier holds a prefix.

The events use vLLM's own block hashes, token ids, block size and extra keys (the
cache_salt, the LoRA name) of the request's blocks — the same shapes vLLM's GPU
events carry — with `medium` set to kvtier's (the connector's `kv_events_medium`,
"KVTIER" by default), so a consumer keys them exactly as it keys vLLM's and weighs the
tier by its medium. The scheduler side describes a request's blocks when it first asks
kvtier (`describe`); the worker that committed the store emits the event (rank 0 only:
every rank stores its own shard of the same blocks); the scheduler side gathers the
workers' events (`update_connector_output`) and hands them to vLLM's publisher
(`take_events`). Both happen at scheduler steps: a store committed after its request's
last step is announced at the engine's next step, so an idle engine announces nothing
until it serves again.

What leaves the tier is withdrawn the same way: a `BlockRemoved` (same medium, vLLM's
hash) for each announced block the sidecar's DRAM tier evicted (read from its removal
log over the engine socket, off the request path), for all of them when the sidecar
restarted or its log cannot say, and for the oldest when more are announced than
`Announced` keeps track of. A router may so forget a block kvtier still holds; it is
never left believing in one kvtier removed for longer than a poll (`announced`).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents

if TYPE_CHECKING:
    from vllm.v1.request import Request

class KvtierKVEvents(KVConnectorKVEvents):
    """The events one worker (or, gathered, every worker) emitted since the last step."""

    def __init__(self, events: list[KVCacheEvent] | None = None, num_workers: int = 1) -> None:
        self._events: list[KVCacheEvent] = list(events or [])
        self._num_workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> "KvtierKVEvents":
        # Only rank 0 emits: every event is already the whole fleet of workers' word.
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._num_workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def clear_events(self) -> None:
        self._events.clear()


def describe(request: "Request", n_blocks: int, block_size: int) -> dict[str, Any] | None:
    """The first `n_blocks` vLLM blocks (of `block_size` tokens, vLLM's hash block
    size) of `request` as a `BlockStored` wants them (hashes, extra keys, LoRA), or
    None when vLLM has not hashed that many."""
    from vllm.v1.core.kv_cache_utils import (
        generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys)

    hashes = list(getattr(request, "block_hashes", ()) or ())[:n_blocks]
    if n_blocks <= 0 or len(hashes) < n_blocks:
        return None
    extra: list[Any] = []
    mm_idx = 0
    for i in range(n_blocks):
        keys, mm_idx = generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size, mm_idx)
        extra.append(keys)
    lora = getattr(request, "lora_request", None)
    return {"block_hashes": [maybe_convert_block_hash(h) for h in hashes],
            "extra_keys": to_event_extra_keys(extra),
            "lora_id": lora.adapter_id if lora else None, "lora_name": lora.name if lora else None}


def stored(described: dict[str, Any], token_ids: list[int], block_size: int, medium: str) -> BlockStored:
    """The event for a committed store of the described blocks (`token_ids` covers them)."""
    n = len(described["block_hashes"])
    return BlockStored(block_hashes=list(described["block_hashes"]), parent_block_hash=None,
                       token_ids=list(token_ids[: n * block_size]), block_size=block_size,
                       lora_id=described["lora_id"], medium=medium, lora_name=described["lora_name"],
                       extra_keys=described["extra_keys"])


def removed(vllm_hashes: list[Any], medium: str) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(vllm_hashes), medium=medium)


class Outbox:
    """Events the calls thread emits, taken by the worker once per step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[KVCacheEvent] = []

    def put(self, event: KVCacheEvent) -> None:
        with self._lock:
            self._events.append(event)

    def take(self) -> KvtierKVEvents | None:
        with self._lock:
            events, self._events = self._events, []
        return KvtierKVEvents(events) if events else None
