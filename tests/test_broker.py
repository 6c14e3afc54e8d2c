"""The broker as every process's app configures it: kombu's own Redis transport.

The reaper (workers/liveness.py) and the audit (common/audit.py) read what the transport
keeps for a delivered message; these tests pin that contract on the real Redis."""

from __future__ import annotations

import json
import ssl
from pathlib import Path

import redis
from kombu import Queue
from kombu.transport import redis as kombu_redis

from common.celery_app import make_celery
from common.keys import (
    AHEAD_PRIORITY,
    KOMBU_PRIORITY_SEP,
    KOMBU_UNACKED,
    KOMBU_UNACKED_INDEX,
    PROMPT_PRIORITY,
)
from tests.conftest import make_settings
from tests.faultkit import PrivateTlsRedis


def test_the_app_uses_kombus_redis_transport_and_its_unacked_keys(tmp_path: Path) -> None:
    app = make_celery(make_settings(f"sqlite:///{tmp_path / 'd.db'}", "http://127.0.0.1:1"))
    assert app.conf.broker_transport is None  # kombu's, from the URL's scheme
    with app.connection_for_write() as conn:
        assert type(conn.default_channel) is kombu_redis.Channel
        # The reaper and the audit name kombu's unacked keys from common/keys.py: the
        # app's options must leave them as kombu names them.
        assert conn.default_channel.unacked_key == KOMBU_UNACKED
        assert conn.default_channel.unacked_index_key == KOMBU_UNACKED_INDEX
        assert conn.default_channel.priority_steps == [AHEAD_PRIORITY, PROMPT_PRIORITY]
        assert conn.as_uri().startswith("redis://")


def test_a_rediss_url_verifies_the_server_unless_the_url_says_otherwise(tmp_path: Path) -> None:
    """kombu turns TLS on for ``rediss://`` by itself, without verifying the server: the
    app's ``broker_use_ssl`` turns the check on, and the URL's own parameters win."""
    db = f"sqlite:///{tmp_path / 'd.db'}"

    def ssl_of(url: str) -> object:
        app = make_celery(make_settings(db, "http://127.0.0.1:1", redis_url=url))
        with app.connection_for_write() as conn:
            assert conn.transport_cls in ("redis", "rediss")
            return conn.ssl

    assert ssl_of("redis://127.0.0.1:6379/0") in (None, False)
    assert ssl_of("rediss://h:6380/0") == {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    assert ssl_of("rediss://h:6380/0?ssl_cert_reqs=none") == {"ssl_cert_reqs": ssl.CERT_NONE}


def test_a_rediss_broker_delivers_and_records_messages_over_tls(tmp_path: Path) -> None:
    """A task sent through a ``rediss://`` URL (the server's certificate checked against
    the URL's CA) reaches the consumer, recorded as unacked, and its ack clears the record."""
    with PrivateTlsRedis() as server:
        app = make_celery(make_settings(f"sqlite:///{tmp_path / 'd.db'}", "http://127.0.0.1:1",
                                        redis_url=server.url))
        client = server.client()
        queue = Queue("broker-tls")
        app.send_task("datagen.test-tls", args=[1], queue=queue.name)
        seen: list = []

        def take(body: object, message: object) -> None:
            seen.append((body, client.hlen(KOMBU_UNACKED)))
            message.ack()  # type: ignore[attr-defined]

        with app.connection_for_read() as conn:
            assert conn.ssl and conn.ssl["ssl_cert_reqs"] == ssl.CERT_REQUIRED
            with conn.Consumer(queue, callbacks=[take], accept=["json"]) as consumer:
                consumer.qos(prefetch_count=4)
                conn.drain_events(timeout=5)
        assert [(body[0], held) for body, held in seen] == [([1], 1)], seen  # type: ignore[index]
        assert client.hlen(KOMBU_UNACKED) == 0
        client.close()


def test_a_next_turn_is_consumed_before_the_new_prompts_queued_earlier(
    tmp_path: Path, redis_client: redis.Redis,
) -> None:
    """Two priority steps: new prompts (PROMPT_PRIORITY) wait in the step's own list, a
    conversation's next turn (AHEAD_PRIORITY) in the queue's, which a worker's BRPOP names
    first; each list is first in, first out. A priority of neither step lands in one of
    the two lists a worker looks at."""
    app = make_celery(make_settings(f"sqlite:///{tmp_path / 'd.db'}", "http://127.0.0.1:1"))
    queue = Queue("broker-priority")
    lists = (queue.name, f"{queue.name}{KOMBU_PRIORITY_SEP}{PROMPT_PRIORITY}")
    try:
        for n in range(3):
            app.send_task("datagen.test-priority", args=[n], queue=queue.name,
                          priority=PROMPT_PRIORITY)
        app.send_task("datagen.test-priority", args=["turn"], queue=queue.name,
                      priority=AHEAD_PRIORITY)
        app.send_task("datagen.test-priority", args=[3], queue=queue.name, priority=9)
        assert [redis_client.llen(k) for k in lists] == [1, 4]
        got: list = []
        with app.connection_for_read() as conn, conn.Consumer(
                queue, callbacks=[lambda body, message: (got.append(body[0][0]), message.ack())],
                accept=["json"]):
            while len(got) < 5:
                conn.drain_events(timeout=5)
        assert got == ["turn", 0, 1, 2, 3], got
    finally:
        redis_client.delete(*lists, KOMBU_UNACKED, KOMBU_UNACKED_INDEX,
                            *redis_client.keys(f"{queue.name}?*"))


def test_a_delivered_message_is_recorded_as_the_reaper_reads_it_and_restored_by_tag(
    tmp_path: Path, redis_client: redis.Redis,
) -> None:
    """What the reaper and the audit rely on: a delivered, unacked message is kept under
    its delivery tag as [message, exchange, routing key] with its delivery time in the
    index, and the channel's ``qos.restore_by_tag`` puts it back in its queue."""
    app = make_celery(make_settings(f"sqlite:///{tmp_path / 'd.db'}", "http://127.0.0.1:1"))
    queue = Queue("broker-recorded")
    try:
        for n in range(3):
            app.send_task("datagen.test-recorded", args=[n], queue=queue.name)
        got: list = []
        with app.connection_for_read() as conn, conn.Consumer(
                queue, callbacks=[lambda body, message: got.append(message)],
                accept=["json"]) as consumer:
            consumer.qos(prefetch_count=1)
            conn.drain_events(timeout=5)
            assert len(got) == 1 and redis_client.llen(queue.name) == 2
            tag = got[0].delivery_tag
            payload, _exchange, routing_key = json.loads(redis_client.hget(KOMBU_UNACKED, tag))
            assert payload["properties"]["delivery_tag"] == tag
            assert routing_key == queue.name
            assert redis_client.zscore(KOMBU_UNACKED_INDEX, tag) is not None
            with app.connection_for_write() as other:
                other.default_channel.qos.restore_by_tag(tag, leftmost=True)
            assert redis_client.hlen(KOMBU_UNACKED) == 0
            assert redis_client.zcard(KOMBU_UNACKED_INDEX) == 0
            # Where kombu's requeue puts it (LPUSH, like a new message), marked redelivered.
            back = json.loads(redis_client.lindex(queue.name, 0))
            assert back["properties"]["delivery_tag"] == tag
            assert back["headers"]["redelivered"] is True
            assert redis_client.llen(queue.name) == 3
    finally:
        redis_client.delete(queue.name, KOMBU_UNACKED, KOMBU_UNACKED_INDEX)
