"""Connector stats through vLLM's KVConnectorStats: summed over workers and steps,
logged by vLLM as "KV Transfer metrics: ..." and reduced per logging interval, and
exported on vLLM's own /metrics as `vllm:kvtier_<name>_total` counters
(`KvtierPromMetrics`): a hung sidecar cannot report its own breaker trips."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

COUNTERS = ("lookups", "prompt_tokens", "local_hit_tokens", "hit_tokens", "lookup_timeouts", "lookup_faults",
            "lookups_skipped", "breaker_trips", "breaker_recoveries",
            "loaded_blocks", "loaded_bytes", "loaded_tokens_dram", "loaded_tokens_peer", "load_seconds",
            "load_errors", "saved_blocks", "saved_bytes", "store_declined", "store_cached", "stores_skipped",
            "sidecar_unreachable", "weights_version_mismatch", "warmup_lookups", "warmup_prompt_tokens",
            "warmup_loaded_tokens", "peer_hints", "peer_hints_invalid")
"""What the scheduler side counts (lookups through breaker_recoveries: `plan.COUNTS`,
`lookups.AsyncLookups.counts`, the breaker's trips) and the workers (the rest).

A hit is `loaded_tokens_{tier}`: prompt tokens a worker really copied in from kvtier.
`hit_tokens` is what vLLM accepted from the lookups (offered), `local_hit_tokens` what
its own prefix cache already held, `prompt_tokens` the prompts' length. The rollout's
warm-up requests (`kvtier.names.is_warmup`) are in none of those: `warmup_*` count them.
`peer_hints` / `peer_hints_invalid`: requests whose kv_transfer_params carried a router's
peer-pull hint, sent with the lookup / malformed and ignored (`kvtier.names.source_peer`)."""


@dataclass
class KvtierConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def add(self, name: str, value: float) -> None:
        self.data[name] = self.data.get(name, 0) + value

    def reset(self) -> None:
        self.data = {name: 0 for name in COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> "KvtierConnectorStats":
        for name, value in other.data.items():
            self.add(name, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: round(self.data.get(name, 0), 6) for name in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in COUNTERS)


PROM_HELP = {
    "lookups": "Sidecar lookups the scheduler asked",
    "prompt_tokens": "Prompt tokens of the requests kvtier looked up",
    "local_hit_tokens": "Prompt tokens vLLM's own prefix cache held when kvtier was asked",
    "hit_tokens": "Prompt tokens kvtier offered and vLLM accepted",
    "lookup_timeouts": "Lookups not answered within lookup_budget_ms (the request went on without kvtier)",
    "lookup_faults": "Lookups that found the sidecar unreachable",
    "lookups_skipped": "Requests not looked up because the breaker was open",
    "breaker_trips": "Times the connector stopped asking an unresponsive sidecar",
    "breaker_recoveries": "Times a probe found the sidecar answering again",
    "loaded_blocks": "kvtier blocks copied into vLLM's KV cache",
    "loaded_bytes": "KV bytes copied into vLLM's KV cache from kvtier",
    "loaded_tokens_dram": "Prompt tokens loaded from kvtier that the sidecar held in DRAM",
    "loaded_tokens_peer": "Prompt tokens loaded from kvtier that the sidecar fetched from a peer",
    "load_seconds": "Seconds spent loading KV from kvtier",
    "load_errors": "kvtier blocks not loaded and handed back to vLLM to recompute",
    "saved_blocks": "Blocks stored into kvtier",
    "saved_bytes": "KV bytes stored into kvtier",
    "store_declined": "Stores the sidecar declined (admission, full arena)",
    "store_cached": "Stores with nothing to write: the sidecar held every block already",
    "stores_skipped": "Stores skipped: no sidecar connection, or staging full behind a slow sidecar",
    "sidecar_unreachable": "Times a worker found the sidecar's engine socket not answering",
    "weights_version_mismatch": "Workers whose sidecar is configured for other weights than the engine serves",
    "warmup_lookups": "Sidecar lookups of the rollout's warm-up requests (not in lookups)",
    "warmup_prompt_tokens": "Prompt tokens of the rollout's warm-up requests (not in prompt_tokens)",
    "warmup_loaded_tokens": "Prompt tokens the rollout's warm-up requests loaded from kvtier (not in loaded_tokens_*)",
    "peer_hints": "Lookups sent with a router's peer-pull hint (kv_transfer_params.kvtier.sourcePeer)",
    "peer_hints_invalid": "Requests whose peer-pull hint was not a host:port (ignored: looked up without it)",
}


class KvtierPromMetrics(KVConnectorPromMetrics):
    """One vLLM counter per `COUNTERS` name, fed by the stats vLLM collects."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvtier_{name}", documentation=PROM_HELP[name], labelnames=labelnames),
                per_engine_labelvalues)
            for name in COUNTERS}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self.counters.get(name)
            if per_engine is not None and value and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
