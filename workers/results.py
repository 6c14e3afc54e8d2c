"""Group commit for results: several tasks' rows stored in one transaction.

One transaction per sample costs a worker more CPU (and PostgreSQL a WAL flush) than the
statements themselves; sharing commits between the tasks of a worker removes most of it
while every task still returns, and is acked, only after its own row is durable.
"""

from __future__ import annotations

from collections.abc import Mapping

from common.db import UNAVAILABLE
from common.rows import NewPrompt, ResultRow
from common.store import Store
from workers.grouping import MAX_GROUP, GroupCall, Outcomes, step_group


class ResultWriter:
    """Group commit: the results of several tasks stored in one transaction.

    Each ``save`` returns only once its row is committed (or raises its error), so a
    message is never acked before its result is durable.
    """

    def __init__(self, store: Store, max_group: int = MAX_GROUP) -> None:
        self.store = store
        self._group: GroupCall[tuple[ResultRow, NewPrompt | None], bool] = step_group(
            lambda items: commit_rows(store, [row for row, _ in items],
                                      {row.key: then for row, then in items if then}),
            max_group)

    @property
    def commits(self) -> int:
        return self._group.batches

    @property
    def rows(self) -> int:
        return self._group.items

    def save(self, row: ResultRow, then: NewPrompt | None = None) -> bool:
        """Store the result and mark its prompt done (and store ``then``, the prompt it
        makes possible, with it); False if it was stored before."""
        return self._group((row, then))


def commit_rows(store: Store, rows: list[ResultRow],
                then: Mapping[tuple[str, str], NewPrompt] | None = None) -> Outcomes[bool]:
    """Store rows in one transaction: for each, whether it was new, or its own error.
    ``then``: by a row's key, the prompt its result makes possible (a conversation's next
    turn), stored in the same transaction.

    A database that does not answer raises for all: every row's task waits it out."""
    follow = then or {}
    if not rows:
        return []
    # Two deliveries of one sample in one group: only the first row is offered, so the
    # other learns it is a duplicate (as it would in a later transaction).
    first: dict[tuple[str, str], int] = {}
    for i, row in enumerate(rows):
        first.setdefault(row.key, i)
    try:
        offered = [rows[i] for i in first.values()]
        then_rows = [follow[r.key] for r in offered if r.key in follow]
        inserted = (store.save_results(offered, then_rows) if then_rows
                    else store.save_results(offered))
    except UNAVAILABLE:
        raise
    except Exception as exc:
        if len(rows) == 1:
            return [exc]
        # One bad row must not fail the others: store them one by one.
        return [_commit_alone(store, row, follow) for row in rows]
    return [first[row.key] == i and row.key in inserted for i, row in enumerate(rows)]


def _commit_alone(store: Store, row: ResultRow,
                  then: Mapping[tuple[str, str], NewPrompt]) -> bool | BaseException:
    try:
        return commit_rows(store, [row], then)[0]
    except Exception as exc:
        return exc
