"""Connector stats through vLLM's KVConnectorStats: summed over workers and steps,
logged by vLLM as "KV Transfer metrics: ..." and reduced per logging interval."""
from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = ("lookups", "hit_tokens", "loaded_blocks", "loaded_bytes", "load_seconds", "load_errors",
            "saved_blocks", "saved_bytes", "store_declined")
"""What the scheduler side (lookups, hit_tokens) and the workers (the rest) count."""


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
