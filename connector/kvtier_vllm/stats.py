"""Connector stats through vLLM's KVConnectorStats: summed over workers and steps,
logged by vLLM as "KV Transfer metrics: ..." and reduced per logging interval."""
from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = ("lookups", "prompt_tokens", "local_hit_tokens", "hit_tokens", "lookup_timeouts", "lookup_faults",
            "lookups_skipped", "breaker_trips", "breaker_recoveries",
            "loaded_blocks", "loaded_bytes", "loaded_tokens_dram", "loaded_tokens_peer", "load_seconds",
            "load_errors", "saved_blocks", "saved_bytes", "store_declined", "stores_skipped", "sidecar_unreachable")
"""What the scheduler side counts (lookups through breaker_recoveries: `plan.COUNTS`,
`lookups.AsyncLookups.counts`, the breaker's trips) and the workers (the rest).

A hit is `loaded_tokens_{tier}`: prompt tokens a worker really copied in from kvtier.
`hit_tokens` is what vLLM accepted from the lookups (offered), `local_hit_tokens` what
its own prefix cache already held, `prompt_tokens` the prompts' length."""


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
