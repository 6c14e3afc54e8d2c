"""Running the simulator: `SimServer` (background thread, for tests) and the CLI `main`.

The application itself (routes, middleware) is built in `sim.app`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import threading
from dataclasses import fields

from aiohttp import web

from sim.app import start_site
from sim.config import SimConfig
from sim.state import SIM_KEY, SimState
from sim.steplaw import PROFILES

log = logging.getLogger(__name__)

#: Upper bound of a clean shutdown (in-flight handlers are cancelled well before).
SHUTDOWN_TIMEOUT_S = 10.0


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
        "--trust-remote-code",
        action="store_true",
        help="--tokenizer may be a folder whose tokenizer class is Python code (runs it)",
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
    p.add_argument("--nul-every", type=int, default=d.nul_every, metavar="N",
                   help="every Nth output token is the NUL byte's token (default: never)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    gpu = p.add_argument_group("GPU physics (--physics gpu)")
    gpu.add_argument(
        "--physics",
        choices=("fast", "gpu"),
        default=d.physics,
        help="fast: N slots at --decode-tok-per-s (default); gpu: batched decode steps, "
        "KV pool, retraction, prefix cache",
    )
    gpu.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=d.profile,
        help="server whose step law and KV pool the gpu mode takes (default: reference)",
    )
    gpu.add_argument(
        "--kv-tokens", type=int, default=None, help="KV pool size in tokens (default: profile's)"
    )
    gpu.add_argument(
        "--time-scale",
        type=_positive_float,
        default=d.time_scale,
        help="simulated seconds per real second (10 = ten times faster than real time)",
    )
    return p


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


# The least value of each numeric flag (and the most, where there is one).
_BOUNDS: dict[str, tuple[float, float | None]] = {
    "port": (0, 65535), "max_running_requests": (1, None), "decode_tok_per_s": (0, None),
    "mean_output_tokens": (1, None), "context_length": (2, None),
    "max_queued_requests": (0, None), "error_rate": (0, 1), "error_status": (100, 599),
    "disconnect_rate": (0, 1), "latency_s": (0, None), "nul_every": (0, None),
    "kv_tokens": (1, None),
}


def config_from_args(argv: list[str] | None) -> SimConfig:
    """Parse CLI args into a SimConfig; a value out of its range is argparse's error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, (least, most) in _BOUNDS.items():
        value = getattr(args, name)
        if value is not None and not (least <= value and (most is None or value <= most)):
            span = f"at least {least:g}" if most is None else f"from {least:g} to {most:g}"
            parser.exit(2, f"{parser.prog}: error: --{name.replace('_', '-')} must be {span}, "
                           f"not {value:g}\n")
    return SimConfig(
        **{f.name: getattr(args, f.name) for f in fields(SimConfig) if hasattr(args, f.name)}
    )


def _install_stop_signals(stop: asyncio.Event) -> None:
    """SIGINT/SIGTERM ask for a clean stop; a second one exits at once (exit code 1)."""

    def on_signal() -> None:
        if stop.is_set():
            raise SystemExit(1)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, on_signal)


async def _serve_forever(cfg: SimConfig) -> None:
    stop = asyncio.Event()
    _install_stop_signals(stop)  # before the startup line: supervisors may signal right away
    runner, url = await start_site(cfg)
    print(  # the one startup line the CLI promises (logging may be silenced)
        f"datagen sim: serving on {url} (simulated SGLang; stands in for a GPU server)",
        flush=True,
    )
    try:
        await stop.wait()
        log.info("stop signal received; shutting down")
    finally:
        try:
            await asyncio.wait_for(runner.cleanup(), SHUTDOWN_TIMEOUT_S)
        except TimeoutError:
            log.warning("shutdown took over %.0f s; exiting anyway", SHUTDOWN_TIMEOUT_S)
        log.info("stopped")


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
