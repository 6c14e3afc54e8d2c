"""The Redis transport that shares one redis-py client per pool, on the real Redis."""

from __future__ import annotations

import threading
from pathlib import Path

import redis
from kombu import Connection, Queue

from common import broker
from common.celery_app import make_celery
from tests.conftest import REDIS_URL, make_settings


def test_the_app_uses_it_for_redis_urls_and_kombus_own_for_tls(tmp_path: Path) -> None:
    app = make_celery(make_settings(f"sqlite:///{tmp_path / 'd.db'}", "http://127.0.0.1:1"))
    with app.connection_for_write() as conn:
        assert isinstance(conn.default_channel, broker.Channel)
        # Logs name the broker as users wrote it ("Cannot connect to redis://...").
        assert conn.as_uri().startswith("redis://")
    assert broker.transport_for("redis://h:6379/0") == broker.TRANSPORT
    assert broker.transport_for("rediss://h:6380/0") is None


def test_one_client_per_pool_rebuilt_with_the_pool(redis_client: redis.Redis) -> None:
    with Connection(REDIS_URL, transport=broker.TRANSPORT) as conn:
        chan = conn.default_channel
        first = chan._create_client()
        assert chan._create_client() is first
        assert first.connection_pool is chan.pool
        # What kombu does after a connection error: the pools go, new ones come.
        chan._disconnect_pools()
        second = chan._create_client()
        assert second is not first and second.connection_pool is chan.pool
        assert second.ping()


def test_messages_are_delivered_and_acked_from_many_threads(redis_client: redis.Redis) -> None:
    queue = Queue("broker-test")
    bodies = [{"n": n} for n in range(200)]
    with Connection(REDIS_URL, transport=broker.TRANSPORT) as conn:
        with conn.Producer() as producer:
            for body in bodies:
                producer.publish(body, routing_key=queue.name, declare=[queue],
                                 serializer="json")
        received, errors = [], []
        with conn.SimpleQueue(queue) as simple:
            messages = [simple.get(timeout=5) for _ in bodies]
            chan = simple.channel
            assert redis_client.hlen(chan.unacked_key) == len(bodies)

            def ack(part: list) -> None:
                try:
                    for message in part:
                        message.ack()
                        received.append(message.payload)
                except Exception as exc:  # pragma: no cover - the assertion below reports it
                    errors.append(exc)

            threads = [threading.Thread(target=ack, args=(messages[k::8],)) for k in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    assert not errors
    assert sorted(m["n"] for m in received) == list(range(200))
    assert redis_client.hlen(chan.unacked_key) == 0
    assert redis_client.zcard(chan.unacked_index_key) == 0
