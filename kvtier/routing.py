"""Which replica serves a tenant's request: its first cool home, else a sticky spill.

`pick` walks the tenant's rendezvous order (its k homes first, then the rest of
the fleet) and takes the first member that is not hot:

    hot(m)  = occupancy(m) > spillOccupancy  AND  occupancy(m) > balanceFactor x fleet mean
    cool(m) = occupancy(m) < spillOccupancy - hysteresis
              OR occupancy(m) < balanceFactor x fleet mean - hysteresis

Preferring the FIRST home (not the least loaded one) concentrates a tenant's
prefixes on one replica, which is where its hit rate comes from; the other homes
take over deterministically when it runs hot, and they are where the operator
warms a tenant's prefixes on a membership change. Past the homes the request
spills: every router computes the same order, so spill is deterministic.

Spill is sticky: with a `SpillState`, a tenant that moved off a better-ranked
member returns to it only once that member is cool, not merely not-hot, so a
home hovering at the threshold does not flap its tenants back and forth.
Members with no occupancy report are treated as empty and left out of the mean.

A tenant's homes are the table's: its `homeOverrides` entry when the operator
bounded the home loads, else plain rendezvous. The spill path past the homes is
always the tenant's rendezvous order over the remaining members.

While the operator rolls a new weights version, `versions` (member -> the weights
version its pod serves) screens the order first (`screen`): a tenant follows the
version of its first home that has one, and is walked only over members of that
version. Its first home is the pod the rollout warmed for it before it became
Ready, and a user must not flip between model versions from one request to the
next, so a tenant never spills onto the other version, however hot its own is.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.affinity import AffinityTable


@dataclass(slots=True, frozen=True)
class Pick:
    """Where a request goes. `rank` is the member's position in the tenant's
    rendezvous order (0 = first home); `spilled` means it is not one of the homes.

    A screened pick (`versions`) reports the same: rank in the tenant's whole order,
    spilled when the member is not one of its homes. A tenant whose homes the
    rollout split across versions can be picked off its homes with every
    same-version home cool, and that is a spill: the member holds none of its
    prefixes, whatever the reason it was the best one."""

    member: str
    rank: int
    spilled: bool
    epoch: int


@dataclass(slots=True)
class SpillState:
    """Per-router memory of tenants routed off their first choice.

    Maps tenant -> member it was moved to, and the table epoch that decision was
    made under; a new epoch forgets it (the tenant's order has changed anyway).
    """

    moved_to: dict[str, str] = field(default_factory=dict)
    epoch: int = -1

    def spilled_tenants(self) -> dict[str, str]:
        return dict(self.moved_to)


def homes_for(tenant: str, table: AffinityTable) -> list[str]:
    """The tenant's k homes, best first, as the table gives them (override, else rendezvous)."""
    return table.homes_for(tenant)


def screen(order: Sequence[str], versions: Mapping[str, str]) -> list[str]:
    """The members of `order` a tenant may be routed to while versions differ: those
    whose version is the version of the first member of `order` that has one.

    That member is the tenant's first home unless its version is unknown (a pod
    without the label yet): the tenant then follows the next home that says. A
    member with no known version is dropped once the tenant's version is known (it
    may serve either); with no versioned member at all, or no `versions`, the order
    is returned unchanged (as a new list), as if every pod served the same weights.
    """
    ordered = list(order)
    version = next((v for v in map(versions.get, ordered) if v is not None), None)
    if version is None:
        return ordered
    return [m for m in ordered if versions.get(m) == version]


def pick(
    tenant: str,
    table: AffinityTable,
    occupancy: Mapping[str, float],
    state: SpillState | None = None,
    versions: Mapping[str, str] | None = None,
) -> Pick:
    """Choose the member for one request of `tenant` (see module doc for the rule),
    among the members `screen(order, versions)` leaves when `versions` is given.

    Raises ValueError if the table has no members: there is nowhere to route.
    """
    order, chosen = pick_rank(tenant, table, occupancy, state, versions)
    return Pick(order[chosen], chosen, chosen >= table.homes, table.epoch)


def pick_rank(
    tenant: str,
    table: AffinityTable,
    occupancy: Mapping[str, float],
    state: SpillState | None = None,
    versions: Mapping[str, str] | None = None,
) -> tuple[list[str], int]:
    """`pick` as (the tenant's order, the chosen member's rank in it), without the
    `Pick` (a simulator routes a million requests through it).

    With `versions`, the walk and the spill memory run over the screened order
    (a tenant "moved off its first choice" left the first member of its version);
    the rank returned is still in the whole order. Without, nothing is screened and
    the path is the unversioned one, two checks longer."""
    order = table.order_for(tenant)
    if not order:
        raise ValueError("affinity table has no members: nowhere to route")
    if state is not None and state.epoch != table.epoch:
        state.moved_to.clear()
        state.epoch = table.epoch
    walked = order if not versions else screen(order, versions)
    gate = _Gate(table, occupancy)
    sticky = state.moved_to.get(tenant) if state is not None else None
    sticky_rank = walked.index(sticky) if sticky is not None and sticky in walked else None

    chosen = _walk(walked, gate, sticky_rank)
    if state is not None:
        if chosen == 0:
            state.moved_to.pop(tenant, None)
        else:
            state.moved_to[tenant] = walked[chosen]
    return order, chosen if walked is order else order.index(walked[chosen])


def _walk(order: list[str], gate: _Gate, sticky_rank: int | None) -> int:
    """Rank of the first acceptable member: cool if it ranks above the sticky
    choice, merely not hot otherwise. If stickiness rules out everyone, drop it."""
    for rank, member in enumerate(order):
        better_than_sticky = sticky_rank is not None and rank < sticky_rank
        if gate.cool(member) if better_than_sticky else not gate.hot(member):
            return rank
    # Not every member can be above balanceFactor x the mean, so this finds one.
    return next((rank for rank, m in enumerate(order) if not gate.hot(m)), 0)


class _Gate:
    """The hot / cool tests for one routing decision (one fleet-mean computation).

    The fleet mean is computed only when a test needs it: `hot` reads it only past
    `spillOccupancy`, `cool` only at or above `spillOccupancy - hysteresis`, so a fleet
    below those never sums its members. It is the same sum whenever it is made, since
    the occupancy does not change within one decision."""

    __slots__ = ("_occ", "_members", "_spill", "_low", "_balance", "_hysteresis", "_balance_hot", "_balance_low")

    def __init__(self, table: AffinityTable, occupancy: Mapping[str, float]):
        self._occ = occupancy
        self._members = table.members
        self._spill = table.spill_occupancy
        self._low = table.spill_occupancy - table.hysteresis
        self._balance = table.balance_factor
        self._hysteresis = table.hysteresis
        self._balance_hot = -1.0  # < 0: the mean is not summed yet

    def _summed(self) -> None:
        self._balance_hot = self._balance * _reported_mean(self._members, self._occ)
        self._balance_low = self._balance_hot - self._hysteresis

    def hot(self, member: str) -> bool:
        occ = float(self._occ.get(member, 0.0))
        if occ <= self._spill:
            return False
        if self._balance_hot < 0.0:
            self._summed()
        return occ > self._balance_hot

    def cool(self, member: str) -> bool:
        occ = float(self._occ.get(member, 0.0))
        if occ < self._low:
            return True
        if self._balance_hot < 0.0:
            self._summed()
        return occ < self._balance_low


def _reported_mean(members, occupancy: Mapping[str, float]) -> float:
    """Mean occupancy of the members that report one (0.0 when none does), summed in
    the members' order as `sum` over them would (typed as a C double when compiled)."""
    if type(occupancy) is dict:
        return _dict_mean(members, occupancy)
    total = 0.0
    n = 0
    for m in members:
        if m in occupancy:
            total += float(occupancy[m])
            n += 1
    return total / n if n else 0.0


_ABSENT = object()


def _dict_mean(members, occupancy: dict[str, float]) -> float:
    """`_reported_mean` of a plain dict: one lookup per member."""
    total = 0.0
    n = 0
    for m in members:
        v = occupancy.get(m, _ABSENT)
        if v is not _ABSENT:
            total += float(v)
            n += 1
    return total / n if n else 0.0
