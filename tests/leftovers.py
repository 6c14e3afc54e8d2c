"""``datagen`` processes a test module started and left running.

A worker left running after its test keeps beating on the module's Redis database: once
a later test flushes that database, the worker pairs it again with its own (by then
unrelated) results database, and the later test finds Redis paired with another store.
conftest's module fixture ends such processes and names the module that left them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

PROC = Path("/proc")


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in (PROC / str(pid) / "task").glob("*/children"):
        try:
            found += [int(c) for c in task.read_text().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return found


def _argv(pid: int) -> list[str]:
    try:
        return (PROC / str(pid) / "cmdline").read_text().split("\0")
    except OSError:
        return []


def datagen_children(pid: int | None = None) -> dict[int, str]:
    """This process's live children that run ``datagen`` (the script or ``ops.cli``)."""
    found = {}
    for child in _children(os.getpid() if pid is None else pid):
        argv = [a for a in _argv(child) if a]
        if any(a.endswith("/datagen") or a == "ops.cli" for a in argv):
            found[child] = " ".join(argv)
    return found


def end(pids: list[int], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL whatever is still there after ``grace_s``; reap them all."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for pid in pids:
        while time.monotonic() < deadline and _reap(pid) is None:
            time.sleep(0.1)
        if _reap(pid) is None:
            _signal(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.waitpid(pid, 0)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, ChildProcessError):
        os.kill(pid, sig)


def _reap(pid: int) -> int | None:
    """The pid once it has exited (reaped here), None while it runs."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # reaped already (by its Popen)
        return pid
    return done or None
