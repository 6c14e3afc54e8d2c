"""``datagen worker``: the same worker as ``celery -A workers worker``, with our defaults."""

from __future__ import annotations

import argparse
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
    app.worker_main(argv)
    return 0
