"""What Redis really holds for a dataset, and the prompts it lost.

A prompt stored as ``queued`` in SQL should have a message in its queue, or unacked in
the transport (reserved by a worker, or in flight). Redis can lose one: a Redis restart
without persistence, or a worker killed between kombu's BRPOP of a message and the second
round trip that records it as unacked (nothing in Redis holds it then). SQL remembers;
this finds the difference.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import redis

from common.conversation_store import queued_later_turns
from common.keys import KOMBU_UNACKED, dataset_keys, dataset_of_queue
from common.ledger import Ledger
from common.messages import sample_of, unacked_entry
from common.publish import Publisher
from common.reconcile import reconcile_dataset
from common.settings import Settings
from common.store import Store

_CHUNK = 5000


def _queued(client: redis.Redis, lists: tuple[str, ...]) -> Iterator[Any]:
    for key in lists:
        for start in range(0, int(client.llen(key)), _CHUNK):
            yield from client.lrange(key, start, start + _CHUNK - 1)


def queued_in_redis(client: redis.Redis, dataset: str) -> set[str]:
    """Sample ids with a message waiting in the dataset's queue or unacked by a worker."""
    found = set()
    for raw in _queued(client, dataset_keys(dataset).queue_lists):
        sample = sample_of(json.loads(raw))
        if sample is not None and sample[0] == dataset:
            found.add(sample[1])
    for _tag, raw in client.hscan_iter(KOMBU_UNACKED, count=_CHUNK):
        entry = unacked_entry(raw)
        if entry is not None and dataset_of_queue(entry[1]) == dataset:
            sample = sample_of(entry[0])
            if sample is not None:
                found.add(sample[1])
    return found


def lost_queued(store: Store, client: redis.Redis, dataset: str,
                updated_before: datetime | None = None) -> list[str]:
    """The dataset's prompts SQL holds as queued and Redis neither queues nor has unacked,
    in its publishing order.

    Redis is read before SQL: a task marks its prompt done in SQL before its message is
    acked, so one that ends in between is seen either in Redis or as done. Read the other
    way round it would be queued in SQL and gone from Redis, and taken for lost."""
    held = queued_in_redis(client, dataset)
    queued = store.sample_ids(dataset, "queued", updated_before=updated_before)
    return [sid for sid in queued if sid not in held]


def requeue_lost(
    store: Store, client: redis.Redis, publisher: Publisher,
    quiet_for_s: float = Settings.sweep_quiet_s,
) -> dict[str, int]:
    """Rebuild every ledger from SQL, then publish again every open dataset's prompts that
    SQL holds as queued and Redis lost, in the dataset's publishing order.

    Only prompts untouched for ``quiet_for_s`` count, so one the producer has stored but
    not yet published is never mistaken for lost. Duplicates are harmless: the ledger and
    SQL keep each sample once.
    """
    cutoff = datetime.now(UTC) - timedelta(seconds=quiet_for_s)
    requeued = {}
    ledger = Ledger(client)
    for name in store.dataset_names():
        # A Redis that lost the messages lost the ledger too: rebuild it first, so budgets
        # and closes hold before anything is published again.
        reconcile_dataset(store, ledger, name)
        ds = store.dataset(name)
        if ds.state == "closed" or ledger.is_closed(name):
            continue
        lost = lost_queued(store, client, ds.name, updated_before=cutoff)
        if lost:
            # A conversation's later turns go ahead of new prompts, as when first sent.
            later = set(queued_later_turns(store, ds.name)) if ds.turns == "all" else set()
            publisher.publish_all(ds.name, ds.stamp, [s for s in lost if s in later], True)
            publisher.publish_all(ds.name, ds.stamp, [s for s in lost if s not in later])
            requeued[ds.name] = len(lost)
    return requeued
