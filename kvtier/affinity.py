"""The affinity table and the planner that moves tenants when membership changes.

The table is what the operator publishes (ConfigMap, Redis) and routers read: an
epoch, the members with their weights, k, and the spill knobs. It carries no
per-tenant list, because every reader recomputes a tenant's homes with weighted
rendezvous hashing (`kvtier.rendezvous`), which makes it a few hundred bytes per
hundred members.

The planner compares two tables over the tenants the operator knows about and
says which tenants moved, so the operator can warm each moved tenant's hot
prefixes on its new homes before publishing the new epoch. It is incremental:

    join    -> score only the newcomer per tenant; a tenant moves iff the
               newcomer beats its current k-th score (about k/(n+1) of them)
    leave   -> recompute only the tenants the departed member was home to
    reweigh -> both of the above, for that member

The `Assignment` a plan returns is the state to pass to the next plan; without
one the planner recomputes the old assignment from scratch (still correct,
just slower).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic.alias_generators import to_camel

from kvtier import rendezvous
from kvtier.rendezvous import RENDEZVOUS_VERSION

# Three homes per tenant: a hot tenant can use three replicas' capacity, and
# 2,000 tenants over 44 replicas put ~136 tenants (~311 GiB) on each replica,
# which fits one host's DRAM tier (DESIGN "The numbers").
DEFAULT_HOMES = 3
# KV occupancy is a cliff: above ~85-95% preemption re-prefills whole prompts.
DEFAULT_SPILL_OCCUPANCY = 0.85
# Spill only off a home that is also this far above the fleet mean: when the
# whole fleet is full, moving a tenant trades its cache hits for nothing.
# 1.25 is the classic bound of consistent hashing with bounded loads.
DEFAULT_BALANCE_FACTOR = 1.25
# A spilled tenant returns only once its home is this far below the spill
# thresholds, so a home hovering at the threshold does not flap tenants.
DEFAULT_HYSTERESIS = 0.05


class AffinityTable(BaseModel):
    """One epoch of tenant affinity: members, weights, k homes and spill knobs.

    Serialised with camelCase keys (`spillOccupancy`, `balanceFactor`), the same
    spelling as the KVCachePolicy spec. Immutable: a change is a new table with a
    new epoch, made by `plan_membership_change`.
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, alias_generator=to_camel, extra="forbid")

    rendezvous_version: int = Field(default=RENDEZVOUS_VERSION, description="scoring version; readers refuse others")
    epoch: int = Field(default=0, ge=0)
    members: dict[str, float] = Field(default_factory=dict, description="member name -> weight (capacity), > 0")
    homes: int = Field(default=DEFAULT_HOMES, ge=1, le=64)
    spill_occupancy: float = Field(default=DEFAULT_SPILL_OCCUPANCY, gt=0.0, le=1.0)
    balance_factor: float = Field(default=DEFAULT_BALANCE_FACTOR, ge=1.0, le=100.0)
    hysteresis: float = Field(default=DEFAULT_HYSTERESIS, ge=0.0, lt=1.0)

    _ranked: tuple[dict, list[str], np.ndarray, np.ndarray] | None = PrivateAttr(default=None)

    @field_validator("rendezvous_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != RENDEZVOUS_VERSION:
            raise ValueError(
                f"affinity table uses rendezvous version {v}, this reader knows {RENDEZVOUS_VERSION}: "
                "upgrade the reader before routing with it"
            )
        return v

    @field_validator("members")
    @classmethod
    def _valid_members(cls, members: dict[str, float]) -> dict[str, float]:
        for name, weight in members.items():
            if not name:
                raise ValueError("member names must be non-empty")
            if not (np.isfinite(weight) and weight > 0):
                raise ValueError(f"member {name!r} has weight {weight!r}; weights must be finite and > 0")
        return dict(sorted(members.items()))

    @model_validator(mode="after")
    def _watermark_below_threshold(self) -> AffinityTable:
        if self.hysteresis >= self.spill_occupancy:
            raise ValueError(
                f"hysteresis {self.hysteresis} must be below spillOccupancy {self.spill_occupancy}: "
                "a spilled tenant could never return"
            )
        return self

    def order_for(self, tenant: str) -> list[str]:
        """Every member in the tenant's rendezvous order: its homes, then its spill path."""
        names, hashes, weights = self._member_arrays()
        if not names:
            return []
        t = np.array([rendezvous.tenant_hash(tenant)], dtype=np.uint64)
        scores = rendezvous.score_matrix(t, hashes, weights)[0]
        return [names[i] for i in np.argsort(-scores, kind="stable")]

    def homes_for(self, tenant: str) -> list[str]:
        """The tenant's k homes, best first (all members if there are fewer than k)."""
        return self.order_for(tenant)[: self.homes]

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> AffinityTable:
        return cls.model_validate_json(text)

    def _member_arrays(self) -> tuple[list[str], np.ndarray, np.ndarray]:
        # Cached per members dict: `model_copy(update={"members": ...})` brings a new
        # dict (and skips validation), so the identity check keeps the cache honest.
        cached = self._ranked
        if cached is None or cached[0] is not self.members:
            names = sorted(self.members)
            cached = self._ranked = (
                self.members,
                names,
                rendezvous.member_hashes(names),
                np.array([self.members[n] for n in names], dtype=np.float64),
            )
        return cached[1], cached[2], cached[3]


@dataclass(slots=True)
class Assignment:
    """Every known tenant's homes under one table, as arrays the planner updates.

    `homes[i]` holds indices into `members` (sorted names), best first;
    `kth_score[i]` is the score of tenant i's last home, the bar a newcomer must beat.
    """

    tenants: list[str]
    t_hashes: np.ndarray
    members: list[str]
    homes: np.ndarray
    kth_score: np.ndarray
    fingerprint: tuple
    _row: dict[str, int] = field(default_factory=dict)

    def homes_of(self, tenant: str) -> list[str]:
        if not self._row:
            self._row = {t: i for i, t in enumerate(self.tenants)}
        return [self.members[j] for j in self.homes[self._row[tenant]]]

    def loads(self) -> dict[str, int]:
        """How many tenants each member is a home to."""
        counts = np.bincount(self.homes.ravel(), minlength=len(self.members))
        return {m: int(c) for m, c in zip(self.members, counts)}


@dataclass(slots=True, frozen=True)
class TenantMove:
    """A tenant whose homes changed: where it was, where it is, who gained it."""

    tenant: str
    old_homes: tuple[str, ...]
    new_homes: tuple[str, ...]

    @property
    def gained(self) -> tuple[str, ...]:
        """New homes that were not homes before: the warm-up targets."""
        return tuple(m for m in self.new_homes if m not in self.old_homes)

    @property
    def lost(self) -> tuple[str, ...]:
        return tuple(m for m in self.old_homes if m not in self.new_homes)


@dataclass(slots=True)
class MembershipPlan:
    """The new table (epoch + 1 when anything changed) and the tenants that moved."""

    table: AffinityTable
    moves: list[TenantMove]
    assignment: Assignment
    joined: list[str]
    left: list[str]
    reweighted: list[str]
    old_epoch: int

    @property
    def changed(self) -> bool:
        """True when the table is a new epoch (members, weights or k changed)."""
        return self.table.epoch != self.old_epoch

    @property
    def movement_fraction(self) -> float:
        n = len(self.assignment.tenants)
        return len(self.moves) / n if n else 0.0


def assign(table: AffinityTable, tenants: Sequence[str]) -> Assignment:
    """Every tenant's homes under `table`, computed from scratch (vectorised)."""
    names, m_hashes, weights = table._member_arrays()
    t_hashes = rendezvous.tenant_hashes(tenants)
    homes, scores = rendezvous.top_k_many(t_hashes, m_hashes, weights, table.homes)
    return Assignment(list(tenants), t_hashes, names, homes, _kth(scores), _fingerprint(table))


def plan_membership_change(
    old_table: AffinityTable,
    new_members: Mapping[str, float],
    tenants: Sequence[str],
    *,
    current: Assignment | None = None,
    homes: int | None = None,
) -> MembershipPlan:
    """Plan the move from `old_table` to `new_members` (and optionally a new k).

    `tenants` are the tenants to report moves for (known from sidecar stats);
    `current` is the previous plan's assignment, reused when it matches
    `old_table`. Spill knobs never move tenants; change them with
    `table.model_copy(update=...)`. With nothing changed the table keeps its
    epoch and no tenant moves, so a level-triggered caller can plan freely.
    """
    new_table = AffinityTable.model_validate(
        {**old_table.model_dump(), "members": dict(new_members), "homes": homes or old_table.homes}
    )
    joined = sorted(set(new_table.members) - set(old_table.members))
    left = sorted(set(old_table.members) - set(new_table.members))
    reweighted = sorted(
        m for m in set(new_table.members) & set(old_table.members) if new_table.members[m] != old_table.members[m]
    )
    before = _aligned(current, old_table, tenants)
    if not (joined or left or reweighted) and new_table.homes == old_table.homes:
        return MembershipPlan(old_table, [], before, [], [], [], old_table.epoch)
    new_table = new_table.model_copy(update={"epoch": old_table.epoch + 1})
    if _needs_full_recompute(old_table, new_table):
        after = assign(new_table, before.tenants)
    else:
        after = _incremental(before, new_table, joined + reweighted, left + reweighted)
    return MembershipPlan(
        new_table, _moves(before, after), after, joined, left, reweighted, old_table.epoch
    )


def load_imbalance(assignment: Assignment, table: AffinityTable) -> float:
    """max / mean of home load per unit weight (1.0 is perfect balance)."""
    loads = assignment.loads()
    if not loads:
        return 1.0
    per_weight = np.array([loads[m] / table.members[m] for m in assignment.members])
    total_weight = sum(table.members[m] for m in assignment.members)
    mean = sum(loads.values()) / total_weight
    return float(per_weight.max() / mean) if mean else 1.0


def _incremental(before: Assignment, new_table: AffinityTable, entrants: list[str], leavers: list[str]) -> Assignment:
    """Recompute only the rows a join, leave or reweigh can change (see module doc)."""
    names, m_hashes, weights = new_table._member_arrays()
    new_index = {m: i for i, m in enumerate(names)}
    remap = np.array([new_index.get(m, -1) for m in before.members], dtype=np.int32)
    homes = remap[before.homes] if before.homes.size else before.homes.copy()
    kth = before.kth_score.copy()

    affected = np.zeros(len(before.tenants), dtype=bool)
    leaver_old_idx = [i for i, m in enumerate(before.members) if m in set(leavers)]
    if leaver_old_idx:
        affected |= np.isin(before.homes, leaver_old_idx).any(axis=1)
    if entrants:
        idx = [new_index[m] for m in entrants]
        entrant_scores = rendezvous.score_matrix(before.t_hashes, m_hashes[idx], weights[idx])
        # >= rather than >: an exact tie is resolved by a full recompute of the row.
        affected |= entrant_scores.max(axis=1) >= kth

    rows = np.flatnonzero(affected)
    if len(rows):
        h, s = rendezvous.top_k_many(before.t_hashes[rows], m_hashes, weights, new_table.homes)
        homes[rows] = h
        kth[rows] = _kth(s)
    return Assignment(before.tenants, before.t_hashes, names, homes, kth, _fingerprint(new_table))


def _moves(before: Assignment, after: Assignment) -> list[TenantMove]:
    old_names = np.array(before.members + [""], dtype=object)  # index -1 never occurs in `before`
    new_names = np.array(after.members + [""], dtype=object)
    old_h = old_names[before.homes] if before.homes.size else np.empty((len(before.tenants), 0), dtype=object)
    new_h = new_names[after.homes] if after.homes.size else np.empty((len(after.tenants), 0), dtype=object)
    if old_h.shape == new_h.shape:
        moved = np.flatnonzero((old_h != new_h).any(axis=1))
    else:
        moved = np.arange(len(before.tenants))
    return [TenantMove(before.tenants[i], tuple(old_h[i]), tuple(new_h[i])) for i in moved]


def _aligned(current: Assignment | None, table: AffinityTable, tenants: Sequence[str]) -> Assignment:
    """`current` restricted/extended to `tenants`, or a fresh assignment if it is stale."""
    if current is None or current.fingerprint != _fingerprint(table):
        return assign(table, tenants)
    if current.tenants == list(tenants):
        return current
    row = {t: i for i, t in enumerate(current.tenants)}
    known = [row.get(t, -1) for t in tenants]
    missing = [t for t, r in zip(tenants, known) if r < 0]
    fresh = assign(table, missing)
    fresh_row = {t: i for i, t in enumerate(missing)}
    homes = np.empty((len(tenants), current.homes.shape[1]), dtype=np.int32)
    kth = np.empty(len(tenants), dtype=np.float64)
    for i, (t, r) in enumerate(zip(tenants, known)):
        src, j = (current, r) if r >= 0 else (fresh, fresh_row[t])
        homes[i], kth[i] = src.homes[j], src.kth_score[j]
    return Assignment(list(tenants), rendezvous.tenant_hashes(tenants), current.members, homes, kth, current.fingerprint)


def _needs_full_recompute(old: AffinityTable, new: AffinityTable) -> bool:
    # The k-th-score shortcut assumes every tenant has exactly k homes before and after.
    return old.homes != new.homes or len(old.members) < old.homes or len(new.members) < new.homes


def _kth(scores: np.ndarray) -> np.ndarray:
    if scores.shape[1] == 0:
        return np.full(scores.shape[0], -np.inf)
    return scores[:, -1].copy()


def _fingerprint(table: AffinityTable) -> tuple:
    return (table.homes, json.dumps(table.members, sort_keys=True))
