"""The rollout's thin client of Prometheus and Alertmanager, against the real servers:
values and alerts come back as `Probe`s, and every way of not getting an answer
(nothing listening, the wrong API, a bad query, an answer of the wrong shape) is a
`Probe(error=...)`, never an exception and never an empty answer. A blind alarm gate
must not pass: fed to the planner, an unreachable alerts API is an error that pauses
the rollout, where a silent alert would have advanced it."""
from __future__ import annotations

import asyncio
import http.server
import threading
import uuid
from collections.abc import Iterator

import aiohttp
import pytest
import yaml

from kvtier.policy import Recovery, Rollout
from kvtier_operator import analysis, prom_client, rollout
from kvtier_testenv.polling import wait_for
from kvtier_testenv.ports import HOST, free_port
from kvtier_testenv.prometheus import Prometheus
from test_rollout_analysis import obs, rolling
from test_rollout_planner import NEW, OLD

ALERT = "KVTierHitRateDrop"
# Long enough that the pending alert never fires during a test.
PENDING_FOR = "1h"


def run(coro):
    async def go():
        async with aiohttp.ClientSession() as session:
            return await coro(session)
    return asyncio.run(go())


def alarm_rules(namespace: str) -> str:
    """The alert firing for version `new` and pending for version `slow` of one
    policy, whatever is scraped (the expressions are constants)."""
    def rule(version: str, **extra) -> dict:
        return {"alert": ALERT, "expr": "vector(1)", **extra,
                "labels": {"namespace": namespace, "policy": "llm", "version": version}}
    return yaml.safe_dump({"groups": [{"name": "kvtier-test", "interval": "1s",
                                       "rules": [rule("new"), rule("slow", **{"for": PENDING_FOR})]}]})


@pytest.fixture
def namespace_label() -> str:
    return f"ns-{uuid.uuid4().hex[:8]}"


class _ResendingPrometheus(Prometheus):
    """Resends firing alerts every second: the first sends of an alert that fires at
    start-up go before Prometheus has its Alertmanager and are dropped, and the
    default resend waits a minute."""

    def argv(self) -> list[str]:
        return super().argv() + ["--rules.alert.resend-delay=1s"]


@pytest.fixture
def prom(tmp_path, alertmanager, namespace_label) -> Iterator[Prometheus]:
    """A Prometheus scraping nothing, evaluating `alarm_rules`, sending to the session's
    Alertmanager."""
    p = _ResendingPrometheus(tmp_path / "prometheus").configure([], alarm_rules(namespace_label), alertmanager.address)
    p.start()
    try:
        yield p
    finally:
        p.stop()


class _Garbage(http.server.BaseHTTPRequestHandler):
    """Answers 200 with a JSON body of the wrong shape, whatever is asked."""

    body = b"[1, 2]"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def garbage_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer((HOST, 0), _Garbage)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{HOST}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def unreachable_url() -> str:
    """A loopback port nothing listens on (connection refused at once)."""
    return f"http://{HOST}:{free_port()}"


# --- values ------------------------------------------------------------------------------


def test_query_value_reads_a_scalar_a_vector_a_sum_and_no_series(prom):
    assert run(lambda s: prom_client.query_value(s, prom.url, "scalar(vector(0.25))")).value == pytest.approx(0.25)
    assert run(lambda s: prom_client.query_value(s, prom.url, "vector(0.5)")).value == pytest.approx(0.5)
    two_series = 'label_replace(vector(0.25), "a", "x", "", "") or label_replace(vector(0.5), "a", "y", "", "")'
    summed = run(lambda s: prom_client.query_value(s, prom.url, two_series))
    assert summed.error is None and summed.value == pytest.approx(0.75)
    assert run(lambda s: prom_client.query_value(s, prom.url, 'up{job="none"}')) == analysis.Probe()
    assert run(lambda s: prom_client.query_value(s, prom.url, "vector(0) / 0")) == analysis.Probe()


def test_query_value_errors_on_a_bad_query_an_unreachable_server_and_a_wrong_shape(prom, garbage_url):
    bad = run(lambda s: prom_client.query_value(s, prom.url, "rate("))
    assert bad.value is None and bad.error.startswith("HTTP 400")
    gone = unreachable_url()
    down = run(lambda s: prom_client.query_value(s, gone, "vector(1)"))
    assert down.value is None and down.error.startswith(f"{gone} unreachable")
    wrong = run(lambda s: prom_client.query_value(s, garbage_url, "vector(1)"))
    assert wrong.value is None and wrong.error is not None
    for probe in (bad, down, wrong):
        assert analysis.measure_hit_rate(probe, 0.4, True).result == "error"


# --- alerts --------------------------------------------------------------------------------


def test_firing_reads_firing_and_pending_alerts_from_prometheus(prom, namespace_label):
    labels = {"namespace": namespace_label, "policy": "llm"}
    fired = wait_for("the alert firing in Prometheus", lambda: (p := run(lambda s: prom_client.firing(
        s, prom.url, "prometheus", ALERT, {**labels, "version": "new"}))).firing and p)
    assert fired.error is None and len(fired.firing) == 1 and fired.pending == ()
    slow = run(lambda s: prom_client.firing(s, prom.url, "prometheus", ALERT, {**labels, "version": "slow"}))
    assert slow.error is None and slow.firing == () and len(slow.pending) == 1
    quiet = run(lambda s: prom_client.firing(s, prom.url, "prometheus", ALERT, {**labels, "version": "other"}))
    assert quiet == analysis.Probe()


def test_firing_reads_active_alerts_from_alertmanager(prom, alertmanager, namespace_label):
    labels = {"namespace": namespace_label, "policy": "llm"}
    fired = wait_for("the alert active in Alertmanager", lambda: (p := run(lambda s: prom_client.firing(
        s, alertmanager.url, "alertmanager", ALERT, {**labels, "version": "new"}))).firing and p, timeout_s=60)
    assert fired.error is None and len(fired.firing) == 1
    # Alertmanager only ever hears of firing alerts: the pending one is not there.
    slow = run(lambda s: prom_client.firing(s, alertmanager.url, "alertmanager", ALERT, {**labels, "version": "slow"}))
    assert slow == analysis.Probe()


@pytest.mark.parametrize("api", ["prometheus", "alertmanager"])
def test_an_alerts_api_that_cannot_be_read_is_an_error_never_silence(api, prom, alertmanager, garbage_url):
    """Nothing listening, the other kind of server, and a 200 of the wrong shape."""
    other = alertmanager.url if api == "prometheus" else prom.url
    for url in (unreachable_url(), other, garbage_url):
        probe = run(lambda s: prom_client.firing(s, url, api, ALERT, {"version": NEW}))
        assert probe.error is not None and probe.firing == () and probe.pending == (), (url, probe)
        m = analysis.measure_alarm(probe, ALERT, NEW, lookups=10_000, min_lookups=10)
        assert m.result == "error", (url, m)


def alarm_rollout(url: str, api: str) -> Rollout:
    return Rollout(canary_pods=1, steps=[50, 100], recovery=Recovery(
        window="20s", min_lookups=10, source="alarm", interval="5s", count=1, consecutive_error_limit=1,
        alarm={"url": url, "api": api}))


@pytest.mark.parametrize("api", ["prometheus", "alertmanager"])
def test_a_blind_alarm_gate_pauses_the_rollout_where_a_silent_one_advances_it(api, prom, alertmanager):
    """count 1: one silent measurement would pass the step. Unreachable, the step
    waits, then pauses (inconclusive) past consecutiveErrorLimit, and never advances."""
    live = prom.url if api == "prometheus" else alertmanager.url
    silent = run(lambda s: prom_client.firing(s, live, api, ALERT, {"version": f"v-{uuid.uuid4().hex[:6]}"}))
    assert silent == analysis.Probe()
    assert rollout.plan(alarm_rollout(live, api), NEW, OLD, rolling(), "RollingOut", obs(5, silent)).kind == "advance"

    gone = unreachable_url()
    spec, status, kinds = alarm_rollout(gone, api), rolling(), []
    for t in (5, 10, 15):
        blind = run(lambda s: prom_client.firing(s, gone, api, ALERT, {"version": NEW}))
        p = rollout.plan(spec, NEW, OLD, status, "RollingOut", obs(t, blind))
        kinds.append(p.kind)
        status = p.rollout or status
        if p.kind == "pause":
            break
    assert kinds == ["wait", "pause"]
    assert status.paused_reason == "inconclusive" and status.analysis.successes == 0
    assert f"{gone} unreachable" in status.analysis.message
