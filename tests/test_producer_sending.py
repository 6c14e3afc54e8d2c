"""The producer's publishing process: chunks reach Redis in order, a failure comes back
to the producer, and no chunk after a failed one is published."""

from __future__ import annotations

import pytest
import redis

from common.celery_app import make_celery
from common.messages import sample_of
from producer.sending import Abandoned, Sender
from tests.conftest import make_settings
from tests.test_producer_publish import DATASET, PROMPTS, STAMP_VALUE, _queue


def test_chunks_reach_redis_in_the_order_they_were_handed_over(
    redis_client: redis.Redis,
) -> None:
    sender = Sender(make_celery(make_settings("sqlite://", "http://127.0.0.1:9")))
    chunks = [[f"c{c}-{i}" for i in range(300)] for c in range(4)]
    try:
        sent = [sender.submit(DATASET, STAMP_VALUE, chunk) for chunk in chunks]
        for future in sent:
            future.result(timeout=60)
    finally:
        sender.close()
    assert [sample_of(m) for m in _queue(redis_client)] == [
        (DATASET, sid) for chunk in chunks for sid in chunk]


def test_a_failed_chunk_fails_its_future_and_abandons_the_later_ones(
    redis_client: redis.Redis,
) -> None:
    app = make_celery(make_settings("sqlite://", "http://127.0.0.1:9"))
    app.conf.broker_url = "redis://127.0.0.1:9/0"  # nothing listens there
    app.conf.task_publish_retry = False
    sender = Sender(app)
    try:
        first = sender.submit(DATASET, STAMP_VALUE, ["a"])
        second = sender.submit(DATASET, STAMP_VALUE, ["b"])
        with pytest.raises(Exception) as failed:
            first.result(timeout=60)
        assert not isinstance(failed.value, Abandoned)
        with pytest.raises(Abandoned):
            second.result(timeout=60)
    finally:
        sender.close()
    assert redis_client.llen(PROMPTS) == 0
