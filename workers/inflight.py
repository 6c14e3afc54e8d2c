"""The requests a worker process has in flight, by rid, for its heartbeat to publish.

A reservation in a dataset's ledger (``inflight``: rid -> expected tokens) is freed by the
charge or by a release when the request ends. A worker killed mid-request frees neither,
and its reservations would keep admission for that dataset short of the budget for good:
near the end the dataset would wait forever for requests nobody runs. Each worker
therefore publishes its live rids with every heartbeat, and the reaper frees reservations
no live worker has claimed for ``dead_after_s``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import redis

if TYPE_CHECKING:
    from common.ledger import Ledger

log = logging.getLogger(__name__)


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


def give_back(ledger: Ledger, live_rids: LiveRids, reserved: Sequence[tuple[str, str]]) -> None:
    """Release these (dataset, rid) reservations and drop their claims. With Redis away,
    one warning for them all, and the claims go anyway: the reaper frees what no claim
    covers, without a wait for each here."""
    try:
        for dataset, rid in reserved:
            ledger.release(dataset, rid)
    except redis.RedisError as exc:
        log.warning("could not give back %d reservations: %s; the reaper frees them",
                    len(reserved), exc)
    finally:
        for _, rid in reserved:
            live_rids.discard(rid)
