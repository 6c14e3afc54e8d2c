"""Started marks of a worker's streamed requests, written to Redis together.

A close under ``drain`` aborts the requests its servers have not started, which have
produced nothing, and lets the started ones run (common/closing.py); a request's mark in
its dataset's ``started`` set says it has started. One command per request put a Redis
round trip, and a thread's wait for it, inside every request's stream, which at full
rate cost a worker a tenth of its completions and more (docs/PERFORMANCE.md). Written
together every ``FLUSH_S``, a mark is late by that at most, and a close in that window
aborts a request that has just started: its first tokens, never kept, are all it loses.

A mark must reach Redis before the script that removes its rid's inflight entry (the
charge, or the release), which removes the mark with it: a mark written after that
would stay in the set for the whole run. ``forget`` keeps that order: a mark not yet
written is dropped, and one being written is waited for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import redis

log = logging.getLogger(__name__)
# Longest a mark waits to be written: a close sooner after a request's first token than
# this may abort it (at ~30 tokens a second a sequence, its first 3 tokens).
FLUSH_S = 0.1
# (dataset, rid) of each request started since the last write.
Write = Callable[[Sequence[tuple[str, str]]], None]


class StartedMarks:
    """``mark`` from the request threads; one thread of its own writes what they marked,
    every ``every_s`` while there is something to write, in one round trip."""

    def __init__(self, write: Write, every_s: float = FLUSH_S) -> None:
        self._write = write
        self.every_s = every_s
        self._pending: dict[str, str] = {}  # rid -> dataset
        self._writing: frozenset[str] = frozenset()
        self._lock = threading.Condition()
        self._due = threading.Event()  # something is pending
        self._thread: threading.Thread | None = None

    def mark(self, dataset: str, rid: str) -> None:
        with self._lock:
            self._pending[rid] = dataset
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="started-marks",
                                                daemon=True)
                self._thread.start()
        self._due.set()

    def forget(self, rid: str) -> None:
        """Called when the request has ended, before its charge or release: its mark, if
        not written yet, never is; if being written, this returns once it is."""
        with self._lock:
            if self._pending.pop(rid, None) is None:
                self._lock.wait_for(lambda: rid not in self._writing)

    def flush(self) -> None:
        """Write every pending mark now (best effort: Redis away loses them, and a close
        meanwhile may abort those requests)."""
        with self._lock:
            batch, self._pending = self._pending, {}
            self._due.clear()
            self._writing = frozenset(batch)
        try:
            if batch:
                self._write([(dataset, rid) for rid, dataset in batch.items()])
        except redis.RedisError as exc:
            log.warning("%d started marks not written (%s)", len(batch), exc)
        except Exception:  # the thread must live on, for the marks to come
            log.exception("%d started marks not written", len(batch))
        finally:
            with self._lock:
                self._writing = frozenset()
                self._lock.notify_all()

    def _run(self) -> None:
        while True:
            self._due.wait()
            # Marks gather for every_s: the requests that end sooner need none.
            time.sleep(self.every_s)
            self.flush()
