"""Rebuild the Redis ledger from SQL, the source of truth.

Run on every ``datagen enqueue`` and worker start, after pairing the Redis with the
database (common/pairing.py). It only adds what Redis lacks (a
stored result not yet charged, a close not yet known), so it is safe while workers run,
and after a Redis restart that lost everything it restores every counter and state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from common.closing import after_close
from common.ledger import Ledger
from common.pairing import pair
from common.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reconciled:
    name: str
    tokens_added: int
    closed_now: bool
    purged: int


def reconcile_dataset(store: Store, ledger: Ledger, name: str) -> Reconciled:
    # A Redis that lost everything mid-run is paired again here; another database's is
    # refused before anything of it is merged.
    pair(store, ledger)
    return _reconcile(store, ledger, name)


def reconcile_all(store: Store, ledger: Ledger) -> list[Reconciled]:
    pair(store, ledger)
    return [_reconcile(store, ledger, name) for name in store.dataset_names()]


def _reconcile(store: Store, ledger: Ledger, name: str) -> Reconciled:
    row = store.dataset(name)
    added = ledger.absorb(name, store.result_costs(name, row.budget))
    result = ledger.configure(name, row.budget)
    if row.state == "closed" and not result.closed_now:
        result = ledger.close(name, row.close_reason or "manual")
    if result.closed_now:
        after_close(name, store=store, ledger=ledger, app=None, client=None)
    if added:
        log.info("ledger of %s: added %d tokens stored in SQL but missing in Redis", name, added)
    return Reconciled(name, added, result.closed_now, result.purged)

