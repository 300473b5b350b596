"""The control API's authentication rules without an API server: the bearer header, what a
TokenReview answer means, the verdict per endpoint, the API server's address, the
per-source review budget, the answer caches, and what `TokenReviewer` does around each
review (cache, budget, reserved slot, fail-closed 503). The review itself is answered by
the test here (`_review` overridden) or by a local HTTP server that misbehaves; the real
kube-apiserver's answers are in test_control_auth.py and test_control_auth_flood.py.
Fast: these are the mutation run's tests for control_auth.py (docs/MUTATION.md)."""
from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from kvtier.sidecar_config import ControlAuthConfig
from kvtier_sidecar import control_auth
from kvtier_sidecar.control_auth import (
    MAX_TOKEN_BYTES,
    Decision,
    ReviewUnavailable,
    TokenReviewer,
    _AnswerCache,
    _TokenBuckets,
    api_server_url,
    authorize,
    bearer_token,
    identify,
    review_body,
)
from kvtier_sidecar.counters import Count

OPERATOR = "system:serviceaccount:kvtier:kvtier-operator"
PROMETHEUS = "system:serviceaccount:monitoring:prometheus"


# ------------------------------------------------------------------ the pure rules

@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Bearer    ", "Basic abc", "Bearerabc",
                                    "Token abc"])
def test_no_bearer_token_in_the_header(header):
    assert bearer_token(header) is None


def test_the_bearer_token_is_the_header_after_the_scheme_trimmed_and_bounded():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer abc") == "abc"
    assert bearer_token("BEARER  abc  ") == "abc"
    assert bearer_token("Bearer " + "t" * MAX_TOKEN_BYTES) == "t" * MAX_TOKEN_BYTES
    assert bearer_token("Bearer " + "t" * (MAX_TOKEN_BYTES + 1)) is None
    assert MAX_TOKEN_BYTES == 16 * 1024


def test_the_review_asks_for_the_token_and_every_audience():
    assert review_body("tok", ["a", "b"]) == {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                                              "spec": {"token": "tok", "audiences": ["a", "b"]}}


def test_a_review_that_did_not_authenticate_is_401_with_its_error():
    assert identify({}, ["a"]) == Decision(401, reason="token not authenticated")
    assert identify({"status": None}, ["a"]) == Decision(401, reason="token not authenticated")
    assert identify({"status": {"authenticated": False, "error": "expired"}}, ["a"]) == Decision(401, reason="expired")
    assert identify({"status": {"authenticated": False, "error": ""}}, ["a"]).reason == "token not authenticated"


def test_an_authenticated_review_names_the_user_and_the_asked_audiences_it_is_valid_for():
    review = {"status": {"authenticated": True, "user": {"username": OPERATOR}, "audiences": ["b", "other"]}}
    assert identify(review, ["a", "b"]) == Decision(200, user=OPERATOR, audiences=("b",))
    no_list = {"status": {"authenticated": True, "user": {"username": OPERATOR}}}
    assert identify(no_list, ["a", "b"]) == Decision(200, user=OPERATOR, audiences=("a", "b"))
    assert identify({"status": {"authenticated": True}}, ["a"]) == Decision(200, user="", audiences=("a",))


def test_a_token_for_none_of_the_asked_audiences_is_401():
    review = {"status": {"authenticated": True, "user": {"username": OPERATOR}, "audiences": ["other"]}}
    assert identify(review, ["a", "b"]) == Decision(401, reason="token not issued for audience a")
    empty = {"status": {"authenticated": True, "user": {"username": OPERATOR}, "audiences": []}}
    assert identify(empty, ["a"]).status == 401


def test_only_200_is_allowed():
    assert Decision(200).allowed
    assert not any(Decision(s).allowed for s in (201, 204, 401, 403, 429, 503))


def test_authorize_needs_an_identity_a_token_for_the_endpoints_audience_and_an_allowed_user():
    refused = Decision(401, reason="nope")
    assert authorize(refused, [OPERATOR], "control API", ["a"]) is refused
    ok = Decision(200, user=OPERATOR, audiences=("a",))
    assert authorize(ok, [OPERATOR], "control API", ["a"]) is ok
    assert authorize(ok, [OPERATOR], "metrics", ["b", "a"]) is ok
    assert authorize(ok, [OPERATOR], "control API", ["b", "c"]) == Decision(
        401, user=OPERATOR, reason="token not issued for audience b")
    assert authorize(ok, [PROMETHEUS], "control API", ["a"]) == Decision(
        403, user=OPERATOR, reason=f"{OPERATOR} may not use this sidecar's control API")
    assert authorize(ok, [], "metrics", ["a"]).status == 403


def test_the_api_server_is_the_configured_one_or_the_pods_service_address(monkeypatch):
    conf = ControlAuthConfig(api_server="https://api.example:6443/")
    assert api_server_url(conf, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) == "https://api.example:6443"
    plain = ControlAuthConfig()
    assert api_server_url(plain, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) == "https://10.0.0.1:443"
    assert api_server_url(plain, {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "6443"}) \
        == "https://10.0.0.1:6443"
    assert api_server_url(plain, {"KUBERNETES_SERVICE_HOST": "fd00::1"}) == "https://[fd00::1]:443"
    assert api_server_url(plain, {"KUBERNETES_SERVICE_HOST": ""}) == ""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.9.9.9")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "8443")
    assert api_server_url(plain, {}) == ""  # the given environment, not the process's
    assert api_server_url(plain) == "https://10.9.9.9:8443"


# ------------------------------------------------------------------ the review budget per source

def test_a_source_gets_a_burst_of_reviews_then_one_per_refill():
    buckets = _TokenBuckets(rate_per_s=1.0, burst=3, max_sources=10)
    t = 1000.0
    assert [buckets.take("a", t) for _ in range(4)] == [True, True, True, False]
    assert not buckets.take("a", t + 0.5)  # half a review refilled
    assert buckets.take("a", t + 1.0)      # exactly one: allowed
    assert not buckets.take("a", t + 1.0)
    assert buckets.take("b", t + 1.0)      # another source has a budget of its own


def test_a_refilled_budget_never_exceeds_the_burst():
    buckets = _TokenBuckets(rate_per_s=2.0, burst=2, max_sources=10)
    assert buckets.take("a", 0.0) and buckets.take("a", 0.0) and not buckets.take("a", 0.0)
    later = 3600.0
    assert [buckets.take("a", later) for _ in range(3)] == [True, True, False]
    assert buckets.take("a", later + 0.5)  # rate 2/s: one review per half second


def test_a_refused_take_keeps_what_had_refilled():
    buckets = _TokenBuckets(rate_per_s=1.0, burst=1, max_sources=10)
    assert buckets.take("a", 0.0)
    assert not buckets.take("a", 0.6)   # 0.6 refilled, kept
    assert buckets.take("a", 1.0)       # 0.6 + 0.4


def test_the_least_recent_source_is_forgotten_past_the_bound():
    buckets = _TokenBuckets(rate_per_s=1.0, burst=1, max_sources=2)
    assert buckets.take("a", 0.0) and buckets.take("b", 0.0) and buckets.take("c", 0.0)
    assert not buckets.take("b", 0.0)  # still tracked, and spent
    assert not buckets.take("c", 0.0)
    assert buckets.take("a", 0.0)      # forgotten: a fresh budget


# ------------------------------------------------------------------ the answer caches

def test_an_answer_is_fresh_until_its_expiry():
    cache = _AnswerCache(4)
    yes = Decision(200, user=OPERATOR)
    cache.put("k", yes, 10.0)
    assert cache.fresh("k", 9.5) is yes
    assert cache.fresh("k", 10.0) is None and "k" in cache  # expired, but remembered as once known
    assert cache.fresh("other", 0.0) is None and "other" not in cache
    cache.drop("k")
    cache.drop("never-there")
    assert "k" not in cache


def test_the_least_recently_used_answer_goes_first():
    cache = _AnswerCache(2)
    a, b, c = Decision(200, user="a"), Decision(200, user="b"), Decision(200, user="c")
    cache.put("a", a, 100.0)
    cache.put("b", b, 100.0)
    assert cache.fresh("a", 0.0) is a  # used: b is the least recent now
    cache.put("c", c, 100.0)
    assert "b" not in cache and cache.fresh("a", 0.0) is a and cache.fresh("c", 0.0) is c
    cache.put("a", a, 100.0)  # a put refreshes too: c goes next
    cache.put("b", b, 100.0)
    assert "c" not in cache and "a" in cache and "b" in cache


# ------------------------------------------------------------------ the reviewer around each review

class Answered(TokenReviewer):
    """A reviewer whose review the test answers: token -> TokenReview answer, or an
    exception to raise, and a log of the tokens reviewed."""

    def __init__(self, config: ControlAuthConfig, answers: dict[str, object]) -> None:
        super().__init__(config)
        self.answers, self.reviewed = answers, []

    async def _review(self, token: str) -> dict:
        self.reviewed.append(token)
        answer = self.answers.get(token, {"status": {"authenticated": False}})
        if isinstance(answer, BaseException):
            raise answer
        if callable(answer):
            return await answer()
        return answer


def valid(user: str, audiences: list[str] | None = None) -> dict:
    status: dict = {"authenticated": True, "user": {"username": user}}
    if audiences is not None:
        status["audiences"] = audiences
    return {"status": status}


def counts(reviewer: TokenReviewer) -> dict[str, int]:
    return reviewer.counters.snapshot()


def config(**kw) -> ControlAuthConfig:
    return ControlAuthConfig(**{"allowed_users": [OPERATOR], "metrics_users": [PROMETHEUS], **kw})


def run(coro):
    return asyncio.run(coro)


def test_no_token_is_401_without_a_review():
    r = Answered(config(), {})
    assert run(r.check(None)) == Decision(401, reason="a bearer token is required")
    assert run(r.check("Basic abc")).status == 401
    assert r.reviewed == [] and counts(r)[str(Count.AUTH_MISSING)] == 2


def test_each_token_is_reviewed_once_per_ttl_and_the_verdicts_follow_the_users():
    r = Answered(config(), {"op": valid(OPERATOR), "prom": valid(PROMETHEUS), "who": valid("someone")})
    assert run(r.check("Bearer op")).allowed
    assert run(r.check("Bearer op")).allowed
    assert run(r.check("Bearer prom")).status == 403                # the control API: operator only
    assert run(r.check("Bearer prom", metrics=True)).allowed        # /metrics: its users too
    assert run(r.check("Bearer op", metrics=True)).allowed
    assert run(r.check("Bearer who", metrics=True)).status == 403
    assert run(r.check("Bearer who", metrics=True)).status == 403
    assert run(r.check("Bearer bad")).status == 401
    assert run(r.check("Bearer bad")).status == 401
    assert r.reviewed == ["op", "prom", "who", "bad"]  # every answer, allowed or not, was cached


def test_an_expired_answer_is_reviewed_again():
    r = Answered(config(cache_ttl_s=0), {"op": valid(OPERATOR), "bad": {}})
    for _ in range(2):
        assert run(r.check("Bearer op")).allowed
        assert run(r.check("Bearer bad")).status == 401
    assert r.reviewed == ["op", "bad", "op", "bad"]


def test_a_token_for_the_shared_audience_opens_metrics_only():
    conf = config(audience="pod-aud", metrics_audience="shared-aud")
    r = Answered(conf, {"shared": valid(OPERATOR, ["shared-aud"]), "own": valid(OPERATOR, ["pod-aud"])})
    assert run(r.check("Bearer shared", metrics=True)).allowed
    assert run(r.check("Bearer shared")) == Decision(401, user=OPERATOR, reason="token not issued for audience pod-aud")
    assert run(r.check("Bearer own")).allowed and run(r.check("Bearer own", metrics=True)).allowed


def test_unknown_tokens_past_a_sources_burst_are_429_without_a_review():
    r = Answered(config(), {})
    burst = control_auth.REVIEW_BURST
    answers = [run(r.check(f"Bearer garbage-{i}", source="10.0.0.5")).status for i in range(burst + 3)]
    assert answers[:burst] == [401] * burst and set(answers[burst:]) == {429}
    assert len(r.reviewed) == burst and counts(r)[str(Count.AUTH_RATE_LIMITED)] == 3
    refused = run(r.check("Bearer garbage-more", source="10.0.0.5"))
    assert refused == Decision(429, reason="too many unverified tokens from this address; retry later")
    assert run(r.check("Bearer garbage-0", source="10.0.0.5")).status == 401  # cached: no budget needed
    assert run(r.check("Bearer elsewhere", source="10.0.0.6")).status == 401   # another source's budget


def test_a_once_allowed_token_is_re_reviewed_even_when_its_source_is_spent(monkeypatch):
    monkeypatch.setattr(control_auth, "REVIEW_BURST", 1)
    r = Answered(config(cache_ttl_s=0), {"op": valid(OPERATOR)})
    assert run(r.check("Bearer op", source="s")).allowed          # spends the source's one review
    assert run(r.check("Bearer garbage", source="s")).status == 429
    assert run(r.check("Bearer op", source="s")).allowed          # expired, once trusted: reviewed anyway
    assert r.reviewed == ["op", "op"]


def test_a_revoked_token_loses_its_reserved_slot(monkeypatch):
    monkeypatch.setattr(control_auth, "REVIEW_BURST", 2)
    answers: dict[str, object] = {"op": valid(OPERATOR)}
    r = Answered(config(cache_ttl_s=0), answers)
    assert run(r.check("Bearer op", source="s")).allowed
    answers["op"] = {"status": {"authenticated": False, "error": "revoked"}}
    assert run(r.check("Bearer op", source="s")) == Decision(401, reason="revoked")   # trusted: its own slot
    assert run(r.check("Bearer op", source="s")).status == 401  # now an ordinary token: spends the budget
    assert run(r.check("Bearer op", source="s")).status == 429
    assert r.reviewed == ["op", "op", "op"]


def test_garbage_never_evicts_an_allowed_tokens_answer():
    r = Answered(config(), {"op": valid(OPERATOR), "prom": valid(PROMETHEUS)})
    r._others = _AnswerCache(2)  # a small bound for everything else
    assert run(r.check("Bearer op")).allowed and run(r.check("Bearer prom", metrics=True)).allowed
    for i in range(6):
        assert run(r.check(f"Bearer garbage-{i}", source=f"10.0.0.{i}")).status == 401
    assert run(r.check("Bearer op")).allowed and run(r.check("Bearer prom", metrics=True)).allowed
    assert r.reviewed.count("op") == 1 and r.reviewed.count("prom") == 1
    assert run(r.check("Bearer garbage-0", source="x")).status == 401
    assert r.reviewed.count("garbage-0") == 2  # garbage evicts garbage


def test_a_review_that_cannot_be_made_is_503_and_is_not_cached():
    r = Answered(config(), {"op": ReviewUnavailable("down")})
    assert run(r.check("Bearer op")) == Decision(503, reason="cannot verify credentials now")
    assert run(r.check("Bearer op")).status == 503
    assert r.reviewed == ["op", "op"] and counts(r)[str(Count.AUTH_UNAVAILABLE)] == 2


def test_a_hung_review_gives_up_within_the_deadline(monkeypatch):
    monkeypatch.setattr(control_auth, "REVIEW_TIMEOUT_S", 0.2)

    async def hang() -> dict:
        await asyncio.sleep(60)
        return valid(OPERATOR)

    r = Answered(config(), {"op": hang})
    assert run(asyncio.wait_for(r.check("Bearer op"), 30)).status == 503
    assert counts(r)[str(Count.AUTH_UNAVAILABLE)] == 1


def test_reviews_wait_for_one_of_a_few_slots():
    in_flight, most = 0, 0
    release = asyncio.Event()

    async def slow() -> dict:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await release.wait()
        in_flight -= 1
        return {}

    async def scenario() -> list[int]:
        r = Answered(config(), {f"t{i}": slow for i in range(10)})
        calls = [asyncio.create_task(r.check(f"Bearer t{i}", source=f"s{i}")) for i in range(10)]
        while most < control_auth.MAX_REVIEWS_IN_FLIGHT and not all(c.done() for c in calls):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        release.set()
        return [d.status for d in await asyncio.gather(*calls)]

    assert asyncio.run(asyncio.wait_for(scenario(), 30)) == [401] * 10
    assert most == control_auth.MAX_REVIEWS_IN_FLIGHT == 4


# ------------------------------------------------------------------ the review's own failures

def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_api_server_to_ask_is_503(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    r = TokenReviewer(config())
    assert run(r.check("Bearer op")).status == 503
    assert counts(r).get(str(Count.TOKEN_REVIEWS), 0) == 0


def test_no_own_token_to_call_with_is_503(tmp_path):
    r = TokenReviewer(config(api_server="https://127.0.0.1:1", token_file=str(tmp_path / "missing")))
    assert run(r.check("Bearer op")).status == 503
    assert counts(r).get(str(Count.TOKEN_REVIEWS), 0) == 0


def test_an_api_server_that_refuses_the_connection_is_503(tmp_path):
    own = tmp_path / "token"
    own.write_text("own-token\n")

    async def scenario():
        r = TokenReviewer(config(api_server=f"http://127.0.0.1:{closed_port()}", token_file=str(own),
                                 ca_file=_ca_bundle()))
        try:
            return await r.check("Bearer op"), counts(r)
        finally:
            await r.close()

    decision, seen = run(scenario())
    assert decision.status == 503 and seen[str(Count.TOKEN_REVIEWS)] == 1


def _ca_bundle() -> str:
    import certifi

    return certifi.where()


@pytest.mark.parametrize("status,body,content_type,verdict", [
    (201, '{"status": {"authenticated": true, "user": {"username": "%s"}}}' % OPERATOR, "application/json", 200),
    (200, '{"status": {"authenticated": true, "user": {"username": "%s"}}}' % OPERATOR, "application/json", 200),
    (201, '{"status": {"authenticated": false}}', "application/json", 401),
    (500, "boom", "text/plain", 503),
    (403, '{"kind": "Status"}', "application/json", 503),
    (202, '{"status": {"authenticated": true, "user": {"username": "%s"}}}' % OPERATOR, "application/json", 503),
    (201, "not json", "application/json", 503),
])
def test_what_the_api_servers_answer_means(tmp_path, status, body, content_type, verdict):
    """A local HTTP server in the API server's place answers the review: only 200/201
    with a TokenReview is an answer; anything else fails closed. The request it gets
    carries this pod's own token and asks about the caller's."""
    own = tmp_path / "token"
    own.write_text("own-token\n")
    got: list[tuple[str, dict]] = []

    async def review(request: web.Request) -> web.Response:
        got.append((request.headers.get("Authorization", ""), await request.json()))
        return web.Response(status=status, text=body, content_type=content_type)

    async def scenario():
        app = web.Application()
        app.router.add_post("/apis/authentication.k8s.io/v1/tokenreviews", review)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        r = TokenReviewer(config(api_server=f"http://127.0.0.1:{port}/", token_file=str(own), ca_file=_ca_bundle()))
        try:
            return await r.check("Bearer caller")
        finally:
            await r.close()
            await runner.cleanup()

    assert run(scenario()).status == verdict
    assert got == [("Bearer own-token", review_body("caller", ["kvtier-sidecar"]))]


# ------------------------------------------------------------------ the documented limits, the log, closing

def test_the_limits_in_force_are_the_documented_ones():
    """docs/SECURITY.md states the review deadline, both cache bounds, the per-source
    rate and burst and the reviews in flight; a changed limit must change the doc."""
    from pathlib import Path

    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "SECURITY.md").read_text().split())
    assert f"slower than {control_auth.REVIEW_TIMEOUT_S:g} s: 503" in doc
    assert f"cached apart ({control_auth.MAX_TRUSTED_TOKENS}) from everything else " \
           f"({control_auth.MAX_CACHED_TOKENS:,})" in doc
    assert f"({control_auth.REVIEWS_PER_SOURCE_PER_S:g} a second, bursts of {control_auth.REVIEW_BURST})" in doc
    assert "(at most four)" in doc and control_auth.MAX_REVIEWS_IN_FLIGHT == 4
    # A rate-limited caller is told to come back when its next review has refilled.
    assert control_auth.RATE_LIMIT_RETRY_AFTER_S == 1 / control_auth.REVIEWS_PER_SOURCE_PER_S


def test_the_caches_and_the_sources_hold_exactly_their_bounds():
    r = Answered(config(), {f"op{i}": valid(OPERATOR) for i in range(control_auth.MAX_TRUSTED_TOKENS + 1)})

    async def statuses(*calls: tuple[str, str]) -> list[int]:
        return [(await r.check(f"Bearer {token}", source=source)).status for token, source in calls]

    assert set(run(statuses(*[(f"op{i}", f"t{i}") for i in range(control_auth.MAX_TRUSTED_TOKENS)]))) == {200}
    assert set(run(statuses(*[(f"garbage-{i}", f"s{i}") for i in range(control_auth.MAX_CACHED_TOKENS)]))) == {401}
    reviewed = len(r.reviewed)
    assert run(statuses(("op0", ""), ("garbage-0", "x"))) == [200, 401]
    assert len(r.reviewed) == reviewed  # both bounds hold every answer given so far
    assert run(statuses((f"op{control_auth.MAX_TRUSTED_TOKENS}", "w"), ("garbage-extra", "y"))) == [200, 401]
    assert run(statuses(("op2", ""), ("garbage-2", "z"))) == [200, 401]
    assert len(r.reviewed) == reviewed + 2  # one more each: the least recent went, the others stayed
    assert run(statuses(("op1", "v"), ("garbage-1", "u"))) == [200, 401]
    assert r.reviewed[reviewed + 2:] == ["op1", "garbage-1"]  # the least recent of each (op0 was used since)
    spent = r._sources
    for _ in range(control_auth.REVIEW_BURST):
        assert spent.take("first", 0.0)
    assert not spent.take("first", 0.0)
    for i in range(control_auth.MAX_TRACKED_SOURCES - 1):
        spent.take(f"other-{i}", 0.0)
    assert not spent.take("first", 0.0)  # still tracked: exactly the bound
    for i in range(control_auth.MAX_TRACKED_SOURCES):
        spent.take(f"newer-{i}", 0.0)
    assert spent.take("first", 0.0)      # forgotten past it


def test_a_once_allowed_token_is_re_reviewed_one_at_a_time():
    in_flight, most = 0, 0
    release = asyncio.Event()

    async def slow() -> dict:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await release.wait()
        in_flight -= 1
        return valid(OPERATOR)

    async def scenario() -> list[bool]:
        r = Answered(config(cache_ttl_s=0), {"a": valid(OPERATOR), "b": valid(OPERATOR)})
        assert (await r.check("Bearer a")).allowed and (await r.check("Bearer b")).allowed
        r.answers.update(a=slow, b=slow)
        calls = [asyncio.create_task(r.check(f"Bearer {t}")) for t in "ab"]
        for _ in range(20):
            await asyncio.sleep(0.01)
        release.set()
        return [d.allowed for d in await asyncio.gather(*calls)]

    assert asyncio.run(asyncio.wait_for(scenario(), 30)) == [True, True]
    assert most == 1  # the reserved slot is one slot


def test_an_authenticated_stranger_is_not_trusted():
    """Only allowed identities' tokens are kept apart and re-reviewed on the reserved
    slot; a valid token of anyone else is an ordinary one."""
    r = Answered(config(cache_ttl_s=0), {"stranger": valid("system:serviceaccount:x:y")})
    r._sources = _TokenBuckets(rate_per_s=1e-9, burst=1, max_sources=10)
    assert run(r.check("Bearer stranger", source="s")).status == 403
    assert run(r.check("Bearer stranger", source="s")).status == 429  # its source is spent: no reserved slot


def test_a_review_failure_is_logged_with_its_reason(caplog, monkeypatch):
    r = Answered(config(), {"down": ReviewUnavailable("down"), "blank": ReviewUnavailable("")})
    with caplog.at_level("WARNING", logger="kvtier.sidecar.auth"):
        assert run(r.check("Bearer down")).status == 503
        assert run(r.check("Bearer blank")).status == 503
    assert [rec.error for rec in caplog.records] == ["down", "timed out"]


def test_an_api_servers_error_body_is_cut_to_200_characters(tmp_path, caplog):
    own = tmp_path / "token"
    own.write_text("own-token\n")

    async def review(request: web.Request) -> web.Response:
        return web.Response(status=500, text="x" * 300)

    async def scenario():
        app = web.Application()
        app.router.add_post("/apis/authentication.k8s.io/v1/tokenreviews", review)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        r = TokenReviewer(config(api_server=f"http://127.0.0.1:{port}", token_file=str(own), ca_file=_ca_bundle()))
        try:
            return await r.check("Bearer caller")
        finally:
            await r.close()
            await runner.cleanup()

    with caplog.at_level("WARNING", logger="kvtier.sidecar.auth"):
        assert run(scenario()).status == 503
    assert [rec.error for rec in caplog.records] == [f"TokenReview answered 500: {'x' * 200}"]


def test_closing_closes_the_session_and_closing_an_unused_reviewer_is_fine(tmp_path):
    run(TokenReviewer(config()).close())
    own = tmp_path / "token"
    own.write_text("own-token\n")

    async def scenario():
        r = TokenReviewer(config(api_server=f"http://127.0.0.1:{closed_port()}", token_file=str(own),
                                 ca_file=_ca_bundle()))
        await r.check("Bearer op")
        session = r._session
        assert session is not None and not session.closed
        await r.close()
        return session.closed

    assert run(scenario())


def test_a_decision_cannot_change():
    d = Decision(200, user=OPERATOR)
    with pytest.raises(AttributeError):
        d.status = 401  # type: ignore[misc]
