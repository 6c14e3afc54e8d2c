"""kombu's Redis transport, sharing one redis-py client per connection pool.

Stock kombu builds a new ``redis.Redis`` for every bookkeeping step of a message (moving
it to the unacked hash on delivery, removing it on ack), and the constructor fills a
case-insensitive table of about 150 response callbacks each time: a sizeable share of a
worker's CPU at hundreds of tasks a second. A ``redis.Redis`` may be shared between
threads (each command checks a connection out of the pool), so one client per pool does
the same work. kombu drops its pools after a connection error and builds new ones, so
the shared client is rebuilt whenever the pool under it is not the current one.

A message that reaches the worker by BRPOP is followed, while more are queued and the
prefetch allows, by up to ``BATCH_MAX`` others in one script call that pops each one and
records it as unacked in the same atomic step (``POP_RECORDED``): kombu spends a BRPOP
and a separate record on every message, and leaves it out of both its list and the
unacked hash between the two.

It also lets a worker ack the messages of tasks that settled together in one round trip
(``ack_settled``): the tasks' own acks then only do kombu's local bookkeeping. An ack is
a blocking Redis call in the task's thread, and in a process of many threads each
blocking call costs thread hand-offs on top of the round trip.

Only the plain ``redis://`` scheme uses it: with an explicit transport kombu would skip
what the ``rediss://`` scheme implies (TLS), so those URLs keep the stock transport.
"""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar

import redis
from kombu import connection as kombu_connection
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from common.keys import KOMBU_UNACKED, KOMBU_UNACKED_INDEX
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


class Channel(kombu_redis.Channel):  # type: ignore[misc]
    QoS = QoS
    _shared_client: Any = None
    _pop_script: Any = None

    def _brpop_read(self, **options: Any) -> bool:
        delivered = super()._brpop_read(**options)
        if delivered:
            self._deliver_more()
        return bool(delivered)

    def _deliver_more(self) -> None:
        """After a BRPOP's message, take what else is queued, up to the prefetch room, in
        one round trip (a BRPOP and kombu's record each cost one a message)."""
        room = min(self.qos.can_consume_max_estimate() or 0, BATCH_MAX)
        # In the cycle's order, as the BRPOP takes them: the queue served last comes last.
        queues = self._queue_cycle.consume(len(self.active_queues))
        if room <= 0 or not queues:
            return
        keys = [self._q_for_pri(q, pri) for pri in self.priority_steps for q in queues]
        try:
            with self.conn_or_acquire() as client:
                if self._pop_script is None or self._pop_script.registered_client is not client:
                    self._pop_script = client.register_script(POP_RECORDED)
                reply = self._pop_script(keys=[self.unacked_index_key, self.unacked_key, *keys],
                                         args=[time.time(), room])
        except redis.RedisError as exc:
            # What the script popped is recorded as unacked with it, so a reply lost here
            # leaves those messages to the reaper, not lost; the next BRPOP goes on as usual.
            log.warning("batched pop failed (%s); messages come one by one meanwhile", exc)
            return
        for key, raw in zip(reply[::2], reply[1::2], strict=True):
            payload = loads(bytes_to_str(raw))
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
    return TRANSPORT if url.startswith("redis://") else None
