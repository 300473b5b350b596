"""Replicas as the simulator sees them: a DRAM prefix cache, a prefill queue, HBM.

Each replica runs prefill one request at a time at `prefill_tokens_per_s` (only the
tokens the cache did not cover), then holds the request's KV in HBM while it decodes
for `output_tokens x decode_s_per_token`. Two numbers come out per replica:

- occupancy: KV tokens held by in-flight requests / HBM KV capacity, the number
  the spill threshold (0.85) is about;
- load: replica-seconds of work done (prefill seconds + decode seconds at the
  replica's aggregate decode throughput), whose max/mean is the load imbalance.

A cache hit also costs a DRAM->HBM copy (`matched x kv_bytes / dram_gbps`); it adds
to time-to-first-token but not to load, because a DMA costs ~0 GPU-seconds.

Per-replica state is kept in plain lists: the event loop reads single elements a
million times, which is where numpy scalars are slowest.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from kvtier.breakeven import prefill_s_per_token
from kvtier.presets import gpu_preset, model_preset

# The design notes' fleet: 70B GQA-8 fp16 (320 KiB/token) at TP4 on H100s.
DEFAULT_MODEL, DEFAULT_GPU, DEFAULT_TP, DEFAULT_KV_DTYPE = "llama-3-70b", "h100", 4, "fp16"
_SHAPE = model_preset(DEFAULT_MODEL)
_DESIGN_KV_BYTES = _SHAPE.kv_bytes_per_token(DEFAULT_KV_DTYPE)
_DESIGN_PREFILL_TPS = 1.0 / prefill_s_per_token(_SHAPE.params, gpu_preset(DEFAULT_GPU).dense_tflops, DEFAULT_TP)
# One host's DRAM tier in the design notes' fleet.
DRAM_BYTES_PER_HOST = 500 * 2**30
# HBM left for KV on a 4 x 80 GB replica after ~140 GB of weights: ~172 GiB in the
# notes; in-flight requests need most of it, so ~100 GiB is counted as KV capacity.
HBM_KV_BYTES = 100 * 2**30
# A decode step every ~30 ms per sequence (interactive TPOT).
DECODE_S_PER_TOKEN = 0.030
# Aggregate decode throughput of one replica, tokens/s: a batch of ~180 sequences
# (what ~100 GiB of KV holds at ~1,800 tokens each) stepping every 30 ms. Turns
# output tokens into replica-seconds of load.
DECODE_TOKENS_PER_S = 6_000.0
# Host DRAM -> HBM over PCIe5 x16 (docs/ARCHITECTURE.md "The numbers").
DRAM_GBPS = 64.0
# The occupancy a router reads for a pod held out of traffic by a readiness gate: above
# any spill threshold, so `kvtier.routing.pick` sends its tenants to their other homes.
GATED_OCCUPANCY = 1.0


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """The fleet's shape. Byte and rate figures are per replica."""

    n_replicas: int = 44
    dram_bytes: int = DRAM_BYTES_PER_HOST
    kv_bytes_per_token: int = _DESIGN_KV_BYTES  # 320 KiB
    prefill_tokens_per_s: float = _DESIGN_PREFILL_TPS  # ~28,000 tokens/s (35.4 us/token)
    hbm_kv_bytes: int = HBM_KV_BYTES
    decode_s_per_token: float = DECODE_S_PER_TOKEN
    decode_tokens_per_s: float = DECODE_TOKENS_PER_S
    dram_gbps: float = DRAM_GBPS

    def __post_init__(self) -> None:
        if self.n_replicas < 1:
            raise ValueError(f"n_replicas must be >= 1, got {self.n_replicas}")
        for name in ("dram_bytes", "kv_bytes_per_token", "prefill_tokens_per_s", "hbm_kv_bytes",
                     "decode_tokens_per_s", "dram_gbps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def hbm_kv_tokens(self) -> int:
        return self.hbm_kv_bytes // self.kv_bytes_per_token


class Fleet:
    """Queue, occupancy and load state of every replica, indexed 0..n-1.

    Replicas can be added (join) and marked dead (leave); `live` lists the ones a
    router may pick. `version[r]` is the weights version replica r serves.
    """

    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        n = spec.n_replicas
        self.names = [f"replica-{i:03d}" for i in range(n)]
        self.live = list(range(spec.n_replicas))
        self.alive = [True] * n
        self.version = [0] * n
        self.prefill_free_at = [0.0] * n
        self.active_kv_tokens = [0] * n
        self.in_flight = [0] * n
        self.load_s = [0.0] * n
        self._hbm_tokens = spec.hbm_kv_tokens
        # name -> occupancy, kept current as requests start and finish: the mapping a
        # router reads (`kvtier.routing.pick`) without building a dict per request.
        self.occupancy_by_name: dict[str, float] = {name: 0.0 for name in self.names}
        self._events: list[tuple[float, int, int]] = []  # (done_s, replica, kv_tokens)
        # Pods held out of traffic (a readiness gate) until a time: replica -> ready_s.
        self._gated: dict[int, float] = {}
        self._next_ready_s = float("inf")

    def __len__(self) -> int:
        return len(self.names)

    def advance(self, now_s: float) -> None:
        """Retire every request that finished by `now_s`, freeing its HBM KV."""
        events, active, in_flight = self._events, self.active_kv_tokens, self.in_flight
        occ, names, hbm = self.occupancy_by_name, self.names, self._hbm_tokens
        while events and events[0][0] <= now_s:
            _, r, kv = heapq.heappop(events)
            active[r] -= kv
            in_flight[r] -= 1
            if self.alive[r] and r not in self._gated:
                occ[names[r]] = active[r] / hbm
        if now_s >= self._next_ready_s:
            for r in [r for r, t in self._gated.items() if t <= now_s]:
                del self._gated[r]
                if self.alive[r]:
                    occ[names[r]] = active[r] / hbm
            self._next_ready_s = min(self._gated.values(), default=float("inf"))

    def gate(self, r: int, until_s: float) -> None:
        """Hold replica r out of traffic until `until_s` (its readiness gate): the router
        reads it as full, so requests go to their other homes."""
        self._gated[r] = max(until_s, self._gated.get(r, until_s))
        self._next_ready_s = min(self._next_ready_s, self._gated[r])
        self.occupancy_by_name[self.names[r]] = GATED_OCCUPANCY

    def gated(self, r: int) -> bool:
        return r in self._gated

    def occupancy(self, r: int) -> float:
        return self.active_kv_tokens[r] / self._hbm_tokens

    def queue_s(self, r: int, now_s: float) -> float:
        """Prefill work already queued on replica r, in seconds."""
        return max(0.0, self.prefill_free_at[r] - now_s)

    def serve(self, r: int, now_s: float, prompt_tokens: int, matched_tokens: int, output_tokens: int) -> float:
        """Run one request on replica r; returns its time to first token in seconds."""
        spec = self.spec
        prefill_s = (prompt_tokens - matched_tokens) / spec.prefill_tokens_per_s
        fetch_s = matched_tokens * spec.kv_bytes_per_token / (spec.dram_gbps * 1e9)
        start = max(now_s, self.prefill_free_at[r])
        first_token_at = start + fetch_s + prefill_s
        self.prefill_free_at[r] = first_token_at
        kv = prompt_tokens + output_tokens
        heapq.heappush(self._events, (first_token_at + output_tokens * spec.decode_s_per_token, r, kv))
        self.active_kv_tokens[r] += kv
        self.in_flight[r] += 1
        if r not in self._gated:
            self.occupancy_by_name[self.names[r]] = self.active_kv_tokens[r] / self._hbm_tokens
        self.load_s[r] += prefill_s + output_tokens / spec.decode_tokens_per_s
        return first_token_at - now_s

    def prefill_only(self, r: int, now_s: float, tokens: int) -> float:
        """Replica r prefills `tokens` that produce no output and hold no KV after
        (warm-up prompts of one token): its prefill queue grows by their time; returns
        when it is done."""
        prefill_s = tokens / self.spec.prefill_tokens_per_s
        self.prefill_free_at[r] = max(now_s, self.prefill_free_at[r]) + prefill_s
        self.load_s[r] += prefill_s
        return self.prefill_free_at[r]

    def join(self) -> int:
        """Bring up a fresh replica (a new slot); returns its index."""
        r = len(self.names)
        self.names.append(f"replica-{r:03d}")
        for col, value in ((self.alive, True), (self.version, 0), (self.prefill_free_at, 0.0),
                           (self.active_kv_tokens, 0), (self.in_flight, 0), (self.load_s, 0.0)):
            col.append(value)
        self.live.append(r)
        self.occupancy_by_name[self.names[r]] = 0.0
        return r

    def leave(self, r: int) -> None:
        """Take replica r out of rotation; requests already on it finish."""
        self.alive[r] = False
        self.live.remove(r)
        self._gated.pop(r, None)
        self.occupancy_by_name.pop(self.names[r], None)
