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

and in the order a membership change performs them (`reconcile.reconcile_membership`):

    membership-journal-written    the warm-up journal annotation first written
    membership-warmed             the warm-up requests answered (journal not yet closed)
    membership-table-published    the affinity ConfigMap written
    membership-redis-published    the table SET and PUBLISHed in Redis
    membership-journal-cleared    the warm-up journal annotation removed
    membership-event-posted       the EpochChanged Event created (under a deterministic name)
    membership-status-written     status (epoch, members) written
"""
from __future__ import annotations

import os

ENV = "KVTIER_CRASH_AT"
# What a SIGKILLed process reports (128 + 9), so a crash reads the same as a kill.
CRASH_EXIT_CODE = 137
ROLLOUT_POINTS = ("rollout-event-posted", "rollout-status-written", "rollout-workload-patched")
MEMBERSHIP_POINTS = ("membership-journal-written", "membership-warmed", "membership-table-published",
                     "membership-redis-published", "membership-journal-cleared", "membership-event-posted",
                     "membership-status-written")
POINTS = ROLLOUT_POINTS + MEMBERSHIP_POINTS


def reached(point: str) -> None:
    assert point in POINTS, point
    if os.environ.get(ENV) == point:
        os._exit(CRASH_EXIT_CODE)
