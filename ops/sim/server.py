"""The simulator's aiohttp application, a background-thread runner for tests, and the CLI.

Routes (SGLang's wire format, see /work/shared/SGLANG_API.md):
  POST|PUT /generate, POST /abort_request, GET /health /health_generate /ready,
  GET /model_info /get_model_info /server_info /get_server_info /v1/models /metrics,
  GET|POST /flush_cache.
Simulator-only control routes (not SGLang):
  GET  /sim/requests   request log (?limit=N, ?rid_prefix=P)
  GET  /sim/stats      counters: requests, running, waiting, completed, aborted, ...
  GET  /sim/faults     current faults
  POST /sim/faults     set any of error_rate, error_status, fail_next, disconnect_rate,
                       disconnect_next, latency_s, down_for_s, decode_tok_per_s, abort_next
  POST /sim/reset      clear the log, counters and faults
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Awaitable, Callable
from dataclasses import fields

from aiohttp import web

from ops.sim import control, info
from ops.sim.config import SimConfig
from ops.sim.generate import handle_generate
from ops.sim.responses import drop_connection
from ops.sim.state import SIM_KEY, SimState

log = logging.getLogger(__name__)

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
    r.add_get("/metrics", info.handle_metrics)
    r.add_route("*", "/flush_cache", info.handle_flush_cache)
    r.add_get("/sim/requests", control.handle_requests)
    r.add_get("/sim/stats", control.handle_stats)
    r.add_get("/sim/faults", control.handle_faults_get)
    r.add_post("/sim/faults", control.handle_faults_post)
    r.add_post("/sim/reset", control.handle_reset)

    async def _close_log(app: web.Application) -> None:
        app[SIM_KEY].log.close()

    app.on_cleanup.append(_close_log)
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


class SimServer:
    """A simulator on a background thread with its own event loop (for tests and demos).

    srv = SimServer(SimConfig(port=0)); url = srv.start(); ...; srv.stop()
    """

    def __init__(self, cfg: SimConfig | None = None) -> None:
        self.cfg = cfg or SimConfig()
        self.url: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def state(self) -> SimState:
        """The live SimState (read it only from tests; it belongs to the server thread)."""
        if self._runner is None:
            raise RuntimeError("server not started")
        return self._runner.app[SIM_KEY]

    def start(self, timeout: float = 10.0) -> str:
        """Start serving; returns the base URL `http://host:port`."""
        if self._thread is not None:
            raise RuntimeError("server already started")
        loop = asyncio.new_event_loop()
        future = asyncio.run_coroutine_threadsafe(start_site(self.cfg), loop)
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="datagen-sim", daemon=True)
        self._thread.start()
        try:
            self._runner, self.url = future.result(timeout)
        except BaseException:
            self.stop()  # e.g. port in use: do not leak the loop thread
            raise
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and join the thread (in-flight requests are cut)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if self._runner is not None:
            cleanup = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), loop)
            try:
                cleanup.result(timeout)
            except Exception:  # shutting down anyway: log and go on
                log.exception("simulator cleanup failed")
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        loop.close()
        self._loop = self._thread = self._runner = None

    def __enter__(self) -> SimServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def build_parser() -> argparse.ArgumentParser:
    """`datagen sim` flags; each maps to the SimConfig field of the same name."""
    d = SimConfig()
    p = argparse.ArgumentParser(
        prog="datagen sim",
        description="Simulated SGLang server (native /generate API) for tests and demos.",
    )
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    p.add_argument(
        "--decode-tok-per-s",
        type=float,
        default=d.decode_tok_per_s,
        help="decode speed of each running sequence; 0 = instant",
    )
    p.add_argument("--mean-output-tokens", type=int, default=d.mean_output_tokens)
    p.add_argument("--context-length", type=int, default=d.context_length)
    p.add_argument("--model-name", default=d.model_name)
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        default=None,
        help="directory with tokenizer.json for realistic ids and text",
    )
    p.add_argument(
        "--request-log",
        metavar="PATH",
        default=None,
        help="append one JSON line per finished request",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="waiting-queue bound; beyond it requests get 503 (default: unbounded)",
    )
    p.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="stream deltas instead of cumulative outputs",
    )
    p.add_argument("--error-rate", type=float, default=d.error_rate)
    p.add_argument("--error-status", type=int, default=d.error_status)
    p.add_argument("--disconnect-rate", type=float, default=d.disconnect_rate)
    p.add_argument("--latency-s", type=float, default=d.latency_s)
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the fault injection")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    return p


def config_from_args(argv: list[str] | None) -> SimConfig:
    """Parse CLI args into a SimConfig."""
    args = build_parser().parse_args(argv)
    return SimConfig(
        **{f.name: getattr(args, f.name) for f in fields(SimConfig) if hasattr(args, f.name)}
    )


async def _serve_forever(cfg: SimConfig) -> None:
    runner, url = await start_site(cfg)
    print(  # the one startup line the CLI promises (logging may be silenced)
        f"datagen sim: serving on {url} (simulated SGLang; stands in for a GPU server)",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    """CLI entry of `datagen sim`; returns the process exit code."""
    cfg = config_from_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(_serve_forever(cfg))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        log.error("cannot serve on %s:%s: %s", cfg.host, cfg.port, exc)
        return 1
    return 0
