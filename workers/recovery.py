"""A Redis that lost its data is rebuilt from SQL at once, not at the next sweep.

A worker that has rebuilt this Redis's ledgers and queues from SQL records so in it
(``keys.REBUILT``). A Redis restarted without persistence comes back without that key,
as without every other, so the first worker to find it missing (at its start, or at a
heartbeat while it runs) rebuilds every dataset's ledger and publishes again every
prompt SQL holds as queued that Redis has neither queued nor unacked, then records the
key. A Redis that comes back with its data has the key: nothing is done.

Prompts count however recent (the sweep waits ``sweep_quiet_s`` for them): a producer
publishing at that very moment may see some of its prompts sent twice, which the ledger
and SQL absorb (one result and one charge per sample).
"""

from __future__ import annotations

import logging
import time

import redis

from common.audit import requeue_lost
from common.keys import REBUILD_LOCK, REBUILT
from common.publish import Publisher
from common.store import Store

log = logging.getLogger("datagen.worker")
# Longer than a rebuild takes; a worker that died rebuilding leaves it to the next one
# after this long.
REBUILD_LOCK_S = 120


def lost_data(client: redis.Redis) -> bool:
    return not client.exists(REBUILT)


def rebuild_if_lost(store: Store, client: redis.Redis,
                    publisher: Publisher) -> dict[str, int] | None:
    """Rebuild a Redis that lost its data; returns the prompts published again per
    dataset, or None when it had its data or another worker is rebuilding it."""
    if not lost_data(client):
        return None
    if not client.set(REBUILD_LOCK, "1", nx=True, ex=REBUILD_LOCK_S):
        return None
    try:
        if not lost_data(client):  # another worker finished just before the lock was ours
            return None
        requeued = requeue_lost(store, client, publisher, quiet_for_s=0)
        client.set(REBUILT, str(time.time()))
        return requeued
    finally:
        client.delete(REBUILD_LOCK)


def recover(store: Store, client: redis.Redis, publisher: Publisher) -> bool:
    """``rebuild_if_lost``, and say what it did; True when it rebuilt."""
    requeued = rebuild_if_lost(store, client, publisher)
    if requeued is None:
        return False
    if requeued:
        log.warning("Redis had lost its data: ledgers rebuilt from SQL; %s",
                    ", ".join(f"{name}: {n} queued prompts enqueued again"
                              for name, n in sorted(requeued.items())))
    else:
        log.info("Redis held no ledgers: rebuilt from SQL, no prompt was missing")
    return True
