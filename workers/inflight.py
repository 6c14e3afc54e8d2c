"""The requests a worker process has in flight, by rid, for its heartbeat to publish.

A reservation in a dataset's ledger (``inflight``: rid -> expected tokens) is freed by the
charge or by a release when the request ends. A worker killed mid-request frees neither,
and its reservations would keep admission for that dataset short of the budget for good:
near the end the dataset would wait forever for requests nobody runs. Each worker
therefore publishes its live rids with every heartbeat, and the reaper frees reservations
no live worker has claimed for ``dead_after_s``.
"""

from __future__ import annotations

import threading


class LiveRids:
    """Thread-safe set of this process's rids between admission and their last word."""

    def __init__(self) -> None:
        self._rids: set[str] = set()
        self._lock = threading.Lock()

    def add(self, rid: str) -> None:
        with self._lock:
            self._rids.add(rid)

    def discard(self, rid: str) -> None:
        with self._lock:
            self._rids.discard(rid)

    def __len__(self) -> int:
        with self._lock:
            return len(self._rids)

    def snapshot(self) -> list[str]:
        with self._lock:
            return list(self._rids)
