"""Kubernetes-style conditions, merged the way `meta.SetStatusCondition` does:
`lastTransitionTime` moves only when the status flips, so a re-run of a handler with
the same outcome changes nothing (and writes nothing)."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal

from kvtier.policy import Condition

Status = Literal["True", "False", "Unknown"]


@dataclass(frozen=True, slots=True)
class Observation:
    """One condition as a handler decided it, before it is merged into status."""

    type: str
    status: Status
    reason: str
    message: str = ""


def now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


def merge(
    current: list[Condition], observed: list[Observation], generation: int | None, at: datetime | None = None
) -> list[Condition]:
    """`current` with each observation applied; types not observed are kept as they are."""
    at = at or now()
    by_type = {c.type: c for c in current}
    for obs in observed:
        old = by_type.get(obs.type)
        flipped = old is None or old.status != obs.status
        by_type[obs.type] = Condition(
            type=obs.type,
            status=obs.status,
            reason=obs.reason,
            message=obs.message,
            observed_generation=generation,
            last_transition_time=at if flipped else old.last_transition_time,
        )
    return sorted(by_type.values(), key=lambda c: c.type)


def find(conditions: list[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)
