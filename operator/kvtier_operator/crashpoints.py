"""Crash points: a TEST-ONLY hook that kills the operator right after a named side
effect, so tests can check that a restart converges to the same end state.

    KVTIER_CRASH_AT=<point>   the operator process exits at once (os._exit, like
                              SIGKILL: no cleanup, no finalizers) the first time it
                              reaches <point>

Unset (always, outside tests) it is one dictionary lookup. The points, in the order a
rollout step performs its side effects (`rollout_reconcile.reconcile_rollout`):

    rollout-event-posted      the step's Event created (under a deterministic name)
    rollout-status-written    status.rollout / phase / version written
    rollout-workload-patched  the StatefulSet's template and partition patched
"""
from __future__ import annotations

import os

ENV = "KVTIER_CRASH_AT"
# What a SIGKILLed process reports (128 + 9), so a crash reads the same as a kill.
CRASH_EXIT_CODE = 137
POINTS = ("rollout-event-posted", "rollout-status-written", "rollout-workload-patched")


def reached(point: str) -> None:
    assert point in POINTS, point
    if os.environ.get(ENV) == point:
        os._exit(CRASH_EXIT_CODE)
