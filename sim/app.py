"""The simulator's aiohttp application: SGLang routes plus the /sim/ control routes.

Routes (SGLang's wire format, see shared/SGLANG_API.md):
  POST|PUT /generate, POST /abort_request, GET /health /health_generate /ready,
  GET /model_info /get_model_info /server_info /get_server_info /v1/models /metrics
  /v1/loads, GET|POST /flush_cache, POST /parse_function_call /separate_reasoning (the
  simulator's own format: sim/toolcalls.py).
Simulator-only control routes (not SGLang):
  GET  /sim/requests   request log (?limit=N, ?rid_prefix=P)
  GET  /sim/stats      counters: requests, running, waiting, completed, aborted, ...
  GET  /sim/faults     current faults
  POST /sim/faults     set any of error_rate, error_status, fail_next, disconnect_rate,
                       disconnect_next, latency_s, down_for_s, decode_tok_per_s, abort_next
  POST /sim/reset      clear the log, counters and faults
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from sim import control, info, metrics, parsers
from sim.config import SimConfig
from sim.generate import handle_generate
from sim.responses import drop_connection
from sim.state import SIM_KEY, SimState

#: Listen backlog: the benchmark opens a few hundred connections at once.
BACKLOG = 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _outage_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """During `down_for_s`, SGLang routes drop the connection (/generate logs it itself)."""
    path = request.path
    if path.startswith("/sim/") or path == "/generate":
        return await handler(request)
    if request.app[SIM_KEY].injector.faults.is_down():
        return await drop_connection(request)
    return await handler(request)


def build_app(cfg: SimConfig) -> web.Application:
    """The aiohttp application for one simulator instance."""
    app = web.Application(middlewares=[_outage_middleware], client_max_size=64 * 1024**2)
    sim = SimState(cfg)
    app[SIM_KEY] = sim
    r = app.router
    r.add_post("/generate", handle_generate)
    r.add_put("/generate", handle_generate)
    r.add_post("/abort_request", info.handle_abort)
    for path in ("/health", "/health_generate", "/ready"):
        r.add_get(path, info.handle_ok)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, info.handle_model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, info.handle_server_info)
    r.add_get("/v1/models", info.handle_models)
    r.add_get("/metrics", metrics.handle_metrics)
    r.add_get("/v1/loads", metrics.handle_loads)
    r.add_route("*", "/flush_cache", info.handle_flush_cache)
    r.add_post("/parse_function_call", parsers.handle_parse_function_call)
    r.add_post("/separate_reasoning", parsers.handle_separate_reasoning)
    r.add_get("/sim/requests", control.handle_requests)
    r.add_get("/sim/stats", control.handle_stats)
    r.add_get("/sim/faults", control.handle_faults_get)
    r.add_post("/sim/faults", control.handle_faults_post)
    r.add_post("/sim/reset", control.handle_reset)

    async def _close(app: web.Application) -> None:
        await app[SIM_KEY].engine.close()
        app[SIM_KEY].log.close()

    app.on_cleanup.append(_close)
    return app


async def start_site(cfg: SimConfig) -> tuple[web.AppRunner, str]:
    """Start serving cfg on its host/port; returns the runner and the base URL."""
    runner = web.AppRunner(
        build_app(cfg),
        handle_signals=False,
        access_log=logging.getLogger("aiohttp.access") if cfg.access_log else None,
        handler_cancellation=True,  # a client disconnect cancels its handler (aborts)
        shutdown_timeout=1.0,
    )
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, backlog=BACKLOG, reuse_address=True)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    addresses = runner.addresses  # tells the port the OS picked when cfg.port is 0
    port = addresses[0][1] if addresses else cfg.port
    return runner, f"http://{cfg.host}:{port}"
