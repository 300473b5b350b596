"""The operator's calls to the sidecars' HTTP control API: stats (known tenants, hit
rate), warm-ups, and a tenant's hottest prefixes (a rollout's warm-before-ready). Every fault — a sidecar down, slow, or answering garbage — is a
missing answer, never an exception: it costs a cold tenant, not a stuck operator.

Over HTTPS (`ControlTls`): each call connects to the pod IP and verifies the sidecar's
certificate against the operator's CA for the name of the policy that injected it
(`control_tls.server_name`). A certificate that does not verify fails the handshake,
before the request — and so the bearer token — is sent; that too is a missing answer.
Without TLS (sidecars told to serve plain HTTP) no token is ever attached."""
from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import ValidationError

from kvtier import control_api as api
from kvtier import control_tls
from kvtier.sidecar_config import SidecarConfig

from kvtier_operator.membership import Member
from kvtier_operator.options import WARMS_PER_TARGET
from kvtier_operator.warmup import WarmTask

log = logging.getLogger("kvtier.operator.sidecars")

DEFAULT_HTTP_PORT = SidecarConfig.model_fields["http_port"].default
# Stats are small and sidecars are local to the cluster: a slow answer is a sick sidecar.
STATS_TIMEOUT_S = 3.0
# Warm-ups in flight at once, fleet-wide (per target: OperatorOptions.warms_per_target):
# the warm-up must not take the peer links away from live traffic.
MAX_WARMS_IN_FLIGHT = 16
JOB_POLL_INTERVAL_S = 0.1
# Stats requests in flight at once: a large fleet's refresh must not open a socket per
# member at the same instant (each answer is small; 16 keep a pass short).
MAX_STATS_IN_FLIGHT = 16


@dataclass(frozen=True, slots=True)
class MemberStats:
    """What the operator keeps of one member's `GET /cache/stats`."""

    member: str
    lookups: int
    # The hit figure: prompt tokens the pod's engine loaded from kvtier, over the prompt
    # tokens it looked up (both as the engine reported them; what lookups offered is
    # not read: the engine may take less, or nothing, when its own cache holds it).
    # Traffic only, like `lookups`: the rollout's warm-up requests are counted apart
    # (`sidecar.warmup_*`), which the operator does not read into any hit rate.
    loaded_tokens: int
    prompt_tokens: int
    tenants: tuple[str, ...]
    nvme_gbps: float | None = None  # shadow mode's measured read bandwidth of the pod's disk
    draining: bool = False  # the pod is leaving: its sidecar still serves peers


@dataclass(frozen=True, slots=True)
class FleetStats:
    per_member: tuple[MemberStats, ...]

    @property
    def tenants(self) -> list[str]:
        return sorted({t for s in self.per_member for t in s.tenants})

    @property
    def hit_rate(self) -> float | None:
        prompt = sum(s.prompt_tokens for s in self.per_member)
        return sum(s.loaded_tokens for s in self.per_member) / prompt if prompt else None

    @property
    def nvme_gbps(self) -> float | None:
        """The fleet's NVMe figure: the median of the members' measurements (one sick
        disk or one lucky cache neither condemns nor clears the tier)."""
        values = sorted(s.nvme_gbps for s in self.per_member if s.nvme_gbps)
        if not values:
            return None
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def parse_stats(member: str, body: Mapping[str, Any]) -> MemberStats | None:
    """A member's `GET /cache/stats` answer (`control_api.SidecarStats`); None when it
    is not one (a missing answer, like a sidecar that did not answer)."""
    try:
        stats = api.SidecarStats.model_validate(body)
    except ValidationError as exc:
        log.info("stats from %s do not parse: %s", member, exc)
        return None
    measured = stats.nvme.measured_gbps if stats.nvme is not None else None
    return MemberStats(
        member=member,
        lookups=stats.lookups,
        loaded_tokens=stats.engine.loaded_tokens,
        prompt_tokens=stats.engine.prompt_tokens,
        tenants=tuple(sorted(stats.tenants)),
        nvme_gbps=measured if measured is not None and measured > 0 else None,
        draining=stats.draining,
    )


class BearerToken:
    """The operator's projected token for the sidecars' audience, re-read when the file
    changes (kubelet rotates it well before it expires). No file: no header (sidecars
    whose control API is open)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._stamp: tuple | None = None
        self._value = ""

    def headers(self) -> dict[str, str] | None:
        if not self.path:
            return None
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp != self._stamp:
                self._value, self._stamp = open(self.path).read().strip(), stamp
        except OSError as exc:
            log.warning("cannot read the sidecar token %s: %s", self.path, exc)
        return {"Authorization": f"Bearer {self._value}"} if self._value else None


# Minted tokens live this long: the API server's shortest TokenRequest (ten minutes),
# against the projected token's hour. Renewed once half of that is gone.
MINTED_TOKEN_TTL_S = 600
# Pods whose tokens are kept; past it the least recently used is forgotten (re-minted).
MAX_MINTED_TOKENS = 10_000


class PodTokens:
    """Per sidecar, a token of this operator's ServiceAccount minted (TokenRequest) for
    that pod's own audience (`control_api.pod_audience`) and short-lived: a token one
    sidecar received is refused by every other. `mint(namespace, audience, ttl_s)` is
    the operator's Kube.request_token for its ServiceAccount."""

    def __init__(self, mint: Callable[[str, int], Awaitable[str]], ttl_s: int = MINTED_TOKEN_TTL_S) -> None:
        self._mint, self.ttl_s = mint, ttl_s
        self._tokens: OrderedDict[str, tuple[str, float]] = OrderedDict()

    async def headers(self, member: Member) -> dict[str, str] | None:
        audience = api.pod_audience(member.namespace, member.name)
        now = time.monotonic()
        cached = self._tokens.get(audience)
        if cached is None or cached[1] <= now:
            try:
                token = await self._mint(audience, self.ttl_s)
            except Exception as exc:  # the API server away: this call goes without (a 401, a missing answer)
                log.warning("cannot mint a token for %s: %s", audience, exc)
                return None
            cached = (token, now + self.ttl_s / 2)
            self._tokens[audience] = cached
            while len(self._tokens) > MAX_MINTED_TOKENS:
                self._tokens.popitem(last=False)
        self._tokens.move_to_end(audience)
        return {"Authorization": f"Bearer {cached[0]}"}


@dataclass(frozen=True, slots=True)
class ControlTls:
    """How the operator reaches sidecars over TLS: a context trusting only its CA."""

    context: ssl.SSLContext

    @classmethod
    def from_ca(cls, ca_pem: bytes) -> "ControlTls":
        return cls(control_tls.client_context(ca_pem))


class NotReachable(Exception):
    """A member this client will not call: it names no injecting policy, so there is no
    certificate name to verify."""


class SidecarClient:
    """One aiohttp session for the operator's lifetime (created in `on.startup`). Its
    credentials: per-pod minted tokens (`PodTokens`), else a token file for the
    sidecars' shared audience (`BearerToken`), else none (open sidecars); sent only over
    TLS that verified (`tls`; None: plain HTTP and never a token)."""

    def __init__(self, session: aiohttp.ClientSession, warms_per_target: int = WARMS_PER_TARGET,
                 token_file: str | None = None, pod_tokens: PodTokens | None = None,
                 tls: ControlTls | None = None, http_port: int = DEFAULT_HTTP_PORT):
        self._session = session
        self.http_port = http_port  # the port the webhook injects (a test's sidecar may differ)
        self.warms_per_target = warms_per_target
        self._token = BearerToken(token_file)
        self._pod_tokens = pod_tokens
        self.tls = tls

    @classmethod
    def create(cls, warms_per_target: int = WARMS_PER_TARGET, token_file: str | None = None,
               pod_tokens: PodTokens | None = None, tls: ControlTls | None = None,
               http_port: int = DEFAULT_HTTP_PORT) -> "SidecarClient":
        return cls(aiohttp.ClientSession(), warms_per_target, token_file, pod_tokens, tls, http_port)

    async def _auth(self, member: Member) -> dict[str, str] | None:
        if self.tls is None:  # a token over plain HTTP is a token for anyone on the path
            return None
        if self._pod_tokens is not None:
            return await self._pod_tokens.headers(member)
        return self._token.headers()

    async def _call(self, route: api.Route, member: Member, timeout: aiohttp.ClientTimeout,
                    json_body: Any = None, query: Mapping[str, str] | None = None) -> aiohttp.ClientResponse:
        """The request for `route`, to be used as `async with`; over TLS, verified for the member's
        policy. NotReachable, aiohttp.ClientError (a certificate that does not verify is
        a ClientConnectorCertificateError) and timeouts are the caller's missing answer."""
        kwargs: dict[str, Any] = {"timeout": timeout, "headers": await self._auth(member)}
        if json_body is not None:
            kwargs["json"] = json_body
        if self.tls is not None:
            if not member.policy or not member.namespace:
                raise NotReachable(f"{member.name} names no injecting policy: no certificate name to verify")
            kwargs.update(ssl=self.tls.context, server_hostname=control_tls.server_name(member.namespace, member.policy))
        return self._session.request(
            route.method, route.url(member.http_url(self.http_port, self.tls is not None), **(query or {})), **kwargs)

    async def close(self) -> None:
        await self._session.close()

    async def fleet_stats(self, members: Mapping[str, Member]) -> FleetStats:
        """Every member's stats, at most `MAX_STATS_IN_FLIGHT` requests at a time."""
        gate = asyncio.Semaphore(MAX_STATS_IN_FLIGHT)

        async def one(member: Member) -> MemberStats | None:
            async with gate:
                return await self._stats(member)
        answers = await asyncio.gather(*(one(m) for m in members.values()))
        return FleetStats(tuple(a for a in answers if a is not None))

    async def _stats(self, member: Member) -> MemberStats | None:
        try:
            async with await self._call(api.STATS, member, aiohttp.ClientTimeout(total=STATS_TIMEOUT_S)) as resp:
                if resp.status != 200:
                    log.info("no stats from %s: HTTP %s %s", member.name, resp.status, (await resp.text())[:200])
                    return None
                return parse_stats(member.name, await resp.json())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, NotReachable) as exc:
            log.info("no stats from %s: %s", member.name, exc)
            return None

    async def draining(self, candidates: Mapping[str, Member], terminating: Iterable[str] = ()
                       ) -> tuple[dict[str, Member], list[MemberStats]]:
        """The leavers among the candidates, and their stats: those whose sidecars answer
        stats with `draining: true`, or answer at all while their pod is `terminating`
        (being deleted). A native sidecar is signalled only once the engine container has
        exited, which can take the engine's whole shutdown: until then it serves its
        blocks without draining, and it is the best source its tenants have. A silent
        candidate, or a non-draining one whose pod is not being deleted, is simply gone:
        it is no source."""
        ending = set(terminating)
        answers = await asyncio.gather(*(self._stats(m) for m in candidates.values()))
        leaving = [s for s in answers if s is not None and (s.draining or s.member in ending)]
        return dict(sorted((s.member, candidates[s.member]) for s in leaving)), leaving

    async def release(self, leavers: Mapping[str, Member]) -> None:
        """Tell each leaver it may exit now (`POST /cache/drain/done`). Best effort: one
        that misses this exits when its drain goes idle or times out."""
        async def done(member: Member) -> None:
            try:
                async with await self._call(api.DRAIN_DONE, member, aiohttp.ClientTimeout(total=STATS_TIMEOUT_S),
                                            {}) as resp:
                    if resp.status == 409:  # its engine still shutting down: it drains once idle
                        log.info("leaving pod %s not draining yet: its drain ends once idle", member.name)
                    else:
                        log.info("released leaving pod %s: %s", member.name, resp.status)
            except (aiohttp.ClientError, asyncio.TimeoutError, NotReachable) as exc:
                log.info("leaving pod %s not released: %s", member.name, exc)
        await asyncio.gather(*(done(m) for m in leavers.values()))

    async def hot(self, member: Member, tenant: str, max_tokens: int,
                  timeout_s: float = STATS_TIMEOUT_S) -> api.HotPrompts | None:
        """`tenant`'s hottest prefixes on `member` (`GET /cache/hot`), within
        `max_tokens`; None when it does not answer (a missing answer, as always)."""
        query = {"tenant": tenant, "max_tokens": str(min(max_tokens, api.MAX_HOT_TOKENS))}
        try:
            async with await self._call(api.HOT, member, aiohttp.ClientTimeout(total=timeout_s), query=query) as resp:
                if resp.status != 200:
                    log.info("no hot prefixes of %s from %s: HTTP %s %s", tenant, member.name, resp.status,
                             (await resp.text())[:200])
                    return None
                answer = api.HotPrompts.model_validate(await resp.json())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, NotReachable) as exc:
            log.info("no hot prefixes of %s from %s: %s", tenant, member.name, exc)
            return None
        if answer.tenant != tenant:  # never another tenant's token ids
            log.warning("hot prefixes from %s name tenant %r, asked %r: ignored", member.name, answer.tenant, tenant)
            return None
        return answer

    async def warm_all(
        self, requests: Iterable[WarmTask], members: Mapping[str, Member], timeout_s: float,
        ref_prefix: str = "", on_done: Callable[[str], None] | None = None,
    ) -> set[str]:
        """Run the warm-ups (bounded concurrency) until done or `timeout_s` passes;
        returns the keys of those that finished, and calls `on_done(key)` as each does.

        Each request carries the ref `<ref_prefix>/<key>`: a sidecar asked again with a
        ref it remembers answers the job it already has, so re-running an epoch's
        warm-ups (an operator restarted mid-way) never starts a finished one twice."""
        deadline = time.monotonic() + timeout_s
        fleet = asyncio.Semaphore(MAX_WARMS_IN_FLIGHT)
        per_target: dict[str, asyncio.Semaphore] = {}
        done: set[str] = set()

        async def one(req: WarmTask) -> None:
            target = per_target.setdefault(req.target, asyncio.Semaphore(self.warms_per_target))
            async with fleet, target:
                if await self._warm(req, members, deadline, f"{ref_prefix}/{req.key}"):
                    done.add(req.key)
                    if on_done is not None:
                        on_done(req.key)

        tasks = [asyncio.create_task(one(r)) for r in requests]
        try:
            if tasks:
                await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        finally:  # timed out, or the operator is stopping: leave nothing running
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return done

    async def _warm(self, req: WarmTask, members: Mapping[str, Member], deadline: float, ref: str) -> bool:
        target, source = members.get(req.target), members.get(req.source)
        if target is None or source is None:
            return False
        body = api.WarmRequest(tenant=req.tenant, from_peer=source.peer_address(), max_bytes=req.max_bytes, ref=ref)
        try:
            while True:
                remaining = aiohttp.ClientTimeout(total=max(0.1, deadline - time.monotonic()))
                async with await self._call(api.WARM, target, remaining, api.dump(body)) as resp:
                    if resp.status in ASK_AGAIN_STATUSES:  # ask again when told, within the deadline
                        wait_s = _retry_after_s(resp.headers.get("Retry-After"))
                        if time.monotonic() + wait_s >= deadline:
                            return False
                        await asyncio.sleep(wait_s)
                        continue
                    if resp.status != api.WARM.status:
                        log.warning("warm %s on %s refused: %s %s", req.tenant, req.target, resp.status,
                                    await resp.text())
                        return False
                    accepted = api.WarmAccepted.model_validate(await resp.json())
                    break
            return await self._wait_job(target, accepted.job, deadline)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, NotReachable) as exc:
            log.info("warm %s on %s failed: %s", req.tenant, req.target, exc)
            return False

    async def _wait_job(self, target: Member, job: api.JobId, deadline: float) -> bool:
        """Warm-ups run in the background on the sidecar: wait for the job to finish."""
        while time.monotonic() < deadline:
            timeout = aiohttp.ClientTimeout(total=max(0.1, min(STATS_TIMEOUT_S, deadline - time.monotonic())))
            async with await self._call(api.JOBS, target, timeout) as resp:
                record = api.Jobs.model_validate(await resp.json()).root.get(job) if resp.status == 200 else None
            if record is not None and record.state == api.JobState.DONE:
                return True
            if record is not None and record.state == api.JobState.FAILED:
                log.warning("warm-up job %s on %s failed: %s", job, target.name, record.error)
                return False
            await asyncio.sleep(JOB_POLL_INTERVAL_S)
        return False


# Answers that mean "not now" rather than "no": 429, the sidecar's warm queue is full;
# 503, its global index cannot confirm the source peer (Redis away). Both say when.
ASK_AGAIN_STATUSES = (429, 503)
# When such an answer carries no usable Retry-After: a second, then ask again.
DEFAULT_RETRY_AFTER_S = 1.0


def _retry_after_s(header: str | None) -> float:
    try:
        return max(0.1, float(header)) if header else DEFAULT_RETRY_AFTER_S
    except ValueError:
        return DEFAULT_RETRY_AFTER_S
