"""The scheduler's lookups against a real sidecar process, healthy and hung (SIGSTOP):
the scheduler's calls never wait on the socket, a request past its budget is a miss,
the breaker trips, leaves the sidecar alone, probes it and recovers, and no pin
outlives its request."""
from __future__ import annotations

import json
import signal
import time

import numpy as np
import pytest

from kvtier.keys import KeyRoot
from kvtier_sidecar.client import SidecarClient
from kvtier_testenv.polling import wait_for
from kvtier_vllm.config import weights_mismatch
from kvtier_vllm.lookups import PENDING, AsyncLookups, Breaker

BLOCK = 16
ROOT = KeyRoot("t", "reference-tiny", "dev", "float32", "rope-default", "sdpa")
BUDGET_S = 0.3
"""The requests' lookup budget in these tests."""
SOCKET_TIMEOUT_S = 10.0
"""The lookup thread's socket timeout: what a blocking lookup would have cost each request."""
BACKOFF_S = 1.0


@pytest.fixture()
def sidecar(spawn):
    sc = spawn("lookups", block_size=BLOCK, min_sightings=1)
    prompt = list(range(1, 5 * BLOCK + 8))
    writer = SidecarClient(sc.socket)
    blocks = np.zeros((len(prompt) // BLOCK, writer.connect() and writer.info["block_bytes"]), np.uint8)
    assert not writer.lookup(ROOT, prompt)  # admission counts sightings at lookups
    assert writer.store(ROOT, prompt, blocks)
    writer.close()
    yield sc, prompt
    if sc.proc is not None and sc.proc.poll() is None:
        sc.proc.send_signal(signal.SIGCONT)


def _pinned(sc) -> float:
    status, body = sc.get("/metrics")
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith("kvtier_pinned_hits"):
            return float(line.split()[-1])
    raise AssertionError("no kvtier_pinned_hits in /metrics")


def test_a_hung_sidecar_costs_each_request_its_budget_and_trips_the_breaker_until_it_resumes(sidecar):
    sc, prompt = sidecar
    changes: list[bool] = []
    breaker = Breaker(BACKOFF_S, on_change=lambda tripped, why: changes.append(tripped))
    lookups = AsyncLookups(SidecarClient(sc.socket, timeout_s=SOCKET_TIMEOUT_S), BUDGET_S, breaker)

    healthy = lookups.start(ROOT, prompt, 0, False)
    hit = lookups.settle(healthy, BUDGET_S)
    assert hit is not PENDING and hit.matched_tokens == 5 * BLOCK
    lookups.release(hit)
    wait_for("the healthy hit released", lambda: _pinned(sc) == 0, 10)

    sc.proc.send_signal(signal.SIGSTOP)
    pending = [lookups.start(ROOT, prompt, 0, False) for _ in range(8)]
    assert all(p is not None for p in pending)
    started = time.monotonic()
    asked = 0
    answers: dict[int, object] = {}
    while len(answers) < len(pending):  # what vLLM's scheduler does: ask again each step
        for i, p in enumerate(pending):
            if i not in answers:
                got = lookups.settle(p, 0.0)
                asked += 1
                if got is not PENDING:
                    answers[i] = got
    waited = time.monotonic() - started
    assert all(a is None for a in answers.values())  # past the budget: misses
    assert asked > len(pending)                       # "not known yet" came first
    # Every request waited about its budget, not behind one another's socket timeout.
    assert waited < SOCKET_TIMEOUT_S / 2
    assert changes == [True] and breaker.is_open
    assert lookups.start(ROOT, prompt, 0, False) is None  # open: not asked at all
    assert lookups.take_counts()["lookups_skipped"] == 1

    sc.proc.send_signal(signal.SIGCONT)
    # the probe after the back-off answers in time: the breaker closes, lookups hit again
    def probe():
        p = lookups.start(ROOT, prompt, 0, False)
        if p is None:
            return None
        got = lookups.settle(p, BUDGET_S)
        while got is PENDING:
            got = lookups.settle(p, BUDGET_S)
        if got:
            lookups.release(got)
        return got
    recovered = wait_for("the breaker closed on a probe", lambda: probe() and not breaker.is_open,
                         SOCKET_TIMEOUT_S * 3)
    assert recovered and changes == [True, False] and breaker.recoveries == 1
    # the lookups that ended after their requests gave up released their pins themselves
    wait_for("no pin left", lambda: _pinned(sc) == 0, SOCKET_TIMEOUT_S * 2)
    lookups.close()


def test_a_lookup_abandoned_by_its_request_releases_its_pin(sidecar):
    sc, prompt = sidecar
    lookups = AsyncLookups(SidecarClient(sc.socket), BUDGET_S * 100, Breaker(BACKOFF_S))
    pending = lookups.start(ROOT, prompt, 0, False)
    lookups.abandon(pending)  # the request finished (or was aborted) before the answer
    pending.done.wait(10)
    wait_for("the abandoned lookup's pin released", lambda: _pinned(sc) == 0, 10)
    kept = lookups.start(ROOT, prompt, 0, False)
    assert lookups.settle(kept, 10).matched_tokens == 5 * BLOCK
    assert _pinned(sc) == 1  # negative control: a settled hit stays pinned until released
    lookups.close()


def test_an_absent_sidecar_trips_the_breaker_at_once(tmp_path):
    changes: list[str] = []
    breaker = Breaker(BACKOFF_S, on_change=lambda tripped, why: changes.append(why))
    lookups = AsyncLookups(SidecarClient(str(tmp_path / "absent.sock")), BUDGET_S, breaker)
    for _ in range(2):
        p = lookups.start(ROOT, list(range(100)), 0, False)
        assert lookups.settle(p, BUDGET_S) is None
    wait_for("the breaker open", lambda: breaker.is_open, 10)
    assert changes == ["the sidecar is unreachable"]
    assert lookups.take_counts()["lookup_faults"] == 2
    lookups.close()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_breaker_trips_on_the_second_failure_in_a_row_probes_once_per_backoff_and_doubles_it():
    clock, changes = Clock(), []
    b = Breaker(2.0, clock=clock, on_change=lambda tripped, why: changes.append(tripped))
    b.failure("late")
    b.success()                       # a success in between: not in a row
    b.failure("late")
    assert b.allow() and not b.is_open
    b.failure("late")
    assert b.is_open and changes == [True] and not b.allow()
    clock.now += 1.99
    assert not b.allow()
    clock.now += 0.02
    assert b.allow() and not b.allow()  # one probe at a time
    b.failure("probe late")             # reopened for twice the back-off
    assert b.backoff_s == 4.0 and changes == [True]
    for expected in (8.0, 16.0, 16.0):  # capped at MAX_BACKOFF_FACTOR x the base
        clock.now += b.backoff_s
        assert b.allow()
        b.failure("probe late")
        assert b.backoff_s == expected
    clock.now += b.backoff_s
    assert b.allow()
    b.success()
    assert not b.is_open and changes == [True, False] and b.backoff_s == 2.0
    assert (b.trips, b.recoveries) == (1, 1)
    b.failure("late")                   # one failure after recovery: still closed
    assert not b.is_open


def _stats(sc) -> dict:
    status, body = sc.get("/cache/stats")
    assert status == 200
    return json.loads(body)


def test_a_sidecar_serving_other_weights_is_not_asked_and_says_so_once(sidecar, caplog):
    """The engine serves other weights than its sidecar was configured for: no lookup
    reaches the sidecar (so nothing is counted under the wrong version), each request is
    a miss at once, and the mismatch is logged naming both digests and counted once."""
    sc, prompt = sidecar
    client = SidecarClient(sc.socket)
    assert client.connect()
    theirs = client.info["weights_version"]
    mine = "sha256:" + "e" * 64
    assert theirs != mine
    lookups = AsyncLookups(client, BUDGET_S * 10, Breaker(BACKOFF_S),
                           refuse=lambda info: weights_mismatch(info, mine, sc.socket))
    before = _stats(sc)["lookups"]
    with caplog.at_level("ERROR", logger="vllm.kvtier_vllm"):
        for _ in range(3):
            assert lookups.settle(lookups.start(ROOT, prompt, 0, False), BUDGET_S * 10) is None
        lookups.report({"prompt_tokens": 999})
        lookups.close()
        lookups._thread.join(10)
    assert _stats(sc)["lookups"] == before                       # never asked
    assert _stats(sc)["engine"]["prompt_tokens"] == 0             # nor told anything
    assert lookups.take_counts()["weights_version_mismatch"] == 1
    errors = [r.getMessage() for r in caplog.records if "WITHOUT kvtier" in r.getMessage()]
    assert len(errors) == 1 and mine in errors[0] and theirs in errors[0]
    # Negative control: the same sidecar with the engine's own digest is asked.
    same = AsyncLookups(SidecarClient(sc.socket), BUDGET_S * 10, Breaker(BACKOFF_S),
                        refuse=lambda info: weights_mismatch(info, theirs, sc.socket))
    hit = same.settle(same.start(ROOT, prompt, 0, False), BUDGET_S * 10)
    assert hit is not None and hit.matched_tokens == 5 * BLOCK
    same.release(hit)
    same.close()


def test_counts_reported_while_the_breaker_is_open_reach_the_sidecar_once_it_closes(sidecar):
    """Prompts served without kvtier while the breaker was open still belong in the hit
    rate's denominator: their counts are kept, and sent after the breaker closes."""
    sc, prompt = sidecar
    clock = Clock()
    breaker = Breaker(BACKOFF_S, clock=clock)
    lookups = AsyncLookups(SidecarClient(sc.socket), BUDGET_S * 10, breaker)
    breaker.failure("late")
    breaker.failure("late")
    assert breaker.is_open
    lookups.report({"prompt_tokens": 100})
    lookups.report({"prompt_tokens": 50, "local_hit_tokens": 32})
    clock.now += BACKOFF_S
    assert breaker.allow()
    breaker.success()
    lookups.report({"prompt_tokens": 7})
    wait_for("the kept counts reported", lambda: _stats(sc)["engine"]["prompt_tokens"] == 157, 10)
    assert _stats(sc)["engine"]["local_hit_tokens"] == 32
    lookups.close()
