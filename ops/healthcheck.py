"""Container health checks and start-up gates: ``python -m ops.healthcheck CHECK ...``.

    worker                     Redis answers PING and the database answers SELECT 1.
    sglang [--wait S] [-- CMD...]
                               every DATAGEN_SGLANG_URL server answers GET /health with 200;
                               with --wait, poll until they do, up to S s; with a command
                               after ``--``, then exec it (the worker's start-up gate).
    http URL [--status CODE]   GET URL answers CODE (default 200), e.g. Flower's /healthcheck.

Exit 0 when healthy and 1 when not: Docker reads only those two (2 is reserved). Each check
prints one line, without passwords. Settings come from the DATAGEN_* environment, like every
other datagen process. The checks are cheap on purpose (Docker runs them every few seconds
in every replica): no schema work, no Celery broadcast. A ``celery inspect`` ping would also
wait a full timeout per call and, with default transport options, restore running tasks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence

import requests

from common.errors import ConfigError
from common.services import database_problem, redis_problem, safe_url
from common.settings import Settings
from ops.argtypes import Parser, number, whole

HEALTHY, UNHEALTHY = 0, 1
#: Each check must answer well inside Docker's healthcheck timeout.
CHECK_TIMEOUT_S = 3.0


def check_redis(settings: Settings) -> str | None:
    """None when Redis answers PING, else why not."""
    why = redis_problem(settings.redis_url, CHECK_TIMEOUT_S)
    return None if why is None else f"Redis at {safe_url(settings.redis_url)}: {why}"


def check_database(settings: Settings) -> str | None:
    """None when the database answers SELECT 1, else why not (no schema is created)."""
    why = database_problem(settings.database_url, CHECK_TIMEOUT_S)
    return None if why is None else f"database {safe_url(settings.database_url)}: {why}"


def http_problem(url: str, status: int = 200, headers: dict[str, str] | None = None) -> str | None:
    """None when GET url answers ``status``, else why not."""
    try:
        resp = requests.get(url, headers=headers or {}, timeout=CHECK_TIMEOUT_S)
    except requests.RequestException as exc:
        return f"{url}: {exc.__class__.__name__}"
    if resp.status_code != status:
        return f"{url}: HTTP {resp.status_code} (expected {status})"
    return None


def sglang_problems(settings: Settings) -> list[str]:
    """The SGLang servers of DATAGEN_SGLANG_URL that do not answer /health yet."""
    headers = (
        {"Authorization": f"Bearer {settings.sglang_api_key}"} if settings.sglang_api_key else {}
    )
    found = (http_problem(f"{url}/health", 200, headers) for url in settings.sglang_urls)
    return [p for p in found if p]


def _report(problems: Sequence[str], ok: str) -> int:
    if problems:
        for problem in problems:
            print(f"unhealthy: {problem}", file=sys.stderr)
        return UNHEALTHY
    print(f"healthy: {ok}")
    return HEALTHY


def _run_worker(_args: argparse.Namespace, settings: Settings) -> int:
    problems = [p for p in (check_redis(settings), check_database(settings)) if p]
    return _report(problems, "Redis and the database answer")


def _run_sglang(args: argparse.Namespace, settings: Settings) -> int:
    servers = ", ".join(settings.sglang_urls)
    deadline = time.monotonic() + max(0.0, args.wait)
    next_note = 0.0
    while True:
        problems = sglang_problems(settings)
        if not problems or time.monotonic() >= deadline:
            status = _report(problems, f"SGLang answers at {servers}")
            if status == HEALTHY and args.then:
                sys.stdout.flush()
                try:  # replaces this process, so the command gets the container's signals
                    os.execvp(args.then[0], args.then)
                except OSError as exc:
                    print(f"cannot run {args.then[0]!r}: {exc}", file=sys.stderr)
                    return UNHEALTHY
            return status
        if time.monotonic() >= next_note:  # one line a minute while a model loads
            print(f"waiting for SGLang ({'; '.join(problems)})", file=sys.stderr, flush=True)
            next_note = time.monotonic() + 60
        time.sleep(min(args.interval, max(0.0, deadline - time.monotonic())))


def _run_http(args: argparse.Namespace, _settings: Settings) -> int:
    problem = http_problem(args.url, args.status)
    return _report([problem] if problem else [], f"{args.url} answers {args.status}")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="datagen healthcheck",
        description="Container health checks; exit 0 when healthy, 1 when not.",
    )
    sub = parser.add_subparsers(dest="check", required=True)
    sub.add_parser("worker", help="Redis answers PING and the database answers SELECT 1")
    sg = sub.add_parser("sglang", help="every DATAGEN_SGLANG_URL server answers /health")
    sg.add_argument("--wait", type=number(0), default=0.0, metavar="SECONDS",
                    help="poll until healthy, up to this long (default: check once)")
    sg.add_argument("--interval", type=number(0, inclusive=False),
                    default=5.0, metavar="SECONDS",
                    help="pause between two polls (default 5)")
    sg.add_argument("then", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                    help="once healthy, exec this command (e.g. -- datagen worker)")
    h = sub.add_parser("http", help="GET URL answers the expected status")
    h.add_argument("url")
    h.add_argument("--status", type=whole(100, 599), default=200,
                   help="expected status (default 200)")
    return parser


CHECKS: dict[str, Callable[[argparse.Namespace, Settings], int]] = {
    "worker": _run_worker,
    "sglang": _run_sglang,
    "http": _run_http,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    then = getattr(args, "then", None)
    if then and then[0] == "--":
        args.then = then[1:]
    try:
        settings = Settings.from_env()
    except ConfigError as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return UNHEALTHY
    try:
        return CHECKS[args.check](args, settings)
    except KeyboardInterrupt:
        return UNHEALTHY


if __name__ == "__main__":
    sys.exit(main())
