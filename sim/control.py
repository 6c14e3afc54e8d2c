"""Simulator-only control endpoints under /sim/ (never part of SGLang's API).

They let tests and demos observe what the server saw (`/sim/requests`, `/sim/stats`) and
break it on purpose (`/sim/faults`), then start clean (`/sim/reset`). They keep working
while a `down_for_s` outage makes every other route drop its connections.
"""

from __future__ import annotations

import json

from aiohttp import web

from sim.responses import json_response
from sim.state import SIM_KEY


def _int_query(request: web.Request, name: str) -> int | None:
    raw = request.query.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be an integer") from None


async def handle_requests(request: web.Request) -> web.Response:
    """GET /sim/requests[?limit=N][&rid_prefix=P]: the request log, oldest first."""
    sim = request.app[SIM_KEY]
    entries = sim.log.snapshot(_int_query(request, "limit"), request.query.get("rid_prefix"))
    return json_response(entries)


async def handle_faults_get(request: web.Request) -> web.Response:
    """GET /sim/faults: current fault settings."""
    return json_response(request.app[SIM_KEY].injector.faults.snapshot())


async def handle_faults_post(request: web.Request) -> web.Response:
    """POST /sim/faults {...}: change any subset of the faults; returns the settings."""
    sim = request.app[SIM_KEY]
    try:
        body = json.loads(await request.read() or b"{}")
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")
        sim.injector.faults.update(body)
    except ValueError as exc:
        return json_response({"error": str(exc)}, 400)
    return json_response(sim.injector.faults.snapshot())


async def handle_reset(request: web.Request) -> web.Response:
    """POST /sim/reset: clear the request log, counters and faults."""
    sim = request.app[SIM_KEY]
    sim.reset()
    return json_response(sim.injector.faults.snapshot())


async def handle_stats(request: web.Request) -> web.Response:
    """GET /sim/stats: counters and current load."""
    return json_response(request.app[SIM_KEY].stats())
