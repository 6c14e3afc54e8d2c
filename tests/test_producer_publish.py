"""The producer's publisher: Celery's message builder and sender in kombu's Producer.batch,
one pipelined round trip a chunk, messages a worker reads and a dataset's stamp revokes."""

from __future__ import annotations

import ast
import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.worker import state as worker_state
from celery.worker.request import Request

from common.audit import queued_in_redis
from common.celery_app import make_celery
from common.errors import ServiceUnavailable
from common.keys import PROMPT_PRIORITY, dataset_keys, queue_name
from common.messages import GENERATE_TASK, STAMP, sample_of
from common.publish import BATCH_SIZE, Publisher
from tests.conftest import make_settings
from workers.app import create_app

DATASET, STAMP_VALUE = "pub", "pub@0123456789ab"
PROMPTS = dataset_keys(DATASET).prompts  # the list new prompts wait in
# Quotes, backslashes, non-ASCII and JSON-looking text must survive both encodings.
ODD_IDS = ["plain", "it's", 'say "hi"', "back\\slash", "ünï©ødé ✓", '{"x": 1}', "\u2028"]


@pytest.fixture
def app(redis_client: redis.Redis) -> Iterator[Celery]:
    app = make_celery(make_settings("sqlite://", "http://127.0.0.1:9"))
    yield app
    app.close()


def _queue(client: redis.Redis) -> list[dict[str, Any]]:
    """The queue's messages, oldest (next consumed) first."""
    return [json.loads(raw) for raw in reversed(client.lrange(PROMPTS, 0, -1))]


def _via_plain_send_task(app: Celery, ids: list[str]) -> None:
    """One send_task a message with nothing but the task's own options."""
    for sid in ids:
        app.send_task(GENERATE_TASK, kwargs={"dataset": DATASET, "sample_id": sid},
                      queue=queue_name(DATASET), ignore_result=True, priority=PROMPT_PRIORITY,
                      stamped_headers=[STAMP], **{STAMP: STAMP_VALUE})


def _without_fresh_ids(message: dict[str, Any]) -> dict[str, Any]:
    """The message but its ids and the log line of its arguments (checked on its own)."""
    out = json.loads(json.dumps(message))
    for key in ("id", "root_id", "kwargsrepr"):
        del out["headers"][key]
    for key in ("correlation_id", "delivery_tag"):
        del out["properties"][key]
    return out


def test_messages_equal_a_plain_send_tasks_but_for_fresh_ids(
    app: Celery, redis_client: redis.Redis
) -> None:
    Publisher(app).publish(DATASET, STAMP_VALUE, ODD_IDS)
    batched = _queue(redis_client)
    redis_client.delete(PROMPTS)
    _via_plain_send_task(app, ODD_IDS)
    plain = _queue(redis_client)
    assert [_without_fresh_ids(m) for m in batched] == [_without_fresh_ids(m) for m in plain]
    assert [sample_of(m) for m in batched] == [(DATASET, sid) for sid in ODD_IDS]
    # Python's repr of the kwargs, which reads back as them, where saferepr spells some
    # of these ids otherwise; for plain ids both agree.
    assert [ast.literal_eval(m["headers"]["kwargsrepr"]) for m in batched] == [
        {"dataset": DATASET, "sample_id": sid} for sid in ODD_IDS]
    assert batched[0]["headers"]["kwargsrepr"] == plain[0]["headers"]["kwargsrepr"]


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
        raw = redis_client.rpop(PROMPTS)
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


def test_the_producer_pipelines_its_publishes(app: Celery) -> None:
    # Without it (a Redis client that retries on timeout or error), kombu's batch
    # silently sends each message with its own round trip.
    with app.producer_or_acquire() as producer:
        assert producer.supports_batch_publish


def test_each_chunk_lands_in_order_in_one_round_trip(
    app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = [f"s{i:04d}" for i in range(BATCH_SIZE)]
    sent: list[int] = []
    real = redis.client.Pipeline.execute

    def execute(self: redis.client.Pipeline, raise_on_error: bool = True) -> list[Any]:
        # The messages' pipelines (the queue's declaration, once a connection, is not one).
        if any(args[0] == "LPUSH" for args, _ in self.command_stack):
            sent.append(len(self.command_stack))
        return real(self, raise_on_error)

    monkeypatch.setattr(redis.client.Pipeline, "execute", execute)
    publisher = Publisher(app)
    publisher.publish(DATASET, STAMP_VALUE, ids[:500])
    publisher.publish(DATASET, STAMP_VALUE, [])
    # The first chunk leaves the pooled connection set up to pipeline the next one too.
    publisher.publish(DATASET, STAMP_VALUE, ids[500:])
    assert sent == [500, BATCH_SIZE - 500]
    assert [sample_of(m) for m in _queue(redis_client)] == [(DATASET, s) for s in ids]
    assert queued_in_redis(redis_client, DATASET) == set(ids)


def test_a_failed_flush_is_reported_not_replayed(
    app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The connection drops after Redis took the first half of the chunk.
    def half_then_drop(self: redis.client.Pipeline, raise_on_error: bool = True) -> None:
        client = redis.Redis.from_url(app.conf.broker_url)
        for args, _options in self.command_stack[: len(self.command_stack) // 2]:
            client.execute_command(*args)
        raise redis.ConnectionError("Connection closed by server.")

    monkeypatch.setattr(redis.client.Pipeline, "execute", half_then_drop)
    ids = [f"s{i}" for i in range(10)]
    with pytest.raises(ServiceUnavailable, match="datagen enqueue"):
        Publisher(app).publish(DATASET, STAMP_VALUE, ids)
    assert [sample_of(m) for m in _queue(redis_client)] == [(DATASET, s) for s in ids[:5]]


def test_message_stays_a_small_reference(app: Celery, redis_client: redis.Redis) -> None:
    Publisher(app).publish(DATASET, STAMP_VALUE, ["h0123456789abcdef"])
    raw = redis_client.lindex(PROMPTS, 0)
    assert raw is not None and len(raw) <= 1100


def test_the_apps_message_options_apply(app: Celery, redis_client: redis.Redis) -> None:
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


def test_a_message_sent_from_a_task_names_it_as_parent_as_send_task_does(
    app: Celery, redis_client: redis.Redis
) -> None:
    """A worker publishes a conversation's next turn from inside its task."""

    @app.task(name="datagen.test-parent", shared=False)
    def publish_both() -> str:
        Publisher(app).publish(DATASET, STAMP_VALUE, ["next"])
        _via_plain_send_task(app, ["next"])
        return str(publish_both.request.id)

    parent = publish_both.apply().get()
    batched, plain = _queue(redis_client)
    assert batched["headers"]["parent_id"] == plain["headers"]["parent_id"] == parent
    assert batched["headers"]["root_id"] == plain["headers"]["root_id"] == parent
    assert _without_fresh_ids(batched) == _without_fresh_ids(plain)
