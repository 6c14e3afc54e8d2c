"""The producer's publisher: one LPUSH per chunk, messages as Celery's send_task forms them."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.worker import state as worker_state
from celery.worker.request import Request

from common.audit import queued_in_redis, sample_of
from common.celery_app import GENERATE_TASK, STAMP, make_celery
from common.keys import queue_name
from common.publish import Publisher
from tests.conftest import make_settings
from workers.app import create_app

DATASET, STAMP_VALUE = "pub", "pub@0123456789ab"
# Quotes, backslashes, non-ASCII and JSON-looking text must survive both encodings.
ODD_IDS = ["plain", "it's", 'say "hi"', "back\\slash", "ünï©ødé ✓", '{"x": 1}', "\u2028"]


@pytest.fixture
def app(redis_client: redis.Redis) -> Iterator[Celery]:
    app = make_celery(make_settings("sqlite://", "http://127.0.0.1:9"))
    yield app
    app.close()


def _queue(client: redis.Redis) -> list[dict[str, Any]]:
    """The queue's messages, oldest (next consumed) first."""
    return [json.loads(raw) for raw in reversed(client.lrange(queue_name(DATASET), 0, -1))]


def _via_send_task(app: Celery, ids: list[str]) -> None:
    publisher = Publisher(app)
    with app.producer_or_acquire() as producer:
        publisher._publish_via_celery(producer, queue_name(DATASET), DATASET, STAMP_VALUE, ids)


def _without_fresh_ids(message: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(message))
    for key in ("id", "root_id"):
        del out["headers"][key]
    for key in ("correlation_id", "delivery_tag"):
        del out["properties"][key]
    # send_task also copies its repr options into the properties; nothing reads them there.
    for key in ("argsrepr", "kwargsrepr"):
        out["properties"].pop(key, None)
    return out


def test_messages_equal_send_tasks_but_for_fresh_ids(
    app: Celery, redis_client: redis.Redis
) -> None:
    Publisher(app).publish(DATASET, STAMP_VALUE, ODD_IDS)
    fast = _queue(redis_client)
    redis_client.delete(queue_name(DATASET))
    _via_send_task(app, ODD_IDS)
    slow = _queue(redis_client)
    assert [_without_fresh_ids(m) for m in fast] == [_without_fresh_ids(m) for m in slow]
    assert [sample_of(m) for m in fast] == [(DATASET, sid) for sid in ODD_IDS]


def test_each_message_has_its_own_consistent_ids(app: Celery, redis_client: redis.Redis) -> None:
    Publisher(app).publish(DATASET, STAMP_VALUE, [f"s{i}" for i in range(50)])
    messages = _queue(redis_client)
    task_ids = {m["headers"]["id"] for m in messages}
    tags = {m["properties"]["delivery_tag"] for m in messages}
    assert len(task_ids) == len(tags) == 50
    for m in messages:
        assert m["headers"]["root_id"] == m["properties"]["correlation_id"] == m["headers"]["id"]
        kwargs = json.loads(base64.b64decode(m["body"]))[1]
        assert m["headers"]["kwargsrepr"] == repr(kwargs)
        assert m["headers"]["stamps"] == {STAMP: STAMP_VALUE}
        assert m["headers"]["stamped_headers"] == [STAMP]
        assert m["properties"]["delivery_info"] == {"exchange": "",
                                                    "routing_key": queue_name(DATASET)}


def test_a_worker_reads_the_task_and_its_stamp_revokes_it(
    app: Celery, redis_client: redis.Redis
) -> None:
    Publisher(app).publish(DATASET, STAMP_VALUE, ["s1"])
    worker_app = create_app(make_settings("sqlite://", "http://127.0.0.1:9"))
    with worker_app.connection_for_read() as conn:
        channel = conn.default_channel
        raw = redis_client.rpop(queue_name(DATASET))
        assert isinstance(raw, bytes)
        message = channel.message_to_python(json.loads(raw))
        request = Request(message, app=worker_app, task=worker_app.tasks[GENERATE_TASK])
        assert request.task_name == GENERATE_TASK
        assert request.kwargs == {"dataset": DATASET, "sample_id": "s1"}
        assert request.ignore_result is True
        assert not request.revoked()
        worker_state.revoked_stamps[STAMP] = [STAMP_VALUE]
        try:
            assert request.revoked()
        finally:
            worker_state.revoked_stamps.pop(STAMP, None)
    worker_app.close()


def test_chunk_lands_in_order_in_one_push(app: Celery, redis_client: redis.Redis) -> None:
    ids = [f"s{i:04d}" for i in range(1000)]
    publisher = Publisher(app)
    publisher.publish(DATASET, STAMP_VALUE, ids)
    publisher.publish(DATASET, STAMP_VALUE, [])
    assert [sample_of(m) for m in _queue(redis_client)] == [(DATASET, s) for s in ids]
    assert queued_in_redis(redis_client, DATASET) == set(ids)


def test_message_stays_a_small_reference(app: Celery, redis_client: redis.Redis) -> None:
    Publisher(app).publish(DATASET, STAMP_VALUE, ["h0123456789abcdef"])
    raw = redis_client.lindex(queue_name(DATASET), 0)
    assert raw is not None and len(raw) <= 1100


def test_falls_back_to_send_task_when_the_template_cannot_apply(
    app: Celery, redis_client: redis.Redis
) -> None:
    app.conf.task_compression = "zlib"
    Publisher(app).publish(DATASET, STAMP_VALUE, ["a", "b"])
    messages = _queue(redis_client)
    assert [m["headers"]["compression"] for m in messages] == ["application/x-gzip"] * 2
    worker_app = create_app(make_settings("sqlite://", "http://127.0.0.1:9"))
    with worker_app.connection_for_read() as conn:
        decoded = [conn.default_channel.message_to_python(m).decode() for m in messages]
    assert [d[1]["sample_id"] for d in decoded] == ["a", "b"]
    worker_app.close()


def test_publish_all_splits_into_chunks(app: Celery, redis_client: redis.Redis) -> None:
    ids = [f"s{i}" for i in range(2500)]
    Publisher(app).publish_all(DATASET, STAMP_VALUE, ids)
    assert [sample_of(m) for m in _queue(redis_client)] == [(DATASET, s) for s in ids]
