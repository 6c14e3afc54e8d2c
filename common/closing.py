"""Closing a dataset, at its budget's crossing or by hand, the same way everywhere.

The ledger script has already marked the dataset closed and purged its queue in one
atomic step. What follows here is idempotent: under the abort and exact policies, abort
the dataset's requests still on the servers, under drain those the servers have not
started (no first token yet, workers/pipeline.py streams to learn it); then record the
close in SQL and revoke what workers have reserved (one broadcast on the ``dataset``
stamp, not one per task id). Tasks that still reach a worker later are dropped by the
ledger's admission check.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from celery import Celery

from common.ledger import Ledger, LedgerState
from common.messages import STAMP
from common.sglang_client import SGLangClient
from common.store import Store

log = logging.getLogger(__name__)


def after_close(
    name: str,
    *,
    store: Store,
    ledger: Ledger,
    app: Celery | None,
    client: SGLangClient | None,
) -> None:
    state = ledger.state(name)
    if client is not None:
        # The servers' requests first: each millisecond they run on is GPU time spent on
        # tokens the budget no longer takes, and a database that is away must not keep
        # them running. Under drain only those still queued on the server, which have
        # produced nothing: the running ones finish and are kept.
        drain = state.policy == "drain"
        rids = ledger.queued_rids(name) if drain else ledger.inflight_rids(name)
        calls = client.abort_many(rids)
        log.info("dataset %s closed: aborted %d %s (%d calls)", name, len(rids),
                 "requests still queued on the servers" if drain else "requests in flight",
                 calls)
    _record(name, state, store, app)


def _record(name: str, state: LedgerState, store: Store, app: Celery | None) -> None:
    """Record the close in SQL, and revoke the dataset's tasks that workers hold."""
    closed_at = datetime.fromtimestamp(state.closed_at or 0, UTC)
    store.record_close(
        name, state.close_reason or "manual", closed_at, state.used_at_close or state.used_tokens
    )
    if app is not None:
        stamp = store.dataset(name).stamp
        app.control.revoke_by_stamped_headers({STAMP: stamp}, reply=False)
