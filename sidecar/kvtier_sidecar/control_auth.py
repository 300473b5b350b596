"""Who may use the control API: the operator's ServiceAccount token, checked with the
API server's TokenReview (as kube-rbac-proxy does).

    Authorization: Bearer <token>  ->  TokenReview{token, audiences: [audience, metrics_audience]}
        not authenticated, or not for our audience  -> 401   (/cache/: `audience`, this pod's own
                                                              when the operator mints per pod;
                                                              /metrics: either)
        authenticated as someone not allowed        -> 403
        the API server cannot be asked              -> 503 (fail closed)

Identities are cached by the token's SHA-256 for `cache_ttl_s`, so the operator's calls
cost one review per TTL. Made-up tokens cannot turn into a flood of reviews nor push the
operator out:

    two caches      tokens of allowed identities (a few; bounded apart) and everything
                    else (bounded; a flood of garbage evicts only garbage)
    per source      reviews of tokens neither cache knows are rate-limited per client
                    address (a token bucket); past it: 429 with Retry-After, no review
    reserved slot   a token that belonged to an allowed identity before (its answer
                    expired) is reviewed on a slot of its own, never queued behind others
    one deadline    waiting for a slot and the review together take at most
                    REVIEW_TIMEOUT_S; then 503, like an API server that cannot answer

`identify` and `authorize` are pure; `TokenReviewer` is the thin I/O (aiohttp to the
API server, authenticated with this pod's own token).
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import os
import ssl
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvtier.sidecar_config import ControlAuthConfig

from .counters import Count, Counters

log = logging.getLogger("kvtier.sidecar.auth")

# Distinct tokens of other identities (and invalid ones) remembered at once; beyond,
# the oldest answer is forgotten.
MAX_CACHED_TOKENS = 1024
# Tokens of allowed identities remembered: the operator's, rotated every few minutes,
# and the metrics users'. Kept apart, so garbage never evicts them.
MAX_TRUSTED_TOKENS = 64
# A review, its wait for a slot included, answers within this or is given up (503):
# a hung API server must not hold a caller longer than it would wait for a miss.
REVIEW_TIMEOUT_S = 5.0
# Reviews in flight at once: a flood of made-up tokens must not become a flood on the
# API server (the rest wait their turn) ...
MAX_REVIEWS_IN_FLIGHT = 4
# ... and from one client address, reviews of unknown tokens at this rate, in bursts
# of REVIEW_BURST: the operator presents a new token every few minutes, an attacker
# a new one per request.
REVIEWS_PER_SOURCE_PER_S = 1.0
REVIEW_BURST = 8
# Client addresses whose review budget is tracked; the least recent is forgotten.
MAX_TRACKED_SOURCES = 4096
# Told to a rate-limited caller.
RATE_LIMIT_RETRY_AFTER_S = 1
# Bearer tokens longer than this are not Kubernetes tokens; refused without a review.
MAX_TOKEN_BYTES = 16 << 10


@dataclass(frozen=True, slots=True)
class Decision:
    status: int  # 200, 401, 403, 429 or 503
    user: str = ""
    reason: str = ""
    audiences: tuple[str, ...] = ()  # of those asked, the ones the token is valid for

    @property
    def allowed(self) -> bool:
        return self.status == 200


class ReviewUnavailable(RuntimeError):
    """The API server could not be asked (down, misconfigured, no credentials)."""


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > MAX_TOKEN_BYTES:
        return None
    return token


def review_body(token: str, audiences: list[str]) -> dict[str, Any]:
    return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
            "spec": {"token": token, "audiences": audiences}}


def identify(review: dict[str, Any], asked: list[str]) -> Decision:
    """Who a TokenReview answer says the token belongs to (200), and for which of the
    `asked` audiences, or why not (401)."""
    status = review.get("status") or {}
    if not status.get("authenticated"):
        return Decision(401, reason=status.get("error") or "token not authenticated")
    audiences = status.get("audiences")
    valid = tuple(a for a in asked if audiences is None or a in audiences)
    if not valid:
        return Decision(401, reason=f"token not issued for audience {asked[0]}")
    return Decision(200, user=(status.get("user") or {}).get("username", ""), audiences=valid)


def authorize(identity: Decision, allowed_users: list[str], what: str, audiences: list[str]) -> Decision:
    """The verdict for one request: an identified caller, with a token for one of
    `audiences`, must be one of `allowed_users`."""
    if not identity.allowed:
        return identity
    if not any(a in identity.audiences for a in audiences):
        return Decision(401, user=identity.user, reason=f"token not issued for audience {audiences[0]}")
    if identity.user in allowed_users:
        return identity
    return Decision(403, user=identity.user, reason=f"{identity.user} may not use this sidecar's {what}")


def api_server_url(config: ControlAuthConfig, env: dict[str, str] | None = None) -> str:
    if config.api_server:
        return config.api_server.rstrip("/")
    env = dict(os.environ if env is None else env)
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        return ""
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


class _TokenBuckets:
    """Per client address, reviews allowed now (a token bucket), bounded in sources."""

    def __init__(self, rate_per_s: float, burst: int, max_sources: int) -> None:
        self.rate_per_s, self.burst, self.max_sources = rate_per_s, burst, max_sources
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()

    def take(self, source: str, now: float) -> bool:
        tokens, at = self._buckets.pop(source, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate_per_s)
        allowed = tokens >= 1.0
        self._buckets[source] = (tokens - 1.0 if allowed else tokens, now)
        while len(self._buckets) > self.max_sources:
            self._buckets.popitem(last=False)
        return allowed


class _AnswerCache:
    """Token digest -> (identity, expiry), bounded, least recently used forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._answers: collections.OrderedDict[str, tuple[Decision, float]] = collections.OrderedDict()

    def fresh(self, key: str, now: float) -> Decision | None:
        found = self._answers.get(key)
        if found is None or found[1] <= now:
            return None
        self._answers.move_to_end(key)
        return found[0]

    def __contains__(self, key: str) -> bool:
        return key in self._answers

    def put(self, key: str, decision: Decision, expires: float) -> None:
        self._answers[key] = (decision, expires)
        self._answers.move_to_end(key)
        while len(self._answers) > self.capacity:
            self._answers.popitem(last=False)

    def drop(self, key: str) -> None:
        self._answers.pop(key, None)


class TokenReviewer:
    """Asks the API server; caches who each token is (or that it is none) for the TTL
    (see the module docstring for what bounds the reviews)."""

    def __init__(self, config: ControlAuthConfig, counters: Counters | None = None) -> None:
        self.config = config
        self._trusted = _AnswerCache(MAX_TRUSTED_TOKENS)
        self._others = _AnswerCache(MAX_CACHED_TOKENS)
        self._sources = _TokenBuckets(REVIEWS_PER_SOURCE_PER_S, REVIEW_BURST, MAX_TRACKED_SOURCES)
        self._session: aiohttp.ClientSession | None = None
        self._gate = asyncio.Semaphore(MAX_REVIEWS_IN_FLIGHT)
        self._trusted_gate = asyncio.Semaphore(1)  # re-reviews of tokens that were allowed
        self.counters = Counters() if counters is None else counters
        # The control API's audience (a pod's own, when the operator mints per pod), then
        # the shared one /metrics also takes.
        self._audiences = list(dict.fromkeys([config.audience, config.metrics_audience]))

    async def check(self, authorization: str | None, metrics: bool = False, source: str = "") -> Decision:
        """The verdict on a request's Authorization header: the control API admits
        `allowed_users`; /metrics (when protected) those and `metrics_users`.
        `source`: the client's address, whose reviews of unknown tokens are rate-limited."""
        identity = await self._identity(authorization, source)
        if metrics:  # a scraper holds a token for the shared audience, not one per pod
            return authorize(identity, self.config.allowed_users + self.config.metrics_users, "metrics",
                             self._audiences)
        return authorize(identity, self.config.allowed_users, "control API", [self.config.audience])

    def _trusts(self, identity: Decision) -> bool:
        return identity.allowed and identity.user in (self.config.allowed_users + self.config.metrics_users)

    async def _identity(self, authorization: str | None, source: str) -> Decision:
        token = bearer_token(authorization)
        if token is None:
            self.counters.add(Count.AUTH_MISSING)
            return Decision(401, reason="a bearer token is required")
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        cached = self._trusted.fresh(key, now) or self._others.fresh(key, now)
        if cached is not None:
            return cached
        was_trusted = key in self._trusted
        if not was_trusted and not self._sources.take(source, now):
            self.counters.add(Count.AUTH_RATE_LIMITED)
            return Decision(429, reason="too many unverified tokens from this address; retry later")
        try:
            async with asyncio.timeout(REVIEW_TIMEOUT_S):
                async with (self._trusted_gate if was_trusted else self._gate):
                    review = await self._review(token)
        except (ReviewUnavailable, TimeoutError) as exc:
            self.counters.add(Count.AUTH_UNAVAILABLE)
            log.warning("cannot review a control-API token", extra={"error": str(exc) or "timed out"})
            return Decision(503, reason="cannot verify credentials now")
        decision = identify(review, self._audiences)
        expires = time.monotonic() + self.config.cache_ttl_s
        if self._trusts(decision):
            self._trusted.put(key, decision, expires)
        else:
            self._trusted.drop(key)  # revoked, or no longer allowed: an ordinary token now
            self._others.put(key, decision, expires)
        return decision

    async def _review(self, token: str) -> dict[str, Any]:
        url = api_server_url(self.config)
        if not url:
            raise ReviewUnavailable("no API server: set control_auth.api_server or run in a pod")
        try:
            own = open(self.config.token_file).read().strip()  # re-read: kubelet rotates it
            if self._session is None:
                ctx = ssl.create_default_context(cafile=self.config.ca_file)
                self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx))
        except (OSError, ssl.SSLError) as exc:
            raise ReviewUnavailable(f"no credentials to call TokenReview: {exc}") from None
        self.counters.add(Count.TOKEN_REVIEWS)
        try:
            async with self._session.post(
                    f"{url}/apis/authentication.k8s.io/v1/tokenreviews", json=review_body(token, self._audiences),
                    headers={"Authorization": f"Bearer {own}"},
                    timeout=aiohttp.ClientTimeout(total=REVIEW_TIMEOUT_S)) as resp:
                if resp.status != 201 and resp.status != 200:
                    raise ReviewUnavailable(f"TokenReview answered {resp.status}: {(await resp.text())[:200]}")
                return await resp.json()
        except (aiohttp.ClientError, ValueError) as exc:
            raise ReviewUnavailable(f"TokenReview failed: {exc.__class__.__name__}: {exc}") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
