"""Made-up bearer tokens against the real kube-apiserver's TokenReview: a flood from one
address is rate-limited before it reaches the API server, a flood from many addresses
never evicts the operator's cached answer, and with the API server hung the operator's
re-review is not queued behind the garbage, while every queued review gives up (503)
instead of holding its caller."""
from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest

from kvtier_sidecar.control_auth import MAX_CACHED_TOKENS, MAX_REVIEWS_IN_FLIGHT, REVIEW_BURST, REVIEWS_PER_SOURCE_PER_S

from .test_control_auth import call, identities  # noqa: F401  (the fixture)

pytestmark = pytest.mark.k8s


def stats_from(sc, source_ip: str, token: str) -> int:
    """GET /cache/stats with `token`, sent from the loopback address `source_ip`."""
    conn = sc.control.connection(60, source_address=(source_ip, 0))
    try:
        conn.request("GET", "/cache/stats", headers={"Authorization": f"Bearer {token}"})
        return conn.getresponse().status
    finally:
        conn.close()


def reviews(sc, token: str) -> int:
    status, body = call(sc, "GET", "/cache/stats", token)
    assert status == 200, body
    return body["sidecar"]["token_reviews"]


def authed_sidecar(spawn, control_plane, identities, api_server: str | None = None, **auth):  # noqa: F811
    return spawn(control_auth={"mode": "tokenreview", "api_server": api_server or control_plane.url,
                               "ca_file": str(control_plane.ca_cert), "token_file": identities["serving_token_file"],
                               "allowed_users": [identities["operator_user"]], **auth})


def test_unknown_tokens_from_one_address_are_rate_limited_before_any_review(spawn, control_plane, identities):  # noqa: F811
    sc = authed_sidecar(spawn, control_plane, identities)
    operator = identities["operator"]
    before = reviews(sc, operator)
    started = time.monotonic()
    answers = [stats_from(sc, "127.0.0.5", f"garbage-{i}") for i in range(60)]
    elapsed_s = time.monotonic() - started
    assert set(answers) == {401, 429}, answers
    assert answers[:REVIEW_BURST] == [401] * REVIEW_BURST  # the burst is reviewed
    reviewed = reviews(sc, operator) - before
    refill = int(elapsed_s * REVIEWS_PER_SOURCE_PER_S) + 1
    assert answers.count(401) == reviewed <= REVIEW_BURST + refill
    # Another address has a budget of its own; the operator's cached answer is untouched.
    assert stats_from(sc, "127.0.0.7", "garbage-elsewhere") == 401
    status, body = call(sc, "GET", "/cache/stats", operator)
    assert status == 200 and body["sidecar"]["auth_rate_limited"] == answers.count(429)


def test_garbage_from_many_addresses_never_evicts_the_operators_cached_answer(spawn, control_plane, identities):  # noqa: F811
    sc = authed_sidecar(spawn, control_plane, identities)
    operator = identities["operator"]
    first = reviews(sc, operator)  # reviewed once, cached
    per_source = REVIEW_BURST - 1
    sources = [f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(MAX_CACHED_TOKENS // per_source + 10)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda s: [stats_from(sc, s, f"{s}-garbage-{j}") for j in range(per_source)], sources))
    assert {a for batch in answers for a in batch} == {401}
    flooded = reviews(sc, operator)
    assert flooded - first == len(sources) * per_source > MAX_CACHED_TOKENS  # every garbage token was reviewed
    assert reviews(sc, operator) == flooded  # ... and the operator's answer still came from the cache


class StallingProxy:
    """TCP in front of the real API server that, once stalled, forwards nothing more: an
    API server that hangs. `held` counts the connections a client spoke on since."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.stalled = threading.Event()
        self.held = 0
        self._lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = "https://127.0.0.1:%d" % self.sock.getsockname()[1]
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        host, port = self.target.rsplit(":", 1)
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection((host, int(port)))
            self._open += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while data := src.recv(65536):
                if self.stalled.is_set():
                    if from_client:
                        with self._lock:
                            self.held += 1
                    return  # hold the connection: nothing more goes through
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        for s in self._open:
            s.close()


def test_with_the_api_server_hung_the_operators_review_is_not_queued_behind_garbage(
        spawn, control_plane, identities):  # noqa: F811
    target = urlsplit(control_plane.url).netloc
    proxy = StallingProxy(target)
    try:
        sc = authed_sidecar(spawn, control_plane, identities, api_server=proxy.url, cache_ttl_s=0.5)
        operator = identities["operator"]
        assert call(sc, "GET", "/cache/stats", operator)[0] == 200  # its identity is known now
        proxy.stalled.set()
        garbage = 2 * MAX_REVIEWS_IN_FLIGHT
        with ThreadPoolExecutor(garbage + 1) as pool:
            flood = [pool.submit(stats_from, sc, f"127.0.3.{i + 1}", f"garbage-{i}") for i in range(garbage)]
            # The garbage takes every review slot (the rest of it waits for one) ...
            deadline = time.monotonic() + 30
            while proxy.held < MAX_REVIEWS_IN_FLIGHT:
                assert time.monotonic() < deadline, "the garbage never reached the API server"
                time.sleep(0.02)
            time.sleep(0.6)  # the operator's cached answer (0.5 s) expires: it must be reviewed again
            mine = pool.submit(stats_from, sc, "127.0.0.6", operator)
            # ... yet the operator's review goes out at once, on the slot kept for it.
            while proxy.held < MAX_REVIEWS_IN_FLIGHT + 1:
                assert time.monotonic() < deadline, "the operator's review was queued behind the garbage"
                time.sleep(0.02)
            assert proxy.held == MAX_REVIEWS_IN_FLIGHT + 1
            # Every review gives up at its deadline instead of holding its caller.
            assert mine.result() == 503
            assert [f.result() for f in flood] == [503] * garbage
    finally:
        proxy.close()
