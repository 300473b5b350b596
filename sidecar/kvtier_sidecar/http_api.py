"""The HTTP control API (aiohttp): stats, invalidation, warm-up, metrics, probes. Its
routes are `kvtier.control_api.ROUTES`, one handler registered for each:

    GET  /cache/stats?tenant=T   per-tenant (or whole-cache) hit rates, tiers, bytes
    POST /cache/invalidate       {"model_version": V}            -> 202, dropped in background
    POST /cache/warm             {"tenant", "from_peer", "max_bytes", "ref"?} -> 202, pulled in background
                                 (409 when the peer tier is off or a known ref comes with other
                                 parameters; a known ref with the same ones answers its job;
                                 403 when from_peer is not a member of this sidecar's fleet;
                                 503 with Retry-After while the global index cannot say;
                                 429 with Retry-After when the bounded warm queue is full)
    POST /cache/drain/done       a draining sidecar may exit now (409 when not draining)
    GET  /cache/jobs             background jobs: state, started_s/finished_s (wall clock), bytes
    GET  /cache/hot?tenant=T&max_tokens=N  T's hottest prefixes (token ids, frequency), best
                                 first by frequency x length, within N tokens (400: bad tenant or N)
    GET  /metrics                Prometheus text, top-N tenants + "other" (tenant labels are keyed
                                 digests while /metrics needs no token and /cache/ does)
    GET  /healthz, /readyz

Bodies and answers are the pydantic models of `kvtier.control_api` (the operator's
client reads the same ones), built as models and serialised here; anything malformed
is a 4xx with a message saying what was wrong: a body that is not `application/json`
is 415, one nested deeper than the parser goes is 400, a tenant outside
`kvtier.tenants`' rule is 400 (stats) or 422 (warm). Handlers are thin: the work is in `service.Sidecar`.

The port serves HTTPS only (`control_tls`; main.py loads the certificate and reloads it
when renewed), unless the config chose `control_tls.plain_http` explicitly.
Everything under /cache/ (and /metrics when `control_auth.protect_metrics`) needs the
operator's token (see `control_auth`): 401 without a valid one, 403 for someone else,
and nothing changes. /healthz and /readyz are always open (the kubelet probes them).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging

from aiohttp import web
from pydantic import BaseModel, ValidationError

from kvtier import control_api as api
from kvtier import tenants

from . import metrics as metrics_mod
from .control_auth import RATE_LIMIT_RETRY_AFTER_S
from .global_index import MEMBERSHIP_RETRY_AFTER_S, MembershipUnknown
from .service import PeerTierDisabled, QueueFull, RefConflict

log = logging.getLogger("kvtier.sidecar.http")

MAX_BODY_BYTES = 64 << 10
JSON_TYPE = "application/json"


def _answer(answer: BaseModel, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(api.dump(answer), status=status, headers=headers)


def _bad(message: str, status: int = 400) -> web.Response:
    return _answer(api.ErrorBody(error=message), status)


async def _body(request: web.Request, model: type[BaseModel]) -> BaseModel | web.Response:
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        return _bad(f"body larger than {MAX_BODY_BYTES} bytes", 413)
    raw = await request.content.read(MAX_BODY_BYTES + 1)
    if len(raw) > MAX_BODY_BYTES:
        return _bad(f"body larger than {MAX_BODY_BYTES} bytes", 413)
    if raw and request.content_type != JSON_TYPE:
        return _bad(f"body must be {JSON_TYPE} (got {request.content_type or 'no Content-Type'})", 415)
    try:
        data = json.loads(raw or b"null")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return _bad(f"body is not JSON: {exc}")
    except RecursionError:  # the parser's own bound on nesting: requests are flat objects
        return _bad("body nests too deeply to be a request (requests are flat JSON objects)")
    if not isinstance(data, dict):
        return _bad("body must be a JSON object")
    try:
        return model.model_validate(data)
    except (ValidationError, ValueError) as exc:
        errors = exc.errors(include_url=False) if isinstance(exc, ValidationError) else [{"msg": str(exc)}]
        fields = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())) or 'body'}: {e['msg']}" for e in errors)
        return _bad(f"invalid request: {fields}", 422)


# Keys the hashed tenant labels when no peer secret is configured: the digests are then
# the same everywhere, which hides names but not a guess of one (set a peer secret).
UNKEYED_LABELS = b"kvtier-tenant-label"


def _label_key(service) -> bytes:
    """The policy's peer secret (shared by its sidecars only), read once at start-up."""
    try:
        return service.config.peer_secret() or UNKEYED_LABELS
    except OSError:
        return UNKEYED_LABELS

REPORT_THREADS = 1
"""`/cache/stats` and `/metrics` are assembled on one thread of their own, never on
the event loop that also serves the engine socket: a scrape storm queues behind
itself and does not hold up an engine's lookup."""


def make_app(service, auth=None, protect_metrics: bool = False) -> web.Application:
    """`auth`: a control_auth.TokenReviewer, or None for an open control API."""
    reports = concurrent.futures.ThreadPoolExecutor(REPORT_THREADS, thread_name_prefix="report")

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(reports, fn, *args)

    async def stats(request: web.Request) -> web.Response:
        tenant = request.query.get("tenant")
        if tenant is not None and not tenants.is_tenant(tenant):
            return _bad(f"tenant is not a tenant name ({tenants.TENANT_RULE})")
        return _answer(await off_loop(service.stats, tenant))

    async def invalidate(request: web.Request) -> web.Response:
        body = await _body(request, api.INVALIDATE.request)
        if isinstance(body, web.Response):
            return body
        job = service.invalidate_version(body.model_version)
        return _answer(api.InvalidateAccepted(model_version=body.model_version, job=job), api.INVALIDATE.status)

    async def warm(request: web.Request) -> web.Response:
        body = await _body(request, api.WARM.request)
        if isinstance(body, web.Response):
            return body
        try:
            member = await service.may_warm_from(body.from_peer)
        except MembershipUnknown as exc:  # Redis is away: neither yes nor no, ask again
            response = _bad(f"{exc}; retry later", 503)
            response.headers["Retry-After"] = str(MEMBERSHIP_RETRY_AFTER_S)
            return response
        if not member:
            return _bad(f"from_peer {body.from_peer} is not a member of this sidecar's fleet "
                        "(neither in warm_peers nor a live member of the global index)", 403)
        try:
            job, started = service.warm(body.tenant, body.from_peer, body.max_bytes, body.ref)
        except (PeerTierDisabled, RefConflict) as exc:
            return _bad(str(exc), 409)
        except QueueFull as exc:
            response = _bad(str(exc), 429)
            response.headers["Retry-After"] = str(exc.retry_after_s)
            return response
        return _answer(api.WarmAccepted(job=job, started=started), api.WARM.status)

    async def drain_done(request: web.Request) -> web.Response:
        if not service.finish_drain():
            return _bad("not draining: this sidecar has not been asked to stop", 409)
        return _answer(api.DrainDone(), api.DRAIN_DONE.status)

    async def hot(request: web.Request) -> web.Response:
        tenant, raw = request.query.get("tenant"), request.query.get("max_tokens")
        if tenant is None or not tenants.is_tenant(tenant):
            return _bad(f"tenant is required and must be a tenant name ({tenants.TENANT_RULE})")
        if not (raw and raw.isascii() and raw.isdigit() and len(raw) <= 8 and 0 < int(raw) <= api.MAX_HOT_TOKENS):
            return _bad(f"max_tokens must be an integer from 1 to {api.MAX_HOT_TOKENS} (got {raw!r})")
        return _answer(await off_loop(service.hot, tenant, int(raw)))

    async def jobs(request: web.Request) -> web.Response:
        return _answer(api.Jobs(service.jobs()))

    # /metrics open while the control API is not: tenants appear as keyed digests only.
    tenant_label = None if auth is None or protect_metrics else metrics_mod.hashed_tenants(_label_key(service))

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=await off_loop(service.metrics_text, tenant_label), content_type="text/plain",
                            charset="utf-8",
                            headers={"X-Prometheus-Format": "0.0.4"})

    async def healthz(request: web.Request) -> web.Response:
        return _answer(api.Health())

    async def readyz(request: web.Request) -> web.Response:
        ready, why = service.readiness()
        return _answer(api.Readiness(ready=ready, detail=why), 200 if ready else 503)

    @web.middleware
    async def never_crash(request: web.Request, handler):
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except Exception:  # a bug answers 500 for that request; the server keeps serving
            log.exception("http handler failed", extra={"path": request.path})
            return _bad("internal error", 500)

    @web.middleware
    async def authenticated(request: web.Request, handler):
        is_metrics = request.path == api.METRICS.path
        if auth is None or not (request.path.startswith(api.PROTECTED_PREFIX) or (protect_metrics and is_metrics)):
            return await handler(request)
        decision = await auth.check(request.headers.get("Authorization"), metrics=is_metrics,
                                    source=request.remote or "")
        if decision.allowed:
            return await handler(request)
        headers = {"WWW-Authenticate": 'Bearer realm="kvtier-sidecar"'} if decision.status == 401 else None
        if decision.status == 429:
            headers = {"Retry-After": str(RATE_LIMIT_RETRY_AFTER_S)}
        return _answer(api.ErrorBody(error=decision.reason), decision.status, headers)

    app = web.Application(middlewares=[never_crash, authenticated], client_max_size=MAX_BODY_BYTES)

    async def stop_reports(app: web.Application) -> None:
        reports.shutdown(wait=False, cancel_futures=True)
    app.on_cleanup.append(stop_reports)
    handlers = {"stats": stats, "invalidate": invalidate, "warm": warm, "drain_done": drain_done, "jobs": jobs, "hot": hot,
                "metrics": metrics, "healthz": healthz, "readyz": readyz}
    if set(handlers) != {route.name for route in api.ROUTES}:
        raise RuntimeError(f"handlers {sorted(handlers)} are not the routes of control_api.ROUTES")
    for route in api.ROUTES:
        app.router.add_route(route.method, route.path, handlers[route.name])
    return app
