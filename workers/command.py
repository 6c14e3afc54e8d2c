"""``datagen worker``: the same worker as ``celery -A workers worker``, with our defaults."""

from __future__ import annotations

import argparse
import logging
import os
import socket


def run_worker(args: argparse.Namespace) -> int:
    from workers.app import app, settings

    concurrency = args.concurrency or settings.concurrency
    argv = [
        "worker",
        "--pool=threads",
        f"--concurrency={concurrency}",
        f"--loglevel={args.loglevel}",
        f"--hostname={args.hostname or f'datagen-{os.getpid()}@{socket.gethostname()}'}",
        "--without-gossip",
        "--without-mingle",
    ]
    # One line per task received and per task done is noise at hundreds of tasks a second;
    # `datagen status` is the progress view. Failures and retries still log.
    for name in ("celery.app.trace", "celery.worker.strategy"):
        logging.getLogger(name).setLevel(logging.WARNING)
    app.worker_main(argv)
    return 0
