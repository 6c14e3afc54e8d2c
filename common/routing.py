"""Which server a request goes to: the one with the most headroom, by the servers' loads.

Round robin sends every server the same number of requests, so a slower server (half the
GPUs, a longer queue, retractions) builds a queue while a faster one idles. Here each pick
goes to the server whose last load reading, plus the requests this process sent it since,
is least full (``ServerLoad.pressure``). The readings come from the workers' poller
(workers/load_poller.py), not from a call per request.

A server whose load is unknown or stale (it does not serve ``/v1/loads``, or stopped
answering it) keeps its round-robin share: the rotation still lands on it once in every
len(urls) picks and then sends there, and only the picks that land on a server with a
reading are moved to the least full of those. With no reading at all, this is round robin.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Mapping

from common.server_loads import ServerLoad


class LoadRouter:
    """Picks a server for each request, from loads given by ``update``."""

    def __init__(self, urls: tuple[str, ...], stale_after_s: float) -> None:
        self.urls = urls
        self.stale_after_s = stale_after_s
        self._rotation = itertools.cycle(urls)
        self._loads: dict[str, ServerLoad] = {}
        self._sent: Counter[str] = Counter()  # picks since each server's reading
        self._lock = threading.Lock()

    def update(self, loads: Mapping[str, ServerLoad | None]) -> None:
        """New readings (None: that server gave none). A reading no newer than the one
        held changes nothing, so the picks counted since it still count."""
        with self._lock:
            for url, load in loads.items():
                if url not in self.urls:
                    continue
                held = self._loads.get(url)
                if load is None:
                    self._loads.pop(url, None)
                    self._sent.pop(url, None)
                elif held is None or load.polled_at > held.polled_at:
                    self._loads[url] = load
                    self._sent[url] = 0

    def loads(self) -> dict[str, ServerLoad]:
        with self._lock:
            return dict(self._loads)

    def pick(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        with self._lock:
            turn = next(self._rotation)
            fresh = {u: load for u, load in self._loads.items()
                     if now - load.polled_at <= self.stale_after_s}
            if turn not in fresh:
                return turn
            # Ties go to the server the rotation would reach first, from this turn on.
            order = {u: (i - self.urls.index(turn)) % len(self.urls)
                     for i, u in enumerate(self.urls)}
            best = min(fresh, key=lambda u: (fresh[u].pressure(self._sent[u]), order[u]))
            self._sent[best] += 1
            return best
