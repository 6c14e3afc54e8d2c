"""Heartbeats, and a reaper that returns a dead worker's messages to their queues at once.

Celery's Redis transport returns a killed worker's unacked messages only after the
visibility timeout (above the longest request: half an hour or more). Each worker instead
records the delivery tags it receives (pruning those acked since) and beats every few
seconds. Any live worker that sees a silent one takes the reaper lock, forgets it, and
pushes every message unacked for that long that no live worker holds back to its queue
through the channel's own ``qos.restore_by_tag``, as kombu restores them; that also covers
a worker killed between receiving a message and recording its tag. A worker wrongly
declared dead (a long pause) only causes duplicates, which the ledger and SQL absorb.

kombu records a message as unacked in a second round trip after its BRPOP, so a worker
killed in between leaves nothing in Redis for the reaper: the SQL sweep, run by one worker
every ``sweep_s``, publishes such a prompt again (``common.audit.requeue_lost``). A
Redis that lost all its data is rebuilt at the first heartbeat that finds it so
(workers/recovery.py), not at the next sweep.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from common.audit import requeue_lost
from common.errors import ConfigError, StoreMismatch
from common.keys import (
    KOMBU_UNACKED,
    KOMBU_UNACKED_INDEX,
    REAPER_LOCK,
    SWEEPER_LOCK,
    WORKERS,
    dataset_of_queue,
    worker_rids,
    worker_tags,
)
from common.ledger import Ledger
from common.messages import unacked_entry
from common.pairing import pair
from common.publish import Publisher
from common.replies import texts
from common.services import short_reason
from common.settings import Settings
from workers.context import get_context
from workers.recovery import recover

log = logging.getLogger(__name__)
AWAY_NOTE_S = 15.0
_stopping = threading.Lock()  # held once a stop is asked for


def stop_this_worker(why: str) -> None:
    """Stop this worker (once, whichever thread finds out first): its Redis holds another
    database's queues, which are not its to take. A warm shutdown: tasks already running
    end as they would at any stop."""
    if not _stopping.acquire(blocking=False):
        return
    log.error("%s; stopping this worker", why)
    os.kill(os.getpid(), signal.SIGTERM)


class Received:
    """Delivery tags received since the last heartbeat, recorded in Redis by the next one.

    Buffering keeps a Redis round trip off the consumer's hot path. It is safe because a
    message is an orphan only once unacked for ``dead_after_s``, well above a heartbeat.
    """

    def __init__(self) -> None:
        self._tags: list[str] = []
        self._lock = threading.Lock()

    def add(self, tag: str) -> None:
        with self._lock:
            self._tags.append(tag)

    def drain(self) -> list[str]:
        with self._lock:
            tags, self._tags = self._tags, []
        return tags


def prune(client: redis.Redis, worker: str) -> None:
    """Forget tags already acked (their messages left the transport's unacked hash)."""
    tags = texts(client.smembers(worker_tags(worker)))
    gone = [t for t, held in zip(tags, _exists(client, KOMBU_UNACKED, tags), strict=True)
            if not held]
    if gone:
        client.srem(worker_tags(worker), *gone)


def dead_workers(client: redis.Redis, now: float, dead_after_s: float) -> list[str]:
    return texts(client.zrangebyscore(WORKERS, "-inf", now - dead_after_s))


def reap(app: Celery, client: redis.Redis, dead_after_s: float,
         suspects: dict[tuple[str, str], float] | None = None) -> int:
    """Return orphaned messages to their queues; returns how many came back.

    An orphan is a message unacked for longer than ``dead_after_s`` that no live worker
    holds: its worker stopped beating, or died between receiving it and recording it.
    With ``suspects`` (this reaper's memory between passes), orphaned reservations are
    freed too (see ``release_orphaned_reservations``).
    """
    if not client.set(REAPER_LOCK, "1", nx=True, ex=max(1, int(dead_after_s))):
        return 0
    try:
        now = time.time()
        for worker in dead_workers(client, now, dead_after_s):
            log.warning("worker %s stopped beating; reaping its messages", worker)
            client.delete(worker_tags(worker), worker_rids(worker))
            client.zrem(WORKERS, worker)
        if suspects is not None:
            freed = release_orphaned_reservations(client, suspects, time.monotonic(),
                                                  dead_after_s)
            if freed:
                log.warning("reaper: freed %d reservations of requests no live worker runs",
                            freed)
        with app.connection_for_write() as conn:
            return _restore_orphans(conn.default_channel, client, now - dead_after_s)
    finally:
        client.delete(REAPER_LOCK)


def release_orphaned_reservations(client: redis.Redis, suspects: dict[tuple[str, str], float],
                                  now: float, grace_s: float) -> int:
    """Free every reservation no live worker has claimed for ``grace_s`` (by this clock).

    A live worker publishes its rids at every beat, at most one interval after admission
    and ``grace_s`` is above two intervals, so only a request whose worker died stays
    unclaimed that long. A reservation freed in error would only let one more request
    start: the charge of a rid no longer reserved changes nothing but the counters.
    """
    live = [worker_rids(w) for w in texts(client.zrange(WORKERS, 0, -1))]
    claimed = set(texts(client.sunion(live))) if live else set()
    ledger, seen, freed = Ledger(client), set(), 0
    for name in ledger.known():
        for rid in ledger.inflight_rids(name):
            if rid in claimed:
                continue
            key = (name, rid)
            seen.add(key)
            first = suspects.setdefault(key, now)
            if now - first >= grace_s:
                ledger.release(name, rid)
                freed += 1
    for key in list(suspects):
        if key not in seen or now - suspects[key] >= grace_s:
            del suspects[key]
    return freed


def _restore_orphans(channel: Any, client: redis.Redis, delivered_before: float) -> int:
    old = texts(client.zrangebyscore(KOMBU_UNACKED_INDEX, "-inf", delivered_before))
    if not old:
        return 0
    live = [worker_tags(w) for w in texts(client.zrange(WORKERS, 0, -1))]
    held = set(texts(client.sunion(live))) if live else set()
    restored = 0
    for tag in old:
        if tag not in held and _ours(client.hget(KOMBU_UNACKED, tag)):
            # leftmost: where kombu's own requeue puts a message, as if published again.
            channel.qos.restore_by_tag(tag, leftmost=True)
            restored += 1
    return restored


def _ours(entry: Any) -> bool:
    """Only datagen's own queues: other apps may share the Redis database."""
    record = unacked_entry(entry)
    return record is not None and dataset_of_queue(record[1]) is not None


def _exists(client: redis.Redis, key: str, fields: list[str]) -> list[bool]:
    pipe = client.pipeline(transaction=False)
    for f in fields:
        pipe.hexists(key, f)
    return [bool(x) for x in pipe.execute()]


class Heartbeat:
    """Beats for one worker and reaps the others, on a daemon thread."""

    def __init__(
        self,
        app: Celery,
        client: redis.Redis,
        worker: str,
        received: Received,
        interval_s: float,
        dead_after_s: float,
        sweep_s: float = Settings.sweep_s,
        sweep_quiet_s: float = Settings.sweep_quiet_s,
        on_beat: Callable[[], None] | None = None,
    ) -> None:
        if interval_s * 2 >= dead_after_s:
            raise ConfigError(
                f"DATAGEN_DEAD_AFTER_S ({dead_after_s}) must be above twice "
                f"DATAGEN_HEARTBEAT_S ({interval_s}), or live workers would look dead"
            )
        self.app, self.client, self.worker, self.received = app, client, worker, received
        self.interval_s, self.dead_after_s = interval_s, dead_after_s
        self.sweep_s, self.sweep_quiet_s = sweep_s, sweep_quiet_s
        self.on_beat = on_beat  # after each beat that reached Redis
        self._next_sweep = time.monotonic() + sweep_s
        self._suspects: dict[tuple[str, str], float] = {}
        self._away_noted = -AWAY_NOTE_S
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="datagen-heartbeat")

    def start(self) -> None:
        self.client.zadd(WORKERS, {self.worker: time.time()})
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        # A clean shutdown returns its own messages (kombu); nothing is left to reap.
        self.client.zrem(WORKERS, self.worker)
        self.client.delete(worker_tags(self.worker), worker_rids(self.worker))

    def _run(self) -> None:
        while True:
            try:
                if not self._still_paired():
                    return
                self.client.zadd(WORKERS, {self.worker: time.time()})
                recover(get_context(self.app).store, self.client, Publisher(self.app))
                tags = self.received.drain()
                if tags:
                    self.client.sadd(worker_tags(self.worker), *tags)
                prune(self.client, self.worker)
                self._publish_rids()
                restored = reap(self.app, self.client, self.dead_after_s, self._suspects)
                if restored:
                    log.info("reaper: %d messages returned to their queues", restored)
                if self.on_beat is not None:
                    self.on_beat()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                self._note_away(exc)
            except Exception:
                log.exception("heartbeat failed; trying again")
            self._maybe_sweep()
            if self._stop.wait(self.interval_s):
                return

    def _note_away(self, exc: Exception) -> None:
        """One line, not a traceback, every ``AWAY_NOTE_S`` while Redis does not answer:
        Celery's consumer says the same, and the tasks wait for it."""
        now = time.monotonic()
        if now - self._away_noted >= AWAY_NOTE_S:
            self._away_noted = now
            log.warning("heartbeat: Redis does not answer (%s); trying again every %.0f s",
                        short_reason(exc), self.interval_s)

    def _still_paired(self) -> bool:
        """Pair a Redis that lost everything again within a beat; stop this worker if it
        was paired with another database meanwhile (its queues are not ours to take)."""
        ctx = get_context(self.app)
        try:
            pair(ctx.store, ctx.ledger)
        except StoreMismatch as exc:
            stop_this_worker(str(exc))
            return False
        return True

    def _publish_rids(self) -> None:
        """Replace this worker's published rids in one transaction, so that a reaper never
        sees the set half written."""
        rids = get_context(self.app).live_rids.snapshot()
        key = worker_rids(self.worker)
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(key)
        if rids:
            pipe.sadd(key, *rids)
            pipe.expire(key, max(1, int(2 * self.dead_after_s)))
        pipe.execute()

    def _maybe_sweep(self) -> None:
        """Every ``sweep_s``, one worker re-enqueues prompts Redis lost (see common.audit)."""
        if time.monotonic() < self._next_sweep:
            return
        self._next_sweep = time.monotonic() + self.sweep_s
        # The lock's SET inside the try too: an error escaping here would end the
        # heartbeat's thread, and this worker would look dead to the others.
        try:
            if not self.client.set(SWEEPER_LOCK, "1", nx=True, ex=max(1, int(self.sweep_s))):
                return
            requeued = requeue_lost(get_context(self.app).store, self.client,
                                    Publisher(self.app), self.sweep_quiet_s)
            for name, n in requeued.items():
                log.warning("dataset %s: %d queued prompts were missing from Redis; enqueued "
                            "again", name, n)
        except Exception:
            log.exception("sweep for lost prompts failed; will try again")
