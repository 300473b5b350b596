"""What every kvtier benchmark returns, so one runner can tabulate them all.

Targets are ratios against a baseline measured in the same run on the same machine
(or absolute bounds where the design sets one); a bench module exposes
`run(quick: bool = False) -> list[Result]`.
"""
from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass
from typing import Callable


@dataclass(slots=True)
class Result:
    """One figure: `value` against `baseline` (same run), checked against `target`.

    `direction` says which way is good: "higher" means value/baseline (or value)
    must be >= target, "lower" means <= target. `kind` is "ratio" when the target
    applies to value/baseline and "absolute" when it applies to value itself.
    """

    name: str
    value: float
    unit: str
    target: float
    direction: str = "higher"
    kind: str = "ratio"
    baseline: float | None = None
    baseline_name: str = ""
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.baseline in (None, 0):
            return None
        return self.value / self.baseline

    @property
    def checked(self) -> float:
        return self.ratio if self.kind == "ratio" else self.value

    @property
    def passed(self) -> bool:
        got = self.checked
        if got is None:
            return False
        return got >= self.target if self.direction == "higher" else got <= self.target

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(ratio=self.ratio, passed=self.passed)
        return d


def machine() -> str:
    import os

    return f"{platform.machine()} {os.cpu_count()} cores, {platform.python_implementation()} {platform.python_version()}"


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    idx = min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))
    return ordered[idx]


def best_of(fn: Callable[[], None], repeat: int = 5, number: int = 1) -> float:
    """Best wall time of `repeat` runs of `number` calls, in seconds per call."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best
