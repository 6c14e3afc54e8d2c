"""kombu's Redis transport, sharing one redis-py client per connection pool.

Stock kombu builds a new ``redis.Redis`` for every bookkeeping step of a message (moving
it to the unacked hash on delivery, removing it on ack), and the constructor fills a
case-insensitive table of about 150 response callbacks each time: a sizeable share of a
worker's CPU at hundreds of tasks a second. A ``redis.Redis`` may be shared between
threads (each command checks a connection out of the pool), so one client per pool does
the same work. kombu drops its pools after a connection error and builds new ones, so
the shared client is rebuilt whenever the pool under it is not the current one.

Every message reaches a worker through one script call (``POP_RECORDED``) that pops up
to ``BATCH_MAX`` of them, within the prefetch room, and records each one as unacked in the
same atomic step. kombu takes each message with its own BRPOP and records it with a
second round trip once the reply is read, so a worker killed between the two loses the
message (nothing in Redis holds it any more), and a warm shutdown drops one still unread
in the socket. With the script a message is always in its queue or in the unacked hash,
where the reaper (workers/liveness.py) finds a dead worker's messages.

It also lets a worker ack the messages of tasks that settled together in one round trip
(``ack_settled``): the tasks' own acks then only do kombu's local bookkeeping. An ack is
a blocking Redis call in the task's thread, and in a process of many threads each
blocking call costs thread hand-offs on top of the round trip.

Both ``redis://`` and ``rediss://`` URLs use it. Named explicitly, a transport loses what
kombu infers from the ``rediss`` scheme (TLS, unverified unless the URL says otherwise),
so ``broker_ssl`` gives the app TLS options for those URLs: the URL's own ``ssl_*``
parameters win, and without them the server's certificate is verified against the
system's CAs, as redis-py does for the project's other Redis clients.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable
from queue import Empty
from typing import Any, ClassVar

import redis
from kombu import connection as kombu_connection
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from common.keys import CONSUMER_WAIT, KOMBU_UNACKED, KOMBU_UNACKED_INDEX, UNREADABLE
from common.ledger_scripts import POP_RECORDED

log = logging.getLogger(__name__)
TRANSPORT = f"{__name__}:Transport"
# How a connection names its transport in logs and URIs ("Cannot connect to redis://..."):
# kombu's table of display aliases, which only changes how this transport is shown.
kombu_connection.resolve_aliases.setdefault(TRANSPORT, "redis")


class QoS(kombu_redis.QoS):  # type: ignore[misc]
    # Delivery tags whose messages ``ack_settled`` already took out of the unacked hash and
    # index; one process's channels share it (a worker consumes through one).
    removed: ClassVar[set[str]] = set()
    # Delivery tags whose unacked record the batched pop already wrote, atomically with the
    # pop itself.
    recorded: ClassVar[set[str]] = set()

    def append(self, message: Any, delivery_tag: str) -> None:
        if delivery_tag in QoS.recorded:
            QoS.recorded.discard(delivery_tag)
            virtual.QoS.append(self, message, delivery_tag)
        else:
            super().append(message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        if delivery_tag in QoS.removed:
            QoS.removed.discard(delivery_tag)
            virtual.QoS.ack(self, delivery_tag)  # kombu's local bookkeeping: frees a slot
        else:
            super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        # A removed message is one whose result is stored: nothing is left to requeue.
        QoS.removed.discard(delivery_tag)
        super().reject(delivery_tag, requeue=requeue)


def ack_settled(client: redis.Redis, tags: list[str]) -> None:
    """Take settled messages out of the unacked hash and index in one round trip.

    Call it only for messages whose work is durable: from here on a crash does not bring
    them back. Each one's own ack (Celery's, when its task returns) is then local. If the
    round trip fails, nothing is marked and the acks go to Redis one by one as before.
    """
    if not tags:
        return
    pipe = client.pipeline(transaction=False)
    pipe.zrem(KOMBU_UNACKED_INDEX, *tags)
    pipe.hdel(KOMBU_UNACKED, *tags)
    pipe.execute()
    QoS.removed.update(tags)


BATCH_MAX = 16
# How long an idle consumer waits before it looks at its queues again: the most a message
# published to an empty queue waits for a worker with room.
IDLE_WAIT_S = 0.1


class Channel(kombu_redis.Channel):  # type: ignore[misc]
    QoS = QoS
    _shared_client: Any = None
    _pop_script: Any = None
    # The reply kombu's loop waits for on this channel's connection: "PING" or "BRPOP".
    _pending: str = "BRPOP"
    _delivered_last: bool = False
    _pop_failing: bool = False
    # Called in the consumer's thread with each pop's messages, before they are delivered
    # (the worker admits their samples there: workers/early.py).
    before_delivery: Callable[[list[dict[str, Any]]], None] | None = None

    def _brpop_start(self, timeout: float | None = None) -> None:
        """Take what is queued, then leave kombu's loop one reply to wait for.

        kombu sends a BRPOP here and records the message it returns as unacked only once
        the reply is read: a worker killed in between loses that message, and a warm
        shutdown drops one still unread in the socket. Here every message comes by
        ``POP_RECORDED``, which records it with its pop, so a message is always in its
        queue or in the unacked hash. The reply left pending never carries a message: a
        PING after a batch (room may be left), or after none a BRPOP on a key nothing
        fills, which is the idle consumer's wait before it looks again.
        """
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        delivered = self._pop_recorded(queues)
        self._delivered_last = delivered > 0
        command: list[str | float] = (["PING"] if delivered
                                      else ["BRPOP", CONSUMER_WAIT, IDLE_WAIT_S])
        self._pending = str(command[0])
        self._in_poll = self.client.connection
        self._brpop_sent_at = time.monotonic()  # type: ignore[assignment]
        self.client.connection.send_command(*command)

    def _brpop_read(self, **options: Any) -> bool:
        try:
            try:
                self.client.parse_response(self.client.connection, self._pending, **options)
            except self.connection_errors:
                # The reply carried no message, so nothing went with it: the next round
                # reconnects. kombu raises here, and Celery restarts the consumer, which
                # puts back in the queue every message the worker holds, tasks running
                # included; it still does when the reconnect fails (Redis away).
                self.client.connection.disconnect()
                raise Empty() from None
        finally:
            self._in_poll = None  # type: ignore[assignment]
            self._flush_brpop_reauth()
        if not self._delivered_last:
            raise Empty()
        return True

    def _pop_recorded(self, queues: list[str]) -> int:
        """Pop and record up to the prefetch room (at most ``BATCH_MAX``) and deliver them;
        returns how many."""
        room = self.qos.can_consume_max_estimate()
        room = BATCH_MAX if room is None else min(room, BATCH_MAX)
        if room <= 0:
            return 0
        keys = [self._q_for_pri(q, pri) for pri in self.priority_steps for q in queues]
        try:
            with self.conn_or_acquire() as client:
                if self._pop_script is None or self._pop_script.registered_client is not client:
                    self._pop_script = client.register_script(POP_RECORDED)
                popped, unreadable = self._pop_script(
                    keys=[self.unacked_index_key, self.unacked_key, UNREADABLE, *keys],
                    args=[time.time(), room])
        except redis.RedisError as exc:
            # A script refused (a full server) popped nothing; one whose reply was lost
            # left what it popped recorded, for the reaper. Either way the consumer looks
            # again after the idle wait, on its own connection, which reconnects (a
            # consumer restart, which requeues every message it holds) only when Redis is
            # really away.
            if not self._pop_failing:
                log.warning("taking messages failed (%s); trying again", exc)
            self._pop_failing = True
            return 0
        self._pop_failing = False
        if unreadable:
            log.error("%d queued messages could not be read; moved to the Redis list %s",
                      unreadable, UNREADABLE)
        payloads = [loads(bytes_to_str(raw)) for raw in popped[1::2]]
        if self.before_delivery is not None:
            try:
                self.before_delivery(payloads)
            except Exception:  # its work is an optimisation: the messages go on without it
                log.exception("the hook before delivery failed")
        for key, payload in zip(popped[::2], payloads, strict=True):
            tag = payload["properties"]["delivery_tag"]
            queue = bytes_to_str(key).rsplit(self.sep, 1)[0]
            QoS.recorded.add(tag)
            try:
                self._queue_cycle.rotate(queue)
                self.connection._deliver(payload, queue)
            finally:
                # Normally taken by the delivery's append; a delivery that failed before it
                # leaves the message to the reaper, and its tag must not skip a later record.
                QoS.recorded.discard(tag)
        return len(popped) // 2

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:
            return super()._create_client(asynchronous=True)
        pool = self.pool
        client = self._shared_client
        if client is None or client.connection_pool is not pool:
            # Two threads may both build one here; either is correct, the last one is kept.
            client = self._shared_client = super()._create_client()
        return client


class Transport(kombu_redis.Transport):  # type: ignore[misc]
    Channel = Channel


def transport_for(url: str) -> str | None:
    """The transport to name in Celery's ``broker_transport`` for ``url`` (None: kombu's)."""
    return TRANSPORT if url.startswith(("redis://", "rediss://")) else None


def broker_ssl(url: str) -> dict[str, Any] | None:
    """Celery's ``broker_use_ssl`` for ``url``: certificate checks on for ``rediss://``.

    kombu reads the URL's ``ssl_*`` parameters over these."""
    return {"ssl_cert_reqs": ssl.CERT_REQUIRED} if url.startswith("rediss://") else None
