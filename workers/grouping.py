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
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")
# What a batch call returns for each item, in order: its result, or the error of that
# item alone (the others' results still stand).
Outcomes = Sequence["R | BaseException"]
# Weight of the newest gap in the moving mean of the time between calls.
GAP_WEIGHT = 0.2
# One long pause counts as this many lingers at most, so that after an idle spell the mean
# is back below the linger within a few calls of a new burst.
GAP_CAP = 4


@dataclass(eq=False)
class _Pending(Generic[T, R]):
    item: T
    done: bool = False
    result: R | None = None
    error: BaseException | None = None


class GroupCall(Generic[T, R]):
    """``call(item)`` from many threads, served by ``batch(items)`` for all who wait.

    No thread of its own: the first caller to find no batch running waits up to
    ``linger_s`` for company, then makes the batch call for everything waiting, its own
    item included, while the others wait. It waits only while calls come closer together
    than ``linger_s`` on average: when they are sparser (a real server's pace, seconds a
    request), nobody is likely to join and the wait would only delay the item. Each call
    returns only once its own item is served, with its own result, or raises its own
    error. A batch call that raises fails every item it held.
    """

    def __init__(self, batch: Callable[[list[T]], Outcomes[R]], max_group: int,
                 linger_s: float) -> None:
        self.batch = batch
        self.max_group = max_group
        self.linger_s = linger_s
        self.batches = self.items = 0
        # The leaders' time in batch calls: wall clock, and CPU of the leading thread (its
        # database driver and system calls included, not only its Python).
        self.serve_s = self.serve_cpu_s = 0.0
        # Moving mean of the time between calls; 0 at first, so a first burst groups.
        self.gap_s = 0.0
        self._last: float | None = None
        self._waiting: list[_Pending[T, R]] = []
        self._busy = False
        self._cond = threading.Condition()

    def __call__(self, item: T) -> R:
        mine: _Pending[T, R] = _Pending(item)
        with self._cond:
            self._arrived()
            self._waiting.append(mine)
            if len(self._waiting) >= self.max_group:
                self._cond.notify_all()  # a lingering leader need not wait any longer
        while not mine.done:
            with self._cond:
                while self._busy and not mine.done:
                    self._cond.wait()
                if mine.done:
                    break
                self._busy = True
                self._linger()
                group = self._waiting[: self.max_group]
                del self._waiting[: self.max_group]
                self.batches, self.items = self.batches + 1, self.items + len(group)
            try:
                self._serve(group)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
        if mine.error is not None:
            raise mine.error
        return mine.result  # type: ignore[return-value]

    def _arrived(self) -> None:
        """Update the mean time between calls (called holding the lock)."""
        now = time.monotonic()
        if self._last is not None:
            gap = min(now - self._last, GAP_CAP * self.linger_s)
            self.gap_s += GAP_WEIGHT * (gap - self.gap_s)
        self._last = now

    def _linger(self) -> None:
        """Give other calls a moment to join (called holding the lock, as the leader)."""
        if self.linger_s <= 0 or self.gap_s > self.linger_s:
            return
        deadline = time.monotonic() + self.linger_s
        while len(self._waiting) < self.max_group:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

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
