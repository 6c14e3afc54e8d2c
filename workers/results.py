"""Group commit for results: several tasks' rows stored in one transaction.

One transaction per sample costs a worker more CPU (and PostgreSQL a WAL flush) than the
statements themselves; sharing commits between the tasks of a worker removes most of it
while every task still returns, and is acked, only after its own row is durable.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import exc as sa_exc

from common.store import Store

# Most results one commit takes (a worker's default concurrency).
MAX_GROUP = 64
# How long the committer waits for more rows before it commits. A commit on SQLite is
# shorter than the gap between two results, so without it most groups are one row; a few
# milliseconds are nothing next to a generation that takes seconds.
LINGER_S = 0.01


@dataclass(eq=False)
class _Pending:
    row: dict[str, Any]
    done: bool = False
    inserted: bool = False
    error: BaseException | None = None


class ResultWriter:
    """Group commit: the results of several tasks stored in one transaction.

    No thread of its own: the first task to find no commit running waits ``linger_s`` for
    company, then commits everything waiting, its own row included, while the others
    wait. Each ``save`` returns only once its row is committed (or raises its error), so
    a message is never acked before its result is durable.
    """

    def __init__(self, store: Store, max_group: int = MAX_GROUP,
                 linger_s: float = LINGER_S) -> None:
        self.store = store
        self.max_group = max_group
        self.linger_s = linger_s
        self.commits = self.rows = 0
        self._waiting: list[_Pending] = []
        self._busy = False
        self._cond = threading.Condition()

    def save(self, row: dict[str, Any]) -> bool:
        """Store the result and mark its prompt done; False if it was stored before."""
        mine = _Pending(row)
        with self._cond:
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
                self.commits, self.rows = self.commits + 1, self.rows + len(group)
            try:
                self._commit(group)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
        if mine.error is not None:
            raise mine.error
        return mine.inserted

    def _linger(self) -> None:
        """Give other rows a moment to join (called holding the lock, as the leader)."""
        deadline = time.monotonic() + self.linger_s
        while len(self._waiting) < self.max_group:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def _commit(self, group: list[_Pending]) -> None:
        # Two deliveries of one sample in one group: only the first row is offered, so the
        # other learns it is a duplicate (as it would in a later transaction).
        first: dict[tuple[str, str], _Pending] = {}
        for p in group:
            first.setdefault(_key(p.row), p)
        try:
            inserted = self.store.save_results([p.row for p in first.values()])
        except (sa_exc.OperationalError, sa_exc.InterfaceError) as exc:
            # The database is away: every row's task waits it out and tries again.
            _settle(group, error=exc)
            return
        except Exception as exc:
            if len(group) == 1:
                _settle(group, error=exc)
                return
            # One bad row must not fail the others: store them one by one.
            for p in group:
                self._commit([p])
            return
        except BaseException as exc:
            _settle(group, error=exc)
            raise
        for p in group:
            key = _key(p.row)
            p.inserted = first[key] is p and key in inserted
            p.done = True


def _key(row: dict[str, Any]) -> tuple[str, str]:
    return row["dataset"], row["sample_id"]


def _settle(group: list[_Pending], error: BaseException) -> None:
    for p in group:
        p.error, p.done = error, True
