"""Readiness by polling with a deadline — never a sleep standing in for readiness."""
from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class WaitTimeout(TimeoutError):
    """`wait_for` ran out of time; the message names what it waited for and the last value."""


def wait_for(what: str, probe: Callable[[], T], timeout_s: float = 30.0, interval_s: float = 0.1) -> T:
    """Call `probe` until it returns something truthy and return that; raise `WaitTimeout`
    naming `what` and the last value seen when `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval_s)
    raise WaitTimeout(f"timed out after {timeout_s:.0f}s waiting for {what}; last seen: {last!r}")
