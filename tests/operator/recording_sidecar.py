"""A stand-in for the sidecar's HTTP control port, run by the node agent as a pod's
`kvtier-sidecar` container: it reports a fixed tenant list in GET /cache/stats and
records every POST /cache/warm (arrival and completion times) to a JSON-lines file.

Used because the real sidecar's /cache/stats does not list its tenants yet (the
operator learns known tenants from it); the real sidecar is used for injection.

    python recording_sidecar.py --tenants 200 --record-dir DIR --warm-s 0.3
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

from aiohttp import web

HTTP_PORT = 8081


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tenants", type=int, required=True)
    p.add_argument("--record-dir", type=Path, required=True)
    p.add_argument("--warm-s", type=float, default=0.3, help="how long a warm job runs")
    args = p.parse_args()
    pod, ip = os.environ["POD_NAME"], os.environ["POD_IP"]
    record = args.record_dir / f"{pod}.jsonl"
    tenants = [f"tenant-{i:04d}" for i in range(args.tenants)]
    jobs: dict[str, dict] = {}

    async def stats(_req: web.Request) -> web.Response:
        return web.json_response({"lookups": 1000, "hits": 600, "hit_rate": 0.6, "tenants": tenants})

    async def warm(req: web.Request) -> web.Response:
        body = await req.json()
        job = f"warm-{len(jobs) + 1}"
        entry = {"pod": pod, **body, "arrived": time.time(), "job": job}
        jobs[job] = {"state": "running"}

        async def finish() -> None:
            await asyncio.sleep(args.warm_s)
            entry["done"] = time.time()
            jobs[job]["state"] = "done"
            with record.open("a") as f:
                f.write(json.dumps(entry) + "\n")

        asyncio.get_running_loop().create_task(finish())
        return web.json_response({"accepted": True, "job": job}, status=202)

    async def job_states(_req: web.Request) -> web.Response:
        return web.json_response(jobs)

    async def ok(_req: web.Request) -> web.Response:
        return web.json_response({"ready": True})

    app = web.Application()
    app.router.add_get("/cache/stats", stats)
    app.router.add_post("/cache/warm", warm)
    app.router.add_get("/cache/jobs", job_states)
    app.router.add_get("/readyz", ok)
    web.run_app(app, host=ip, port=HTTP_PORT, print=None)


if __name__ == "__main__":
    main()
