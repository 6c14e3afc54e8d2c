"""Pair a Redis with the one results database whose queues and ledgers it holds.

Reconciling only adds to Redis what it lacks, so a Redis left over from another database
(a deleted SQLite file, a second checkout, another team's run on the same Redis database)
would be merged in: its closes, its counters and its queues taken for this database's.
The database's ``store_id`` is recorded in Redis by the first command that pairs them;
every command that reads or changes the ledgers checks it first and refuses another.
A Redis that lost everything (a restart without persistence) is simply paired again and
rebuilt from SQL.
"""

from __future__ import annotations

from common.errors import StoreMismatch
from common.ledger import Ledger
from common.store import Store


def pair(store: Store, ledger: Ledger) -> None:
    """Pair ``ledger``'s Redis with ``store``, or raise StoreMismatch if it holds another's."""
    ours = store.store_id
    theirs = ledger.pair(ours)
    if theirs == ours:
        return
    where, cli_args = ledger.where()
    raise StoreMismatch(
        f"Redis at {where} holds the queues and ledgers of another results database "
        f"(store {theirs[:12]}), not of {store.describe()} (store {ours[:12]}); using it "
        "would charge one run's tokens to the other's budgets. Point DATAGEN_REDIS_URL at "
        "a Redis database of this run's own (another /N), or, if nothing else uses that "
        f"one, clear it (redis-cli {cli_args} flushdb) and run again: this "
        "database's ledgers are rebuilt from SQL."
    )


def paired_elsewhere(store: Store, ledger: Ledger) -> bool:
    """True when the Redis is paired with another database (nothing is written)."""
    theirs = ledger.paired_store()
    return theirs is not None and theirs != store.store_id
