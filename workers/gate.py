"""The gate a worker's tasks pass before ADMIT under ``--concurrency auto``.

The threads pool is sized to DATAGEN_MAX_CONCURRENCY; the gate lets through at most this
process's share of each server's limit (common/concurrency.py), per server. A task that
finds every server at its limit waits here, before its admission against the budget, so
the guard's in-flight allowance counts only requests that are really sent.

Tasks take places in the order they came to the gate, so requests leave in the order
their messages were delivered (the dataset's publishing order, next turns ahead), as with
a fixed concurrency. Each task takes the server the router picks if that one has room,
else the server with the most room. A server without a load reading gets ``fallback``
requests at once (one log line says so); before the first readings arrive, tasks wait up
to ``ready_s`` for them, so a worker's first burst is sized by the servers too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger(__name__)
# How long a waiting task sleeps before it looks again without being woken (a new limit
# and every release wake it; this only bounds a missed wake-up).
RECHECK_S = 1.0


@dataclass
class Slot:
    """A request's place at ``server``; ``release`` gives it back (once)."""

    server: str
    _gate: Gate
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._gate._release(self.server)


class GateTimeout(Exception):
    """No place came free within the gate's ``max_wait_s``."""


class Gate:
    """Per-server counts of this process's requests in flight, against its limits.

    A task waits at most ``max_wait_s``: its message is unacked meanwhile, and one held
    longer than the visibility timeout would be delivered a second time."""

    def __init__(self, urls: tuple[str, ...], fallback: int, ready_s: float,
                 max_wait_s: float = float("inf")) -> None:
        self.urls = urls
        self.fallback = fallback
        self.max_wait_s = max_wait_s
        self._limits: dict[str, int] = {}
        self._inflight: Counter[str] = Counter()
        self.ready_s = ready_s
        self._ready_by: float | None = None  # from the first task on
        self._ready = False
        self._unpublished: set[str] = set()  # servers said in the log to give no load
        self._lock = threading.Lock()
        # The tasks waiting, first come first: only the head may take a place.
        self._queue: deque[threading.Condition] = deque()

    def set_limits(self, limits: Mapping[str, int | None]) -> None:
        """This process's limits (None: that server publishes no load)."""
        with self._lock:
            for url, limit in limits.items():
                if limit is None:
                    self._limits.pop(url, None)
                    self._say_fallback(url)
                else:
                    self._limits[url] = max(1, limit)
                    self._unpublished.discard(url)
            self._ready = True
            self._wake_head()

    def _say_fallback(self, url: str) -> None:
        if url not in self._unpublished:
            self._unpublished.add(url)
            log.warning("%s publishes no load (/v1/loads): concurrency auto sends it at most "
                        "%d requests at once from this worker", url, self.fallback)

    def limits(self) -> dict[str, int]:
        """The limit of every server now (a fallback where there is no reading)."""
        with self._lock:
            return {u: self._limit(u) for u in self.urls}

    def inflight(self) -> dict[str, int]:
        with self._lock:
            return {u: self._inflight[u] for u in self.urls}

    def waiting(self) -> int:
        """Tasks waiting for a place."""
        with self._lock:
            return len(self._queue)

    def _limit(self, url: str) -> int:
        return self._limits.get(url, self.fallback)

    def _room(self, url: str) -> int:
        return self._limit(url) - self._inflight[url]

    @contextmanager
    def slot(self, pick: Callable[[], str]) -> Iterator[Slot]:
        """A place at a server with room (``pick``'s if it has), held until released or
        the block ends."""
        taken = Slot(self._acquire(pick), self)
        try:
            yield taken
        finally:
            taken.release()

    def _acquire(self, pick: Callable[[], str]) -> str:
        give_up = time.monotonic() + self.max_wait_s
        with self._lock:
            if self._ready_by is None:
                self._ready_by = time.monotonic() + self.ready_s
            turn = threading.Condition(self._lock)
            self._queue.append(turn)
            try:
                return self._wait_turn(turn, pick, give_up)
            finally:
                self._queue.remove(turn)
                self._wake_head()  # the next task may find room too

    def _wait_turn(self, turn: threading.Condition, pick: Callable[[], str],
                   give_up: float) -> str:
        while True:
            if time.monotonic() > give_up:
                raise GateTimeout(f"no place at any server in {self.max_wait_s:.0f} s")
            assert self._ready_by is not None
            if not self._ready and time.monotonic() < self._ready_by:
                turn.wait(min(RECHECK_S, self._ready_by - time.monotonic()))
                continue
            if self._queue[0] is turn:
                server = pick()
                if self._room(server) <= 0:
                    server = max(self.urls, key=self._room)
                if self._room(server) > 0:
                    self._inflight[server] += 1
                    return server
            turn.wait(min(RECHECK_S, max(0.0, give_up - time.monotonic())))

    def _wake_head(self) -> None:
        if self._queue:
            self._queue[0].notify()

    def _release(self, server: str) -> None:
        with self._lock:
            self._inflight[server] -= 1
            self._wake_head()
