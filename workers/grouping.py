"""Many threads' calls of one kind served by one batch call (group commit, group read).

A worker runs its tasks on threads. Each task's round trip to the database costs the
worker and the database CPU for the statement, the protocol and the wake-ups, nearly all
of it the same for one row as for sixty; serving the waiting tasks together removes most
of it while each task still gets its own answer before it goes on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")
# What a batch call returns for each item, in order: its result, or the error of that
# item alone (the others' results still stand).
Outcomes = Sequence["R | BaseException"]
# Weight of the newest gap in the moving mean of the time between calls.
GAP_WEIGHT = 0.2
# One long pause counts as this many dense gaps at most, so that after an idle spell the
# mean is back below the dense gap within a few calls of a new burst.
GAP_CAP = 4
# Most items one batch call takes: a worker's default concurrency.
MAX_GROUP = 64
# A leader waits for company only while calls come closer together than DENSE_GAP_S on
# average, and then for at most LINGER_S. At a real server's pace (seconds a request, a
# call every 30 ms or more from a worker of 64 threads) nobody waits: a task waiting
# there holds a slot while its request could be running. At full rate calls come
# milliseconds apart, and a commit on SQLite is shorter than the gap between two
# results, so without a wait most groups would be one row.
DENSE_GAP_S = 0.02
LINGER_S = 0.02
# Closer together than BUSY_GAP_S (a request done every 5 ms or less: an instant server,
# or requests under a third of a second on 64 threads) the worker's own CPU sets the
# pace, and a longer wait shares each statement, script and thread hand-off among more
# tasks for the same requests' time.
BUSY_GAP_S = 0.005
BUSY_LINGER_S = 0.04


def _held() -> threading.Lock:
    lock = threading.Lock()
    lock.acquire()
    return lock


@dataclass(eq=False)
class _Pending(Generic[T, R]):
    item: T
    done: bool = False
    result: R | None = None
    error: BaseException | None = None
    # Held until the caller is to wake: served, or made the next leader. A lock per
    # caller, so a batch's end wakes exactly the threads it concerns.
    wake: threading.Lock = field(default_factory=_held)


class GroupCall(Generic[T, R]):
    """``call(item)`` from many threads, served by ``batch(items)`` for all who wait.

    No thread of its own: the first caller to find no batch running waits up to
    ``linger_s`` for company, or until ``enough`` callers wait, then makes the batch call
    for everything waiting (up to ``max_group``), its own item included, while the
    others wait. It waits only while calls come closer together than ``dense_gap_s``
    (by default ``linger_s``) on average: when they are sparser (a real server's pace,
    seconds a request), nobody is likely to join soon and the wait would only delay the
    item. Each call
    returns only once its own item is served, with its own result, or raises its own
    error. A batch call that raises fails every item it held.

    A batch's end wakes its own callers, all at once, and the first caller still waiting
    as the next leader; the callers still waiting sleep on. (One condition for all would
    wake every waiting thread at each batch's end, most of them only to go back to sleep:
    in a worker of 64 threads, a thread hand-off and a turn at the GIL each.) Each served
    caller holds one of the worker's slots until it returns, so they are woken together,
    not one after another.
    """

    def __init__(self, batch: Callable[[list[T]], Outcomes[R]], max_group: int,
                 linger_s: float, enough: int | None = None,
                 dense_gap_s: float | None = None, busy_gap_s: float = 0.0,
                 busy_linger_s: float | None = None) -> None:
        self.batch = batch
        self.max_group = max_group
        # A lingering leader goes on once this many wait (at most max_group).
        self.enough = min(max_group, enough or max_group)
        self.linger_s = linger_s
        self.dense_gap_s = linger_s if dense_gap_s is None else dense_gap_s
        self.busy_gap_s = busy_gap_s
        self.busy_linger_s = linger_s if busy_linger_s is None else busy_linger_s
        self.batches = self.items = 0
        # The leaders' time in batch calls: wall clock, and CPU of the leading thread (its
        # database driver and system calls included, not only its Python).
        self.serve_s = self.serve_cpu_s = 0.0
        # Moving mean of the time between calls; 0 at first, so a first burst groups.
        self.gap_s = 0.0
        self._last: float | None = None
        self._waiting: list[_Pending[T, R]] = []
        self._led = False  # a leader is lingering or serving
        self._mutex = threading.Lock()
        self._full = threading.Event()  # set when `enough` callers wait

    def __call__(self, item: T) -> R:
        mine: _Pending[T, R] = _Pending(item)
        with self._mutex:
            self._arrived()
            self._waiting.append(mine)
            follower = self._led
            self._led = True
            if len(self._waiting) >= self.enough:
                self._full.set()  # a lingering leader need not wait any longer
        if follower:
            mine.wake.acquire()  # served, or made the next leader
        if not mine.done:
            self._lead(mine)
        if mine.error is not None:
            raise mine.error
        return mine.result  # type: ignore[return-value]

    def _lead(self, mine: _Pending[T, R]) -> None:
        """Serve the first group waiting (``mine`` leads it: the first caller waiting),
        then wake the group's other callers and hand the lead to the next caller waiting."""
        self._linger()
        with self._mutex:
            group = self._waiting[: self.max_group]
            del self._waiting[: self.max_group]
            self.batches, self.items = self.batches + 1, self.items + len(group)
        try:
            self._serve(group)
        finally:
            with self._mutex:
                after = self._waiting[0] if self._waiting else None
                self._led = after is not None
            for p in group:
                if p is not mine:
                    p.wake.release()
            if after is not None:
                after.wake.release()

    def _arrived(self) -> None:
        """Update the mean time between calls (called holding the mutex)."""
        now = time.monotonic()
        if self._last is not None:
            gap = min(now - self._last, GAP_CAP * self.dense_gap_s)
            self.gap_s += GAP_WEIGHT * (gap - self.gap_s)
        self._last = now

    def _linger(self) -> None:
        """Give other calls a moment to join (as the leader, not holding the mutex)."""
        with self._mutex:
            if (self.linger_s <= 0 or self.gap_s > self.dense_gap_s
                    or len(self._waiting) >= self.enough):
                return
            wait = self.busy_linger_s if self.gap_s <= self.busy_gap_s else self.linger_s
            self._full.clear()
        self._full.wait(wait)

    def _serve(self, group: list[_Pending[T, R]]) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            outcomes = self.batch([p.item for p in group])
        except BaseException as exc:
            for p in group:
                p.error, p.done = exc, True
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            # Only the one leader of this GroupCall runs here at a time: no lock needed.
            self.serve_s += time.perf_counter() - wall
            self.serve_cpu_s += time.thread_time() - cpu
        if len(outcomes) != len(group):
            error = RuntimeError(f"batch call answered {len(outcomes)} of {len(group)} items")
            for p in group:
                p.error, p.done = error, True
            return
        for p, outcome in zip(group, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                p.error = outcome
            else:
                p.result = outcome
            p.done = True


def step_group(batch: Callable[[list[T]], Outcomes[R]], max_group: int,
               enough: int | None = None) -> GroupCall[T, R]:
    """A worker step's GroupCall, with the waits above."""
    return GroupCall(batch, max_group, linger_s=LINGER_S, enough=enough,
                     dense_gap_s=DENSE_GAP_S, busy_gap_s=BUSY_GAP_S,
                     busy_linger_s=BUSY_LINGER_S)
