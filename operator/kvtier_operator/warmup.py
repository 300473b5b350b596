"""Which warm-ups precede a new affinity epoch, and how far a resumed operator got.

For every moved tenant, each home it gained — and a surviving home promoted to first
home (where `routing.pick` now sends the tenant: after a leave it may have seen only
the tenant's spill traffic) — is asked to warm the tenant's hottest
prefixes from an old home: a LEAVER first (a departing pod still draining: it was the
tenant's home, so it holds what the tenant will ask for), else the best-ranked old home
that is still serving; a leaver's request names that surviving home as its fallback,
used when the leaver does not answer. The new home then has the blocks before any
router sends it the tenant's traffic. A tenant whose old homes are all gone has nowhere
to warm from; it starts cold (counted, not hidden).

Bounded: at most `max_bytes_per_tenant` per request and the whole phase within the
policy's warm timeout (the I/O side enforces time). Pure.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvtier.affinity import TenantMove

from kvtier_operator.membership import Member


@dataclass(frozen=True, slots=True)
class WarmTask:
    """One planned warm-up: `target` copies `tenant`'s hottest prefixes from `source`
    (sent as a `control_api.WarmRequest` to the target's `POST /cache/warm`)."""

    tenant: str
    target: str
    source: str
    max_bytes: int
    fallback: str | None = None  # a surviving old home, when `source` is a leaver

    def from_fallback(self) -> "WarmTask | None":
        if self.fallback is None:
            return None
        return WarmTask(self.tenant, self.target, self.fallback, self.max_bytes)

    @property
    def key(self) -> str:
        return f"{self.tenant}@{self.target}"


@dataclass(frozen=True, slots=True)
class WarmPlan:
    requests: tuple[WarmTask, ...]
    cold_tenants: tuple[str, ...]  # moved, but no surviving old home to warm from


def plan(moves: Iterable[TenantMove], members: Mapping[str, Member], max_bytes_per_tenant: int,
         leavers: Mapping[str, Member] | None = None) -> WarmPlan:
    leavers = leavers or {}
    requests: list[WarmTask] = []
    cold: list[str] = []
    for move in moves:
        survivors = [m for m in move.old_homes if m in members]
        departing = [m for m in move.old_homes if m in leavers and m not in members]
        targets = [m for m in warm_targets(move) if m in members]
        if not targets:
            continue
        if departing:
            source, fallback = departing[0], (survivors[0] if survivors else None)
        elif survivors:
            source, fallback = survivors[0], None
        else:
            cold.append(move.tenant)
            continue
        requests += [WarmTask(move.tenant, t, source, max_bytes_per_tenant, fallback if fallback != t else None)
                     for t in targets if t != source]
    return WarmPlan(tuple(requests), tuple(cold))


def warm_targets(move: TenantMove) -> tuple[str, ...]:
    """The homes to warm for a moved tenant: its new first home when that changed (a
    promoted home may have seen only spill traffic; the sidecar skips blocks it has),
    then the homes it gained."""
    first = move.new_homes[:1]
    promoted = first if first and first != move.old_homes[:1] and first[0] not in move.gained else ()
    return tuple(promoted) + move.gained


def members_digest(members: Mapping[str, Member]) -> str:
    """Names the member set a pending epoch was planned for (weights and IPs included)."""
    canon = json.dumps({n: [m.ip, m.weight] for n, m in sorted(members.items())}, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


@dataclass(slots=True)
class PendingEpoch:
    """The warm-up journal kept in the policy's `kvtier.io/pending-epoch` annotation.

    Written before the first warm-up of an epoch and again as each warm-up finishes
    (coalesced: one write in flight), cleared when the epoch is published. A restarted
    operator that plans the same epoch for the same members skips the warm-ups listed
    in `done`; one that finished after the last write is asked again with the same ref
    (`ref_prefix`), which the sidecar answers with its existing job. Any other plan
    starts a fresh journal.
    """

    epoch: int
    members: str
    done: set[str] = field(default_factory=set)

    def to_json(self) -> str:
        return json.dumps({"epoch": self.epoch, "members": self.members, "done": sorted(self.done)})

    @classmethod
    def from_json(cls, text: str | None) -> "PendingEpoch | None":
        if not text:
            return None
        try:
            raw = json.loads(text)
            return cls(int(raw["epoch"]), str(raw["members"]), set(raw.get("done", [])))
        except (ValueError, KeyError, TypeError):
            return None  # a mangled journal only costs repeating warm-ups

    @property
    def ref_prefix(self) -> str:
        """Names this epoch's warm-ups to the sidecars (their idempotency refs)."""
        return f"e{self.epoch}-{self.members}"

    def matches(self, epoch: int, digest: str) -> bool:
        return self.epoch == epoch and self.members == digest

    def remaining(self, requests: Iterable[WarmTask]) -> list[WarmTask]:
        return [r for r in requests if r.key not in self.done]
