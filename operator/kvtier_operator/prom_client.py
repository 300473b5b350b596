"""A thin client of Prometheus' HTTP API and Alertmanager's, for rollout analysis:
every failure (unreachable, timeout, HTTP error, an answer of the wrong shape) comes
back as `Probe(error=...)`, never as an exception, so analysis can call it inconclusive.
"""
from __future__ import annotations

import asyncio
import math

import aiohttp

from kvtier_operator.analysis import Probe, matching_alerts

# One measurement must not hold the rollout tick: Prometheus answers in milliseconds.
QUERY_TIMEOUT_S = 5.0


async def query_value(session: aiohttp.ClientSession, url: str, expr: str) -> Probe:
    """An instant query expected to return at most one sample (a scalar, or a vector
    of one series; more series are summed — the query should aggregate itself)."""
    try:
        async with session.get(f"{url.rstrip('/')}/api/v1/query", params={"query": expr},
                               timeout=aiohttp.ClientTimeout(total=QUERY_TIMEOUT_S)) as resp:
            body = await resp.json(content_type=None)
            if resp.status != 200 or not isinstance(body, dict) or body.get("status") != "success":
                why = body.get("error", body) if isinstance(body, dict) else body
                return Probe(error=f"HTTP {resp.status}: {why!s:.200}")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return Probe(error=f"{url} unreachable ({exc.__class__.__name__}: {exc!s:.200})")
    data = body.get("data")
    return _sample(data) if isinstance(data, dict) else Probe(error=f"unexpected answer ({data!r:.200})")


def _sample(data: dict) -> Probe:
    try:
        kind, result = data["resultType"], data["result"]
        if kind == "scalar":
            return Probe(value=float(result[1]))
        if kind == "vector":
            values = [float(r["value"][1]) for r in result]
            if not values:
                return Probe()
            total = sum(values)
            return Probe(value=None if math.isnan(total) else total)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        return Probe(error=f"unexpected answer ({exc!r:.200})")
    return Probe(error=f"unexpected result type {data.get('resultType')!r}")


async def firing(session: aiohttp.ClientSession, url: str, api: str, alert: str, labels: dict[str, str]) -> Probe:
    """The alert's firing instances whose labels include `labels`, from Prometheus'
    /api/v1/alerts or Alertmanager's /api/v2/alerts (active, not silenced)."""
    base = url.rstrip("/")
    if api == "alertmanager":
        endpoint, params = f"{base}/api/v2/alerts", {"active": "true", "silenced": "false", "inhibited": "false"}
    else:
        endpoint, params = f"{base}/api/v1/alerts", {}
    try:
        async with session.get(endpoint, params=params, timeout=aiohttp.ClientTimeout(total=QUERY_TIMEOUT_S)) as resp:
            body = await resp.json(content_type=None)
            if resp.status != 200:
                return Probe(error=f"HTTP {resp.status}: {body!s:.200}")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return Probe(error=f"{url} unreachable ({exc.__class__.__name__}: {exc!s:.200})")
    alerts = body if api == "alertmanager" else _prometheus_alerts(body)
    if not isinstance(alerts, list) or not all(isinstance(a, dict) for a in alerts):
        return Probe(error=f"unexpected answer from {endpoint}")
    return Probe(firing=matching_alerts(alerts, alert, labels),
                 pending=matching_alerts(alerts, alert, labels, states=("pending",)))


def _prometheus_alerts(body: object) -> object:
    """The alert list of Prometheus' /api/v1/alerts answer (None when it has none)."""
    data = body.get("data") if isinstance(body, dict) else None
    return data.get("alerts") if isinstance(data, dict) else None
