"""The affinity table and the planner that moves tenants when membership changes.

The table is what the operator publishes (ConfigMap, Redis) and routers read: an
epoch, the members with their weights, k, the spill knobs, and `homeOverrides`.
Every reader recomputes a tenant's homes with weighted rendezvous hashing
(`kvtier.rendezvous`); the overrides list exactly the known tenants whose homes
differ from plain rendezvous because plain rendezvous would put a member above
balanceFactor x its fair share of homes (bounded loads, see
`rendezvous.bounded_top_k`). Routers cannot recompute that without the tenant
list, so the operator ships it: ~100 entries for 20,000 tenants on 1,000 pods.
Tenants the planner did not know about use plain rendezvous until the next plan.

The planner compares two tables over the tenants the operator knows about and
says which tenants moved, so the operator can warm each moved tenant's hot
prefixes on its new homes before publishing the new epoch. The expensive part,
each tenant's rendezvous order over ~1,000 members, is kept incremental:

    join    -> score only the newcomer per tenant; a tenant's order changes iff
               the newcomer beats the last member of its ranked prefix
    leave   -> re-rank only the tenants whose ranked prefix held the departed member
    reweigh -> both of the above, for that member

then the bounded assignment is re-solved over the ranked prefixes (~20 ms for
20,000 tenants). A join still moves about k/(n+1) of tenants and a leave the
departed member's tenants, plus the few the caps displace (bench_affinity
measures how many). The `Assignment` a plan returns is the state to pass to the
next plan; without one the planner re-ranks from scratch (still correct, slower).
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
# which fits one host's DRAM tier (docs/ARCHITECTURE.md "The numbers").
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
# Members ranked per tenant past its k homes: a tenant the caps turn away takes
# the next one, and five spare ranks cover almost every chain; deeper ranks are
# computed on demand, so this is a speed knob, never a correctness one.
CANDIDATE_SLACK = 5


class AffinityTable(BaseModel):
    """One epoch of tenant affinity: members, weights, k homes, spill knobs, overrides.

    Serialised with camelCase keys (`spillOccupancy`, `balanceFactor`), the same
    spelling as the KVCachePolicy spec. Immutable: a change is a new table with a
    new epoch, made by `plan_membership_change`. Invariant: every override names
    min(k, members) distinct members of this table.
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, alias_generator=to_camel, extra="forbid")

    rendezvous_version: int = Field(default=RENDEZVOUS_VERSION, description="scoring version; readers refuse others")
    epoch: int = Field(default=0, ge=0)
    members: dict[str, float] = Field(default_factory=dict, description="member name -> weight (capacity), > 0")
    homes: int = Field(default=DEFAULT_HOMES, ge=1, le=64)
    spill_occupancy: float = Field(default=DEFAULT_SPILL_OCCUPANCY, gt=0.0, le=1.0)
    balance_factor: float = Field(default=DEFAULT_BALANCE_FACTOR, ge=1.0, le=100.0)
    hysteresis: float = Field(default=DEFAULT_HYSTERESIS, ge=0.0, lt=1.0)
    home_overrides: dict[str, list[str]] = Field(
        default_factory=dict,
        description="tenant -> its homes, best first, only where they differ from plain rendezvous (bounded loads)",
    )

    _ranked: _MemberArrays | None = PrivateAttr(default=None)

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

    @model_validator(mode="after")
    def _overrides_name_members(self) -> AffinityTable:
        want = min(self.homes, len(self.members))
        for tenant, homes in self.home_overrides.items():
            if not tenant:
                raise ValueError("homeOverrides: tenant names must be non-empty")
            if len(homes) != want or len(set(homes)) != want or not set(homes) <= self.members.keys():
                raise ValueError(
                    f"homeOverrides[{tenant!r}] = {homes}: must name {want} distinct members of this table"
                )
        return self

    def order_for(self, tenant: str) -> list[str]:
        """Every member in the tenant's order: its homes, then its spill path (rendezvous order)."""
        names, hashes, weights = self._member_arrays()
        if not names:
            return []
        t = np.array([rendezvous.tenant_hash(tenant)], dtype=np.uint64)
        scores = rendezvous.score_matrix(t, hashes, weights)[0]
        order = [names[i] for i in np.argsort(-scores, kind="stable")]
        homes = self.home_overrides.get(tenant)
        if homes is None:
            return order
        return list(homes) + [m for m in order if m not in homes]

    def homes_for(self, tenant: str) -> list[str]:
        """The tenant's k homes, best first (all members if there are fewer than k)."""
        homes = self.home_overrides.get(tenant)
        return list(homes) if homes is not None else self.order_for(tenant)[: self.homes]

    def home_caps(self, n_tenants: int) -> dict[str, int]:
        """Most homes each member may hold when `n_tenants` tenants are planned:
        ceil(balanceFactor x its capacity-weighted fair share)."""
        names, _, weights = self._member_arrays()
        if not names:
            return {}
        caps = rendezvous.home_caps(weights, n_tenants, self.homes, self.balance_factor)
        return {m: int(c) for m, c in zip(names, caps)}

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> AffinityTable:
        return cls.model_validate_json(text)

    def _member_arrays(self) -> tuple[list[str], np.ndarray, np.ndarray]:
        # Cached per members dict: `model_copy(update={"members": ...})` brings a new
        # dict (and skips validation), so the identity check keeps the cache honest.
        cached = self._ranked
        if cached is None or cached.source is not self.members:
            cached = self._ranked = _MemberArrays(self.members)
        return cached.names, cached.hashes, cached.weights


class _MemberArrays:
    """Sorted member names, hashes and weights of one members dict: a derived cache,
    so it never makes two tables unequal (pydantic compares private attributes)."""

    __slots__ = ("source", "names", "hashes", "weights")

    def __init__(self, members: dict[str, float]) -> None:
        self.source = members
        self.names = sorted(members)
        self.hashes = rendezvous.member_hashes(self.names)
        self.weights = np.array([members[n] for n in self.names], dtype=np.float64)

    def __eq__(self, other: object) -> bool:
        return other is None or isinstance(other, _MemberArrays)

    __hash__ = None  # type: ignore[assignment]


@dataclass(slots=True)
class Assignment:
    """Every known tenant's homes under one table, as arrays the planner updates.

    `homes[i]` holds indices into `members` (sorted names), best first: what
    routers use, plain rendezvous or the table's override. `ranked[i]` is tenant
    i's first `depth` members in plain rendezvous order and `ranked_scores[i]`
    their scores; `ranked_scores[i, -1]` is the bar a newcomer must beat to
    change tenant i's order. `fingerprint` names the members and depth the
    ranking is for, so a stale assignment is recomputed, never trusted.
    """

    tenants: list[str]
    t_hashes: np.ndarray
    members: list[str]
    homes: np.ndarray
    ranked: np.ndarray
    ranked_scores: np.ndarray
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

    def overrides(self) -> dict[str, list[str]]:
        """Tenants whose homes differ from their plain rendezvous top k: the table's override map."""
        kk = self.homes.shape[1]
        differ = np.flatnonzero((self.homes != self.ranked[:, :kk]).any(axis=1))
        return {self.tenants[i]: [self.members[j] for j in self.homes[i]] for i in differ}


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
    """The new table (epoch + 1 when any known tenant's homes, the members or k
    changed) and the tenants that moved. `over_cap_tenants` counts tenants that
    found no member with room and sit above a cap (0 unless the caps are
    infeasible for the fleet, e.g. k close to the member count)."""

    table: AffinityTable
    moves: list[TenantMove]
    assignment: Assignment
    joined: list[str]
    left: list[str]
    reweighted: list[str]
    old_epoch: int
    over_cap_tenants: int = 0

    @property
    def changed(self) -> bool:
        """True when the table is a new epoch."""
        return self.table.epoch != self.old_epoch

    @property
    def movement_fraction(self) -> float:
        n = len(self.assignment.tenants)
        return len(self.moves) / n if n else 0.0


def assign(table: AffinityTable, tenants: Sequence[str]) -> Assignment:
    """Every tenant's homes as `table` gives them (plain rendezvous + its overrides)."""
    return _aligned(None, table, tenants)


def bounded_assign(table: AffinityTable, tenants: Sequence[str]) -> Assignment:
    """Every tenant's homes with bounded loads under `table`'s members, k and
    balanceFactor, from scratch; the table's own overrides are ignored."""
    ranking = _aligned(None, table, tenants)
    homes, _ = _bounded(ranking, table)
    ranking.homes = homes
    return ranking


def with_bounded_loads(table: AffinityTable, tenants: Sequence[str]) -> AffinityTable:
    """`table` (same epoch) with the override map that bounds `tenants`' home loads:
    how a table is first made when the fleet and its tenants are known at once."""
    return table.model_copy(update={"home_overrides": bounded_assign(table, tenants).overrides()})


def plan_membership_change(
    old_table: AffinityTable,
    new_members: Mapping[str, float],
    tenants: Sequence[str],
    *,
    current: Assignment | None = None,
    homes: int | None = None,
) -> MembershipPlan:
    """Plan the move from `old_table` to `new_members` (and optionally a new k).

    `tenants` are the tenants to plan and report moves for (known from sidecar
    stats); `current` is the previous plan's assignment, reused when it matches
    `old_table`'s members. The new homes are the bounded assignment under the
    new members and `old_table`'s balanceFactor, so a changed balanceFactor
    (set with `table.model_copy(update=...)`) re-plans too. With nothing that
    changes a known tenant's homes the table keeps its epoch and no tenant
    moves, so a level-triggered caller can plan freely.
    """
    tenants = _unique(tenants)
    new_table = AffinityTable.model_validate({
        **old_table.model_dump(exclude={"home_overrides"}),
        "members": dict(new_members), "homes": homes or old_table.homes,
    })
    joined = sorted(set(new_table.members) - set(old_table.members))
    left = sorted(set(old_table.members) - set(new_table.members))
    reweighted = sorted(
        m for m in set(new_table.members) & set(old_table.members) if new_table.members[m] != old_table.members[m]
    )
    before = _aligned(current, old_table, tenants)
    reshaped = bool(joined or left or reweighted) or new_table.homes != old_table.homes
    if not reshaped:
        ranking = _copy(before)
    elif _needs_full_recompute(old_table, new_table):
        ranking = _aligned(None, new_table, tenants)
    else:
        ranking = _incremental(before, new_table, joined + reweighted, left + reweighted)
    ranking.homes, over_cap = _bounded(ranking, new_table)
    if not reshaped and np.array_equal(ranking.homes, before.homes):
        return MembershipPlan(old_table, [], before, [], [], [], old_table.epoch)
    new_table = new_table.model_copy(
        update={"epoch": old_table.epoch + 1, "home_overrides": ranking.overrides()}
    )
    return MembershipPlan(
        new_table, _moves(before, ranking), ranking, joined, left, reweighted, old_table.epoch, over_cap
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


def _bounded(ranking: Assignment, table: AffinityTable) -> tuple[np.ndarray, int]:
    """Bounded homes for the ranked tenants under `table` (see `rendezvous.bounded_top_k`)."""
    names, m_hashes, weights = table._member_arrays()
    if not names:
        return np.empty((len(ranking.tenants), 0), dtype=np.int32), 0
    caps = rendezvous.home_caps(weights, len(ranking.tenants), table.homes, table.balance_factor)
    return rendezvous.bounded_top_k(
        ranking.t_hashes, m_hashes, weights, table.homes, caps, (ranking.ranked, ranking.ranked_scores)
    )


def _incremental(before: Assignment, new_table: AffinityTable, entrants: list[str], leavers: list[str]) -> Assignment:
    """Re-rank only the rows a join, leave or reweigh can change (see module doc)."""
    names, m_hashes, weights = new_table._member_arrays()
    new_index = {m: i for i, m in enumerate(names)}
    remap = np.array([new_index.get(m, -1) for m in before.members], dtype=np.int32)
    ranked = remap[before.ranked] if before.ranked.size else before.ranked.copy()
    scores = before.ranked_scores.copy()

    affected = np.zeros(len(before.tenants), dtype=bool)
    leaver_old_idx = [i for i, m in enumerate(before.members) if m in set(leavers)]
    if leaver_old_idx:
        affected |= np.isin(before.ranked, leaver_old_idx).any(axis=1)
    if entrants:
        idx = [new_index[m] for m in entrants]
        entrant_scores = rendezvous.score_matrix(before.t_hashes, m_hashes[idx], weights[idx])
        # >= rather than >: an exact tie is resolved by re-ranking the row.
        affected |= entrant_scores.max(axis=1) >= scores[:, -1]

    rows = np.flatnonzero(affected)
    if len(rows):
        ranked[rows], scores[rows] = rendezvous.top_k_many(before.t_hashes[rows], m_hashes, weights, _depth(new_table))
    return Assignment(before.tenants, before.t_hashes, names, ranked[:, : new_table.homes].copy(), ranked, scores,
                      _fingerprint(new_table))


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
    """The homes `table` gives `tenants`, re-using `current`'s ranking where it is for
    the same members. Homes always come from the table itself (plain top k plus its
    overrides): they are what routers used, whatever computed `current`."""
    tenants = list(tenants)
    names, m_hashes, weights = table._member_arrays()
    if current is not None and current.tenants and current.fingerprint == _fingerprint(table):
        t_hashes, ranked, scores = _restricted(current, tenants)
    else:
        t_hashes = rendezvous.tenant_hashes(tenants)
        ranked, scores = rendezvous.top_k_many(t_hashes, m_hashes, weights, _depth(table)) if names else (
            np.empty((len(tenants), 0), dtype=np.int32), np.empty((len(tenants), 0)))
    homes = ranked[:, : table.homes].copy()
    if table.home_overrides:
        index = {m: i for i, m in enumerate(names)}
        for i, t in enumerate(tenants):
            override = table.home_overrides.get(t)
            if override is not None:
                homes[i] = [index[m] for m in override]
    return Assignment(tenants, t_hashes, names, homes, ranked, scores, _fingerprint(table))


def _restricted(current: Assignment, tenants: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`current`'s ranking rows for `tenants`, ranking the tenants it lacks afresh."""
    if current.tenants == tenants:
        return current.t_hashes, current.ranked, current.ranked_scores
    row = {t: i for i, t in enumerate(current.tenants)}
    known = np.fromiter((row.get(t, -1) for t in tenants), dtype=np.int64, count=len(tenants))
    t_hashes = rendezvous.tenant_hashes(tenants)
    ranked = current.ranked[np.maximum(known, 0)]
    scores = current.ranked_scores[np.maximum(known, 0)]
    missing = np.flatnonzero(known < 0)
    if len(missing) and ranked.shape[1]:
        _, m_hashes, weights = _arrays_of(current)
        ranked[missing], scores[missing] = rendezvous.top_k_many(t_hashes[missing], m_hashes, weights, ranked.shape[1])
    return t_hashes, ranked, scores


def _arrays_of(current: Assignment) -> tuple[list[str], np.ndarray, np.ndarray]:
    members = json.loads(current.fingerprint[1])
    return current.members, rendezvous.member_hashes(current.members), np.array([members[m] for m in current.members])


def _copy(a: Assignment) -> Assignment:
    return Assignment(a.tenants, a.t_hashes, a.members, a.homes.copy(), a.ranked, a.ranked_scores, a.fingerprint)


def _unique(tenants: Sequence[str]) -> list[str]:
    tenants = list(tenants)
    if len(set(tenants)) != len(tenants):
        raise ValueError("tenants must be unique: each tenant is planned once")
    return tenants


def _depth(table: AffinityTable) -> int:
    """How far each tenant's rendezvous order is ranked: its homes plus slack."""
    return min(len(table.members), table.homes + CANDIDATE_SLACK)


def _needs_full_recompute(old: AffinityTable, new: AffinityTable) -> bool:
    # The last-ranked-score shortcut assumes the same ranking depth before and after.
    return old.homes != new.homes or _depth(old) != _depth(new)


def _fingerprint(table: AffinityTable) -> tuple:
    return (_depth(table), json.dumps(table.members, sort_keys=True))
