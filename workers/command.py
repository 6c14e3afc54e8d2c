"""``datagen worker``: the same worker as ``celery -A workers worker``, with our defaults."""

from __future__ import annotations

import argparse
import logging
import os
import socket

from common.settings import AUTO, Settings, env_name

APP = "workers.celery:app"


def worker_argv(args: argparse.Namespace) -> list[str]:
    """Celery's command line for this worker. Without ``--concurrency N`` the app's own
    ``worker_concurrency`` applies: DATAGEN_CONCURRENCY, or under auto the most threads
    (DATAGEN_MAX_CONCURRENCY)."""
    argv = [
        f"--app={APP}",
        "worker",
        "--pool=threads",
        f"--loglevel={args.loglevel}",
        f"--hostname={args.hostname or f'datagen-{os.getpid()}@{socket.gethostname()}'}",
        "--without-gossip",
        "--without-mingle",
    ]
    if args.concurrency and args.concurrency != AUTO:
        argv.append(f"--concurrency={args.concurrency}")
    return argv


def run_worker(args: argparse.Namespace, settings: Settings) -> int:
    if args.concurrency == AUTO:
        # Celery builds the app (workers/celery.py) from the environment: the flag
        # reaches it there, as it reaches Celery's pool through its own --concurrency.
        os.environ[env_name("concurrency")] = AUTO
    # One line per task received and per task done is noise at hundreds of tasks a second;
    # `datagen status` is the progress view. Failures and retries still log.
    for name in ("celery.app.trace", "celery.worker.strategy"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return _celery_main(worker_argv(args))


def _celery_main(argv: list[str]) -> int:
    """Run Celery's CLI and return its exit code.

    ``app.worker_main`` and ``app.start`` drop the code that ``celery worker`` computes
    (``worker.exitcode``, 1 after an "Unrecoverable error"), so a worker that could not
    start would exit 0 and a supervisor would not notice it. Click returns that code when
    it does not own the process (``standalone_mode=False``).
    """
    from celery.bin.celery import celery as celery_command
    from click.exceptions import Exit

    try:
        return int(celery_command.main(args=argv, standalone_mode=False) or 0)
    except Exit as exc:
        return int(exc.exit_code)
