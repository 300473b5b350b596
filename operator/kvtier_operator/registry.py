"""What the operator keeps in memory per policy, in one typed place: the lock that
makes one status writer at a time, the membership loop's wake-up trigger, and the
planner's last assignment. An entry is dropped when its policy is deleted."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier.affinity import Assignment


class PolicyKey(NamedTuple):
    namespace: str
    name: str


@dataclass(slots=True)
class PolicyState:
    """The last assignment: a planner speed-up only; losing it on restart costs one
    full recompute, never a wrong plan."""

    assignment: Assignment | None = None
    # The last pass could not bring Redis up to the published table: retry soon,
    # not only at the next resync, so routers reading Redis catch up once it returns.
    redis_behind: bool = False
    # Why the policy cannot be carried out (logged once per distinct reason), or None.
    broken: str | None = None


@dataclass(slots=True)
class PolicyEntry:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one status writer at a time
    state: PolicyState = field(default_factory=PolicyState)
    trigger: asyncio.Event | None = None  # set while the policy's membership loop runs


class PolicyRegistry:
    def __init__(self) -> None:
        self._entries: dict[PolicyKey, PolicyEntry] = {}

    def entry(self, key: PolicyKey) -> PolicyEntry:
        return self._entries.setdefault(key, PolicyEntry())

    def lock(self, key: PolicyKey) -> asyncio.Lock:
        return self.entry(key).lock

    def open_trigger(self, key: PolicyKey) -> asyncio.Event:
        """The membership loop's wake-up event (created on the loop's first turn)."""
        entry = self.entry(key)
        if entry.trigger is None:
            entry.trigger = asyncio.Event()
        return entry.trigger

    def close_trigger(self, key: PolicyKey) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            entry.trigger = None

    def wake(self, key: PolicyKey) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.trigger is not None:
            entry.trigger.set()

    def wake_namespace(self, namespace: str) -> None:
        for key, entry in list(self._entries.items()):
            if key.namespace == namespace and entry.trigger is not None:
                entry.trigger.set()

    def forget(self, key: PolicyKey) -> None:
        """The policy is gone: drop its lock, state and trigger."""
        self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)
