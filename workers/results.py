"""Group commit for results: several tasks' rows stored in one transaction.

One transaction per sample costs a worker more CPU (and PostgreSQL a WAL flush) than the
statements themselves; sharing commits between the tasks of a worker removes most of it
while every task still returns, and is acked, only after its own row is durable.
"""

from __future__ import annotations

from common.db import UNAVAILABLE
from common.rows import ResultRow
from common.store import Store
from workers.grouping import LINGER_S, MAX_GROUP, GroupCall, Outcomes


class ResultWriter:
    """Group commit: the results of several tasks stored in one transaction.

    Each ``save`` returns only once its row is committed (or raises its error), so a
    message is never acked before its result is durable.
    """

    def __init__(self, store: Store, max_group: int = MAX_GROUP,
                 linger_s: float = LINGER_S) -> None:
        self.store = store
        self._group: GroupCall[ResultRow, bool] = GroupCall(
            lambda rows: commit_rows(store, rows), max_group=max_group, linger_s=linger_s)

    @property
    def commits(self) -> int:
        return self._group.batches

    @property
    def rows(self) -> int:
        return self._group.items

    def save(self, row: ResultRow) -> bool:
        """Store the result and mark its prompt done; False if it was stored before."""
        return self._group(row)


def commit_rows(store: Store, rows: list[ResultRow]) -> Outcomes[bool]:
    """Store rows in one transaction: for each, whether it was new, or its own error.

    A database that does not answer raises for all: every row's task waits it out."""
    if not rows:
        return []
    # Two deliveries of one sample in one group: only the first row is offered, so the
    # other learns it is a duplicate (as it would in a later transaction).
    first: dict[tuple[str, str], int] = {}
    for i, row in enumerate(rows):
        first.setdefault(row.key, i)
    try:
        inserted = store.save_results([rows[i] for i in first.values()])
    except UNAVAILABLE:
        raise
    except Exception as exc:
        if len(rows) == 1:
            return [exc]
        # One bad row must not fail the others: store them one by one.
        return [_commit_alone(store, row) for row in rows]
    return [first[row.key] == i and row.key in inserted for i, row in enumerate(rows)]


def _commit_alone(store: Store, row: ResultRow) -> bool | BaseException:
    try:
        return commit_rows(store, [row])[0]
    except Exception as exc:
        return exc
