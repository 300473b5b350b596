"""Who may use the control API: the operator's ServiceAccount token, checked with the
API server's TokenReview (as kube-rbac-proxy does).

    Authorization: Bearer <token>  ->  TokenReview{token, audiences: [audience]}
        not authenticated, or not for our audience  -> 401
        authenticated as someone not allowed        -> 403
        the API server cannot be asked              -> 503 (fail closed)

Identities are cached by the token's SHA-256 for `cache_ttl_s` (bounded), so the
operator's calls cost one review per TTL. `decide` is pure; `TokenReviewer` is the
thin I/O (aiohttp to the API server, authenticated with this pod's own token).
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

# Distinct tokens remembered at once; beyond, the oldest answer is forgotten.
MAX_CACHED_TOKENS = 1024
# A review is a small request to the API server; past this it cannot answer now.
REVIEW_TIMEOUT_S = 5.0
# Reviews in flight at once: a flood of made-up tokens must not become a flood on the
# API server (the rest wait their turn).
MAX_REVIEWS_IN_FLIGHT = 4
# Bearer tokens longer than this are not Kubernetes tokens; refused without a review.
MAX_TOKEN_BYTES = 16 << 10


@dataclass(frozen=True, slots=True)
class Decision:
    status: int  # 200, 401, 403 or 503
    user: str = ""
    reason: str = ""

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


def review_body(token: str, audience: str) -> dict[str, Any]:
    return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
            "spec": {"token": token, "audiences": [audience]}}


def identify(review: dict[str, Any], audience: str) -> Decision:
    """Who a TokenReview answer says the token belongs to (200), or why not (401)."""
    status = review.get("status") or {}
    if not status.get("authenticated"):
        return Decision(401, reason=status.get("error") or "token not authenticated")
    audiences = status.get("audiences")
    if audiences is not None and audience not in audiences:
        return Decision(401, reason=f"token not issued for audience {audience}")
    return Decision(200, user=(status.get("user") or {}).get("username", ""))


def authorize(identity: Decision, allowed_users: list[str], what: str) -> Decision:
    """The verdict for one request: an identified caller must be one of `allowed_users`."""
    if not identity.allowed or identity.user in allowed_users:
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


class TokenReviewer:
    """Asks the API server; caches who each token is (or that it is none) for the TTL."""

    def __init__(self, config: ControlAuthConfig, counters: Counters | None = None) -> None:
        self.config = config
        self._cache: collections.OrderedDict[str, tuple[Decision, float]] = collections.OrderedDict()
        self._session: aiohttp.ClientSession | None = None
        self._gate = asyncio.Semaphore(MAX_REVIEWS_IN_FLIGHT)
        self.counters = Counters() if counters is None else counters

    async def check(self, authorization: str | None, metrics: bool = False) -> Decision:
        """The verdict on a request's Authorization header: the control API admits
        `allowed_users`; /metrics (when protected) those and `metrics_users`."""
        identity = await self._identity(authorization)
        if metrics:
            return authorize(identity, self.config.allowed_users + self.config.metrics_users, "metrics")
        return authorize(identity, self.config.allowed_users, "control API")

    async def _identity(self, authorization: str | None) -> Decision:
        token = bearer_token(authorization)
        if token is None:
            self.counters.add(Count.AUTH_MISSING)
            return Decision(401, reason="a bearer token is required")
        key = hashlib.sha256(token.encode()).hexdigest()
        cached = self._cache.get(key)
        if cached is not None and cached[1] > time.monotonic():
            self._cache.move_to_end(key)
            return cached[0]
        try:
            review = await self._review(token)
        except ReviewUnavailable as exc:
            self.counters.add(Count.AUTH_UNAVAILABLE)
            log.warning("cannot review a control-API token", extra={"error": str(exc)})
            return Decision(503, reason="cannot verify credentials now")
        decision = identify(review, self.config.audience)
        self._cache[key] = (decision, time.monotonic() + self.config.cache_ttl_s)
        while len(self._cache) > MAX_CACHED_TOKENS:
            self._cache.popitem(last=False)
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
        async with self._gate:
            self.counters.add(Count.TOKEN_REVIEWS)
            try:
                async with self._session.post(
                        f"{url}/apis/authentication.k8s.io/v1/tokenreviews", json=review_body(token, self.config.audience),
                        headers={"Authorization": f"Bearer {own}"},
                        timeout=aiohttp.ClientTimeout(total=REVIEW_TIMEOUT_S)) as resp:
                    if resp.status != 201 and resp.status != 200:
                        raise ReviewUnavailable(f"TokenReview answered {resp.status}: {(await resp.text())[:200]}")
                    return await resp.json()
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                raise ReviewUnavailable(f"TokenReview failed: {exc.__class__.__name__}: {exc}") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
