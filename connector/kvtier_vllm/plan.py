"""Scheduler-side bookkeeping: which requests load which blocks, which store, and
the pins held meanwhile. Pure: the sidecar calls go through `lookups.AsyncLookups`
(passed in, its own thread), vLLM is not imported.

Life of a request on the scheduler side:

  lookup     `matched`: one sidecar lookup per new request, started on the lookup
             thread; until it answers (within the budget) vLLM is told "not known
             yet" (None) and asks again; past the budget, or with the breaker open,
             the request is a miss. Once known, the tokens beyond vLLM's own local
             hit, rounded down to vLLM's block size, are offered to vLLM (a re-ask
             reuses the pinned hit).
  allocated  `allocated`: vLLM accepted them and gave the request its blocks: a
             LoadSpec is queued; if it accepted none, the pin is released.
  step       `step_specs`: queued loads go to the workers in this step's metadata,
             and so does a StoreSpec for every request whose prompt finishes its
             prefill in this step (its full blocks, once).
  released   the pin is released once the load has certainly run: two steps after
             its step (vLLM may schedule one step ahead of the one executing), or
             when the request finishes, is aborted, or is preempted and asked again,
             whichever comes first. Every path releases it exactly once.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Sequence

from kvtier.keys import KeyRoot
from kvtier.names import WARMUP_PURPOSE, source_peer
from pydantic import BaseModel, ConfigDict

from .lookups import PENDING, AsyncLookups, PendingLookup


COUNTS = ("lookups", "prompt_tokens", "local_hit_tokens", "hit_tokens", "warmup_lookups", "warmup_prompt_tokens",
          "peer_hints", "peer_hints_invalid")
"""The scheduler side's counts: lookups asked, prompt tokens of new requests, tokens
vLLM's own prefix cache held when they were scheduled, tokens offered and accepted —
of traffic; the rollout's warm-up requests (`kvtier.names.is_warmup`) are counted
apart (warmup_lookups, warmup_prompt_tokens) and in none of the others, so they never
reach the hit figure (`connector.SCHEDULER_REPORTED`). peer_hints: lookups sent with a
router's peer-pull hint; peer_hints_invalid: requests whose hint was malformed and
ignored (`kvtier.names.source_peer`)."""
PIN_STEPS = 2
"""Steps a loaded hit stays pinned: its own, plus the one vLLM may schedule while it runs."""


class LoadSpec(BaseModel):
    """Copy kvtier blocks [first_block, first_block + len(slots)) of a request from
    arena `slots` into its vLLM blocks. `instance` is the sidecar that pinned them:
    a worker mapped to another sidecar reports the load failed."""

    model_config = ConfigDict(frozen=True)

    req_id: str
    instance: str
    first_block: int
    slots: list[int]
    block_ids: list[int]
    digests: list[int] | None = None
    tier: str = "dram"  # where the sidecar found the blocks: "dram" or "peer"
    # A "peer" hit's blocks before this one were already in the sidecar's DRAM (a
    # partly local hit): only the blocks from here on count as the peer's.
    peer_from_block: int = 0
    warmup: bool = False  # the rollout's warm-up request: its loads are not hits of traffic

    def blocks_by_tier(self, loaded: int) -> dict[str, int]:
        """The first `loaded` blocks of this load by the tier they came from."""
        if self.tier != "peer":
            return {self.tier: loaded}
        end = self.first_block + loaded
        peer = max(0, end - max(self.first_block, self.peer_from_block))
        return {"dram": loaded - peer, "peer": peer}


class StoreSpec(BaseModel):
    """Offer the request's full prompt blocks (token_ids) from its vLLM blocks."""

    model_config = ConfigDict(frozen=True)

    req_id: str
    root: dict[str, str]
    token_ids: list[int]
    block_ids: list[int]
    # vLLM's description of the stored blocks for a KV event (events.describe), where
    # vLLM publishes events: the worker emits it once the sidecar committed the store.
    event: dict[str, Any] | None = None


class StepSpecs(BaseModel):
    loads: list[LoadSpec] = []
    stores: list[StoreSpec] = []


def root_fields(root: KeyRoot) -> dict[str, str]:
    return root.to_wire()


def root_from_fields(fields: dict[str, str]) -> KeyRoot:
    return KeyRoot(**fields)


@dataclass(frozen=True, slots=True)
class Hint:
    """A request's peer-pull hint: `peer` (host:port) to send with its lookup, or None
    with `invalid` when kv_transfer_params named one that is not a host:port."""

    peer: str | None
    invalid: bool = False


def read_hint(kv_transfer_params: Any) -> Hint | None:
    """The peer-pull hint of a request's `kv_transfer_params` (None: it names none).
    Strict: only a string host:port is a hint; anything else is ignored (never an error
    for the request) and marked invalid so that it is counted."""
    if kv_transfer_params is None:
        return None  # the common case: no kv_transfer_params at all
    try:
        peer = source_peer(kv_transfer_params)
    except ValueError:
        return Hint(None, invalid=True)
    return None if peer is None else Hint(peer)


@dataclass
class _Request:
    root: KeyRoot
    prompt: list[int]
    local: int = 0              # vLLM's own (block-aligned) hit when asked
    hit: object = None          # a pinned client EngineHit, or None
    pending: PendingLookup | None = None  # the lookup, until it is settled
    asked: bool = True          # looked up, not allocated yet: a re-ask reuses the hit
    block_ids: list[int] = field(default_factory=list)
    stored: bool = False
    event: dict[str, Any] | None = None  # events.describe of the prompt's full blocks
    warmup: bool = False        # the rollout's warm-up request: counted apart from traffic


class SchedulerBook:
    def __init__(self, lookups: AsyncLookups, block_size: int, vllm_block_size: int,
                 verify_checksums: bool) -> None:
        self.lookups = lookups
        self.block_size = block_size
        self.vllm_block_size = vllm_block_size
        self.verify_checksums = verify_checksums
        self._requests: dict[str, _Request] = {}
        self._pending_loads: list[LoadSpec] = []
        self._loaded_steps: collections.deque[list[str]] = collections.deque()
        self.counts = dict.fromkeys(COUNTS, 0)

    # -- lookup -------------------------------------------------------------------------

    def matched(self, req_id: str, root: KeyRoot, prompt: Sequence[int], local_tokens: int,
                wait_s: float = 0.0, warmup: bool = False, hint: Hint | None = None) -> int | None:
        """External tokens beyond `local_tokens` (vLLM's block-aligned local hit); None
        while the lookup runs within its budget (vLLM asks again next step). Waits at
        most `wait_s` for the answer. `warmup`: the rollout's warm-up request, looked up
        with that purpose and counted apart from traffic. `hint`: the request's peer-pull
        hint (`read_hint`), sent with its lookup and counted once."""
        req = self._requests.get(req_id)
        if req is not None and not req.asked:
            # Preempted and asked again: vLLM freed its blocks; start over.
            self._release(req)
            req = None
        if req is None:
            req = _Request(root, list(prompt), warmup=warmup)
            self._requests[req_id] = req
            source_peer = None
            if hint is not None:
                source_peer = hint.peer
                self.counts["peer_hints_invalid" if hint.invalid else "peer_hints"] += 1
            req.pending = self.lookups.start(root, req.prompt, local_tokens, self.verify_checksums,
                                             WARMUP_PURPOSE if warmup else None, source_peer)
            apart = "warmup_" if warmup else ""
            self.counts[apart + "lookups"] += req.pending is not None
            self.counts[apart + "prompt_tokens"] += len(req.prompt)
        if req.pending is not None:
            hit = self.lookups.settle(req.pending, wait_s)
            if hit is PENDING:
                return None
            req.pending, req.hit = None, hit
        req.local = local_tokens
        if req.hit is None:
            return 0
        usable = req.hit.matched_tokens // self.vllm_block_size * self.vllm_block_size
        return max(0, usable - local_tokens)

    def allocated(self, req_id: str, block_ids: Sequence[int], external_tokens: int) -> None:
        req = self._requests.get(req_id)
        if req is None:
            return
        req.block_ids = list(block_ids)
        req.asked = False
        if not req.warmup:
            self.counts["local_hit_tokens"] += req.local
        if external_tokens <= 0 or req.hit is None:
            self._release(req)
            return
        first = req.local // self.block_size
        n = external_tokens // self.block_size
        hit = req.hit
        digests = hit.digests[first : first + n] if hit.digests is not None else None
        self._pending_loads.append(LoadSpec(req_id=req_id, instance=hit.instance, first_block=first,
                                            slots=hit.blocks[first : first + n], block_ids=req.block_ids,
                                            digests=digests, tier=hit.tier,
                                            peer_from_block=(getattr(hit, "dram_tokens", None) or 0) // self.block_size,
                                            warmup=req.warmup))
        if not req.warmup:
            self.counts["hit_tokens"] += external_tokens

    # -- per step -----------------------------------------------------------------------

    def blocks_changed(self, req_id: str, block_ids: Sequence[int], replace: bool) -> None:
        """A running request got more blocks (or, resumed, a whole new list)."""
        req = self._requests.get(req_id)
        if req is None:
            return
        req.block_ids = list(block_ids) if replace else req.block_ids + list(block_ids)

    def step_specs(self, prefill_done: Sequence[str]) -> StepSpecs:
        """This step's loads, and stores for requests whose prompt prefill ends now."""
        specs = StepSpecs(loads=self._pending_loads)
        self._pending_loads = []
        self._loaded_steps.append([spec.req_id for spec in specs.loads])
        if len(self._loaded_steps) > PIN_STEPS:
            for req_id in self._loaded_steps.popleft():
                req = self._requests.get(req_id)
                if req is not None and not req.asked:
                    self._release(req)
        for req_id in prefill_done:
            req = self._requests.get(req_id)
            if req is None or req.stored:
                continue
            req.stored = True
            n = len(req.prompt) // self.block_size
            if n == 0:
                continue
            specs.stores.append(StoreSpec(req_id=req_id, root=root_fields(req.root),
                                          token_ids=req.prompt[: n * self.block_size], block_ids=req.block_ids,
                                          event=req.event))
        return specs

    def take_counts(self) -> dict[str, int]:
        """`COUNTS` since the last call."""
        counts, self.counts = self.counts, dict.fromkeys(COUNTS, 0)
        return counts

    def describe(self, req_id: str, event: dict[str, Any] | None) -> None:
        """Keep vLLM's description of the request's stored blocks for its store's event."""
        req = self._requests.get(req_id)
        if req is not None:
            req.event = event

    def described(self, req_id: str) -> bool:
        req = self._requests.get(req_id)
        return req is not None and req.event is not None

    def prompt_len(self, req_id: str) -> int | None:
        req = self._requests.get(req_id)
        return None if req is None else len(req.prompt)

    # -- end ----------------------------------------------------------------------------

    def finished(self, req_id: str) -> None:
        req = self._requests.pop(req_id, None)
        if req is not None:
            self._release(req)

    def _release(self, req: _Request) -> None:
        if req.pending is not None:
            self.lookups.abandon(req.pending)
            req.pending = None
        if req.hit is not None:
            self.lookups.release(req.hit)
            req.hit = None

    def pinned(self) -> int:
        return sum(1 for r in self._requests.values() if r.hit is not None)
