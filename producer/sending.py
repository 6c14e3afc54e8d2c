"""The producer's publishing, in a child process beside the one that reads and stores.

Celery's message costs about 55 µs of Python (common/messages.py), all of it
under the GIL, about what reading, rendering and storing a prompt cost together. In its
own process (``spawn``: nothing of this one's threads or sockets is inherited) it runs
on another core while this process prepares the next chunks. One process takes the
chunks one at a time in the order they are handed over, so they reach Redis in order,
and after a chunk fails it publishes none of the later ones: the run stops at the first
error, and its re-run publishes from SQL whatever Redis lacks.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_context

from celery import Celery

from common.publish import Publisher

# How often the child looks whether the producer that started it is still alive.
PARENT_CHECK_S = 1.0


class Abandoned(Exception):
    """A chunk not published because an earlier one failed; that failure is the one raised."""


class _InOrder:
    """Publishes chunks one after another and refuses any after a failed one."""

    def __init__(self, app: Celery) -> None:
        self.publisher = Publisher(app)
        self.failed = False

    def publish(self, dataset: str, stamp: str, sample_ids: Sequence[str],
                ahead: bool = False) -> None:
        if self.failed:
            raise Abandoned()
        try:
            self.publisher.publish(dataset, stamp, sample_ids, ahead)
        except BaseException:
            self.failed = True
            raise


class Sender:
    """Hands chunks to the publishing process; ``in_child=False`` keeps it in a thread of
    this process (tests that change the publisher's behaviour in place use it)."""

    def __init__(self, app: Celery, in_child: bool = True) -> None:
        self._pool: Executor
        if in_child:
            self._pool = ProcessPoolExecutor(
                max_workers=1, mp_context=get_context("spawn"),
                initializer=_start_child, initargs=(app, os.getpid()),
            )
            self._submit_chunk = lambda *chunk: self._pool.submit(_publish_in_child, *chunk)
            # The child starts importing Celery now, while the first chunk is read.
            self._pool.submit(int)
        else:
            in_order = _InOrder(app)
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish")
            self._submit_chunk = lambda *chunk: self._pool.submit(in_order.publish, *chunk)

    def submit(self, dataset: str, stamp: str, sample_ids: Sequence[str],
               ahead: bool = False) -> Future[None]:
        """Queue a chunk for publishing (``ahead``: before the dataset's new prompts, as
        ``Publisher.publish``); its future is done once it is all in Redis."""
        return self._submit_chunk(dataset, stamp, list(sample_ids), ahead)

    def close(self) -> None:
        """Wait for the chunks handed over; the publishing process then exits."""
        self._pool.shutdown(wait=True, cancel_futures=True)


_child: _InOrder | None = None


def _start_child(app: Celery, parent_pid: int) -> None:
    global _child
    _child = _InOrder(app)
    # Ctrl-C reaches the whole process group: the producer stops and closes the Sender,
    # which lets the chunk in hand finish; an interrupt here would only print a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()


def _exit_with_parent(parent_pid: int) -> None:
    """A producer killed outright (SIGKILL) cannot stop its child; the child, re-parented,
    stops itself. What it had not published is still queued in SQL."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_S)
    os._exit(0)


def _publish_in_child(dataset: str, stamp: str, sample_ids: list[str], ahead: bool) -> None:
    assert _child is not None, "the publishing process was not started by Sender"
    _child.publish(dataset, stamp, sample_ids, ahead)
