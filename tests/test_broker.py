"""The Redis transport that shares one redis-py client per pool, on the real Redis."""

from __future__ import annotations

import contextlib
import json
import ssl
import threading
import time
from pathlib import Path

import redis
from kombu import Connection, Queue

from common import broker
from common.celery_app import make_celery
from common.keys import KOMBU_UNACKED, KOMBU_UNACKED_INDEX
from common.ledger_scripts import POP_RECORDED
from tests.conftest import REDIS_URL, make_settings
from tests.faultkit import PrivateTlsRedis


def _publish(conn: Connection, queue: Queue, n: int) -> None:
    """Messages {"n": 0} to {"n": n - 1}, in order."""
    with conn.Producer() as producer:
        for k in range(n):
            producer.publish({"n": k}, routing_key=queue.name, declare=[queue],
                             serializer="json")


def test_the_app_uses_it_for_redis_and_rediss_urls(tmp_path: Path) -> None:
    app = make_celery(make_settings(f"sqlite:///{tmp_path / 'd.db'}", "http://127.0.0.1:1"))
    with app.connection_for_write() as conn:
        assert isinstance(conn.default_channel, broker.Channel)
        # The shared acks, the reaper and the audit name kombu's unacked keys from
        # common/keys.py: the app's options must leave them as kombu names them.
        assert conn.default_channel.unacked_key == KOMBU_UNACKED
        assert conn.default_channel.unacked_index_key == KOMBU_UNACKED_INDEX
        # Logs name the broker as users wrote it ("Cannot connect to redis://...").
        assert conn.as_uri().startswith("redis://")
    assert broker.transport_for("redis://h:6379/0") == broker.TRANSPORT
    assert broker.transport_for("rediss://h:6380/0") == broker.TRANSPORT
    assert broker.transport_for("sentinel://h:26379") is None


def test_a_rediss_url_verifies_the_server_unless_the_url_says_otherwise(tmp_path: Path) -> None:
    """Named explicitly, the transport loses kombu's TLS set-up from the ``rediss`` scheme
    (which would not verify the server): the app's own options turn TLS on, verified."""
    db = f"sqlite:///{tmp_path / 'd.db'}"

    def ssl_of(url: str) -> object:
        app = make_celery(make_settings(db, "http://127.0.0.1:1", redis_url=url))
        with app.connection_for_write() as conn:
            return conn.ssl

    assert ssl_of("redis://127.0.0.1:6379/0") in (None, False)
    assert ssl_of("rediss://h:6380/0") == {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    assert ssl_of("rediss://h:6380/0?ssl_cert_reqs=none") == {"ssl_cert_reqs": ssl.CERT_NONE}


def test_a_rediss_broker_takes_and_records_messages_over_tls(tmp_path: Path) -> None:
    """The pop-and-record path over TLS: a task sent through a ``rediss://`` URL reaches the
    consumer, recorded as unacked in the same step, and its ack clears the record."""
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
            assert isinstance(conn.default_channel, broker.Channel)
            with conn.Consumer(queue, callbacks=[take], accept=["json"]) as consumer:
                consumer.qos(prefetch_count=4)
                conn.drain_events(timeout=5)
        assert [(body[0], held) for body, held in seen] == [([1], 1)], seen  # type: ignore[index]
        assert client.hlen(KOMBU_UNACKED) == 0
        client.close()


def test_a_task_sent_with_a_priority_lands_in_the_one_list_a_worker_looks_at(
    tmp_path: Path, redis_client: redis.Redis,
) -> None:
    """A worker's look for work pops one list a queue, so a task sent with a priority must
    land in that list, and come from it to the consumer."""
    app = make_celery(make_settings(f"sqlite:///{tmp_path / 'd.db'}", "http://127.0.0.1:1"))
    queue = Queue("broker-priority")
    try:
        app.send_task("datagen.test-priority", args=[7], queue=queue.name, priority=9)
        assert redis_client.llen(queue.name) == 1
        assert redis_client.keys(f"{queue.name}?*") == []
        got: list = []
        with app.connection_for_read() as conn, conn.Consumer(
                queue, callbacks=[lambda body, message: (got.append(body), message.ack())],
                accept=["json"]):
            conn.drain_events(timeout=5)
        assert got and got[0][0] == [7], got
    finally:
        redis_client.delete(queue.name, KOMBU_UNACKED, KOMBU_UNACKED_INDEX,
                            *redis_client.keys(f"{queue.name}?*"))


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
        _publish(conn, queue, len(bodies))
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


def test_settled_messages_leave_the_unacked_set_together_and_their_acks_stay_local(
    redis_client: redis.Redis,
) -> None:
    queue = Queue("broker-settled")
    with Connection(REDIS_URL, transport=broker.TRANSPORT) as conn:
        _publish(conn, queue, 12)
        with conn.SimpleQueue(queue) as simple:
            messages = [simple.get(timeout=5) for _ in range(12)]
            chan = simple.channel
            settled, others = messages[:8], messages[8:]
            broker.ack_settled(redis_client, [m.delivery_tag for m in settled])
            assert redis_client.hlen(chan.unacked_key) == 4
            assert redis_client.zcard(chan.unacked_index_key) == 4
            # Proof that the acks below send nothing to Redis: a stand-in entry under one
            # settled tag would be deleted by a real ack.
            redis_client.hset(chan.unacked_key, settled[0].delivery_tag, "stand-in")
            held = len(chan.qos._delivered) - len(chan.qos._dirty)
            for message in settled:
                message.ack()
            assert redis_client.hget(chan.unacked_key, settled[0].delivery_tag) == b"stand-in"
            # kombu's own bookkeeping still ran: the prefetch slots are free again.
            assert len(chan.qos._delivered) - len(chan.qos._dirty) == held - 8
            assert not {m.delivery_tag for m in settled} & broker.QoS.removed
            for message in others:  # not settled together: acked in Redis as before
                message.ack()
            assert redis_client.hlen(chan.unacked_key) == 1  # the stand-in only
            assert redis_client.zcard(chan.unacked_index_key) == 0
            redis_client.hdel(chan.unacked_key, settled[0].delivery_tag)


def test_a_reject_after_the_shared_ack_forgets_the_tag(redis_client: redis.Redis) -> None:
    queue = Queue("broker-settled-reject")
    with Connection(REDIS_URL, transport=broker.TRANSPORT) as conn:
        with conn.Producer() as producer:
            producer.publish({"n": 1}, routing_key=queue.name, declare=[queue],
                             serializer="json")
        with conn.SimpleQueue(queue) as simple:
            message = simple.get(timeout=5)
            broker.ack_settled(redis_client, [message.delivery_tag])
            message.reject(requeue=True)
            # Its result is stored: nothing comes back to the queue, and nothing is kept.
            assert message.delivery_tag not in broker.QoS.removed
            assert redis_client.llen(queue.name) == 0


def _consume(conn: Connection, queue: Queue, want: int, prefetch: int) -> tuple[list, int]:
    """Messages delivered to a consumer (left unacked) and the drain_events calls it took."""
    got: list = []
    with conn.Consumer(queue, callbacks=[lambda body, message: got.append(message)],
                       accept=["json"]) as consumer:
        consumer.qos(prefetch_count=prefetch)
        rounds = 0
        while len(got) < want and rounds < 4 * want:
            rounds += 1
            conn.drain_events(timeout=5)
    return got, rounds


def test_queued_messages_come_in_batches_each_recorded_as_unacked_with_its_pop(
    redis_client: redis.Redis,
) -> None:
    queue = Queue("broker-batch")
    with Connection(REDIS_URL, transport=broker.TRANSPORT) as conn:
        _publish(conn, queue, 40)
        got, rounds = _consume(conn, queue, 40, prefetch=64)
        chan = got[0].channel
        assert sorted(m.payload["n"] for m in got) == list(range(40))
        # One BRPOP, then up to BATCH_MAX more a round trip, instead of a BRPOP each.
        assert rounds <= -(-40 // (broker.BATCH_MAX + 1)) + 1, rounds
        assert redis_client.llen(queue.name) == 0
        # Each record is the one kombu writes on delivery, so kombu and the reaper restore
        # it as they restore any other.
        records = redis_client.hgetall(chan.unacked_key)
        assert sorted(records) == sorted(m.delivery_tag.encode() for m in got)
        assert redis_client.zcard(chan.unacked_index_key) == 40
        for m in got:
            payload, exchange, routing_key = json.loads(records[m.delivery_tag.encode()])
            assert payload == m._raw
            assert (exchange, routing_key) == (m.delivery_info["exchange"],
                                               m.delivery_info["routing_key"])
        for m in got[:20]:
            m.ack()
        assert redis_client.hlen(chan.unacked_key) == 20
        # A consumer that dies now leaves its 20 unacked messages to be restored: all come
        # back, once each.
        for m in got[20:]:
            chan.qos.restore_by_tag(m.delivery_tag)
        restored = [json.loads(raw)["properties"]["delivery_tag"]
                    for raw in redis_client.lrange(queue.name, 0, -1)]
        assert sorted(restored) == sorted(m.delivery_tag for m in got[20:])
        assert redis_client.hlen(chan.unacked_key) == 0
        redis_client.delete(queue.name, chan.unacked_key, chan.unacked_index_key)


def test_a_batch_takes_no_more_than_the_prefetch_room(redis_client: redis.Redis) -> None:
    queue = Queue("broker-room")
    with Connection(REDIS_URL, transport=broker.TRANSPORT) as conn:
        _publish(conn, queue, 30)
        got, _ = _consume(conn, queue, 5, prefetch=5)
        assert len(got) == 5
        assert redis_client.llen(queue.name) == 25
        assert redis_client.hlen(got[0].channel.unacked_key) == 5
        redis_client.delete(queue.name, got[0].channel.unacked_key,
                            got[0].channel.unacked_index_key)


def test_a_message_is_recorded_as_unacked_before_it_reaches_the_worker(
    redis_client: redis.Redis,
) -> None:
    """A worker killed at any instant leaves each message in its queue or the unacked hash:
    with kombu's BRPOP, one popped and not yet recorded is in neither, and is lost."""
    queue = Queue("broker-recorded")
    seen: list[tuple[bool, int]] = []
    with Connection(REDIS_URL, transport=broker.TRANSPORT) as conn:
        _publish(conn, queue, 40)
        deliver = conn.transport._deliver

        def checked(message: dict, queue_name: str) -> None:
            tag = message["properties"]["delivery_tag"]
            seen.append((bool(redis_client.hexists(KOMBU_UNACKED, tag)),
                         int(redis_client.zscore(KOMBU_UNACKED_INDEX, tag) or 0)))
            deliver(message, queue_name)

        conn.transport._deliver = checked
        got, _ = _consume(conn, queue, 40, prefetch=64)
        assert len(got) == 40 and len(seen) == 40
        assert all(recorded and indexed for recorded, indexed in seen), seen
        redis_client.delete(queue.name, KOMBU_UNACKED, KOMBU_UNACKED_INDEX)


def test_an_idle_consumer_takes_a_message_published_while_it_waits(
    redis_client: redis.Redis,
) -> None:
    queue = Queue("broker-idle")
    with Connection(REDIS_URL, transport=broker.TRANSPORT) as conn:
        with conn.Consumer(queue, callbacks=[], accept=["json"]) as consumer:
            got: list = []
            consumer.register_callback(lambda body, message: got.append(body))
            consumer.qos(prefetch_count=4)
            # Waits with nothing queued: each round ends empty.
            for _ in range(3):
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.3)
            assert got == []
            with Connection(REDIS_URL, transport=broker.TRANSPORT) as other:
                _publish(other, queue, 1)
            conn.drain_events(timeout=5)
            assert got == [{"n": 0}]
        redis_client.delete(queue.name, KOMBU_UNACKED, KOMBU_UNACKED_INDEX)


def test_a_connection_lost_under_the_consumers_wait_costs_no_restart(
    redis_client: redis.Redis,
) -> None:
    """The reply kombu's loop waits for carries no message, so losing it is not an error
    for the consumer: it reconnects and goes on, where kombu's raises and Celery restarts
    the consumer, putting back every message the worker holds."""
    queue = Queue("broker-killed")
    with Connection(REDIS_URL, transport=broker.TRANSPORT) as conn:
        got: list = []
        with conn.Consumer(queue, callbacks=[lambda body, message: got.append(body)],
                           accept=["json"]) as consumer:
            consumer.qos(prefetch_count=4)
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.3)
            # The consumer's connection, the one whose last command is its wait's BRPOP:
            # killed, the next read finds it closed.
            db = str(redis_client.connection_pool.connection_kwargs.get("db", 0))
            waiting = [c["id"] for c in redis_client.client_list()
                       if c["cmd"] == "brpop" and c["db"] == db]
            assert len(waiting) == 1, redis_client.client_list()
            assert redis_client.client_kill_filter(_id=waiting[0]) == 1
            with Connection(REDIS_URL, transport=broker.TRANSPORT) as other:
                _publish(other, queue, 1)
            deadline = time.monotonic() + 5
            while not got and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=1)
            assert got == [{"n": 0}]
        redis_client.delete(queue.name, KOMBU_UNACKED, KOMBU_UNACKED_INDEX)


def test_the_pop_moves_aside_what_it_cannot_read_and_goes_on(redis_client: redis.Redis) -> None:
    pop = redis_client.register_script(POP_RECORDED)
    key, index, unacked = "broker-unreadable", "broker-test-index", "broker-test-unacked"
    aside = "broker-test-aside"
    redis_client.delete(key, index, unacked, aside)
    good = json.dumps({"properties": {"delivery_tag": "t1", "delivery_info": {
        "exchange": "", "routing_key": key}}})
    # Taken from the right: "not json", then a message without a tag, then a good one.
    redis_client.lpush(key, "not json", '{"properties": {}}', good)
    popped, unreadable = pop(keys=[index, unacked, aside, key], args=[1.0, 5])
    assert [popped, unreadable] == [[key.encode(), good.encode()], 2]
    assert redis_client.lrange(aside, 0, -1) == [b'{"properties": {}}', b"not json"]
    assert redis_client.llen(key) == 0
    assert json.loads(redis_client.hget(unacked, "t1"))[0] == json.loads(good)
    assert redis_client.zscore(index, "t1") == 1.0
    # What it moves aside counts toward the batch: a queue of them is not emptied at once.
    redis_client.lpush(key, *["junk"] * 5)
    assert pop(keys=[index, unacked, aside, key], args=[1.0, 3]) == [[], 3]
    assert redis_client.llen(key) == 2
    redis_client.delete(key, index, unacked, aside)


def test_the_pop_takes_one_from_each_busy_list_a_pass_past_empty_ones(
    redis_client: redis.Redis
) -> None:
    """Lists found empty are skipped for the rest of the call (a worker consumes every
    finished dataset's queue too): what it takes, and in which order, is as before."""
    pop = redis_client.register_script(POP_RECORDED)
    index, unacked, aside = "broker-test-index", "broker-test-unacked", "broker-test-aside"
    lists = [f"broker-pass-{i}" for i in range(6)]
    redis_client.delete(index, unacked, aside, *lists)

    def message(key: str, n: int) -> str:
        return json.dumps({"properties": {"delivery_tag": f"{key}/{n}", "delivery_info": {
            "exchange": "", "routing_key": key}}})

    # Lists 1 and 4 hold 3 messages and 1, the others none; RPOP takes the oldest first.
    redis_client.lpush(lists[1], *[message(lists[1], n) for n in range(3)])
    redis_client.lpush(lists[4], message(lists[4], 0))
    popped, unreadable = pop(keys=[index, unacked, aside, *lists], args=[1.0, 16])
    tags = [json.loads(raw)["properties"]["delivery_tag"] for raw in popped[1::2]]
    assert unreadable == 0
    assert tags == [f"{lists[1]}/0", f"{lists[4]}/0", f"{lists[1]}/1", f"{lists[1]}/2"]
    assert [k.decode() for k in popped[::2]] == [lists[1], lists[4], lists[1], lists[1]]
    assert redis_client.hlen(unacked) == 4 and redis_client.zcard(index) == 4
    # A list that fills again is looked at by the next call.
    redis_client.lpush(lists[0], message(lists[0], 0))
    assert pop(keys=[index, unacked, aside, *lists], args=[1.0, 16])[0][::2] == [
        lists[0].encode()]
    redis_client.delete(index, unacked, aside, *lists)
