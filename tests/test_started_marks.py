"""A worker's started marks (workers/started.py): written together, never after the
script that ends their request, against the real Redis."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import redis

from common.budget import Budget
from common.keys import dataset_keys
from common.ledger import Admission, Ledger
from tests.faultkit import wait_for
from workers.started import StartedMarks


def started(redis_client: redis.Redis, name: str) -> set[str]:
    return {m.decode() for m in redis_client.smembers(dataset_keys(name).started)}


def admitted(ledger: Ledger, name: str, rids: Sequence[str]) -> None:
    ledger.configure(name, Budget(10_000))
    for rid in rids:
        assert ledger.admit(name, rid, 100, 50) is Admission.ADMITTED


def test_marks_of_two_datasets_are_written_in_one_flush(
        ledger: Ledger, redis_client: redis.Redis) -> None:
    admitted(ledger, "a", ["a1", "a2"])
    admitted(ledger, "b", ["b1"])
    writes: list[int] = []

    def write(marks: Sequence[tuple[str, str]]) -> None:
        writes.append(len(marks))
        ledger.mark_started(marks)

    marks = StartedMarks(write, every_s=3600)  # its own thread would not write in time
    for name, rid in (("a", "a1"), ("a", "a2"), ("b", "b1")):
        marks.mark(name, rid)
    assert started(redis_client, "a") == set()
    marks.flush()
    assert writes == [3]
    assert started(redis_client, "a") == {"a1", "a2"} and started(redis_client, "b") == {"b1"}
    assert ledger.queued_rids("a") == [] and ledger.queued_rids("b") == []
    marks.flush()
    assert writes == [3]  # nothing pending: no round trip


def test_its_own_thread_writes_the_marks(ledger: Ledger, redis_client: redis.Redis) -> None:
    admitted(ledger, "ds", ["r1", "r2"])
    marks = StartedMarks(ledger.mark_started, every_s=0.05)
    marks.mark("ds", "r1")
    wait_for(lambda: started(redis_client, "ds") == {"r1"}, 10, "r1 marked")
    assert ledger.queued_rids("ds") == ["r2"]
    marks.mark("ds", "r2")  # after a write: the thread wakes again
    wait_for(lambda: started(redis_client, "ds") == {"r1", "r2"}, 10, "r2 marked")


def test_a_request_that_ends_before_the_write_leaves_no_mark(
        ledger: Ledger, redis_client: redis.Redis) -> None:
    admitted(ledger, "ds", ["r1", "r2"])
    marks = StartedMarks(ledger.mark_started, every_s=3600)
    marks.mark("ds", "r1")
    marks.mark("ds", "r2")
    marks.forget("r1")
    ledger.charge("ds", "s1", "r1", 10, 20)
    marks.flush()
    assert started(redis_client, "ds") == {"r2"}


def test_forget_waits_for_a_write_under_way(ledger: Ledger,
                                            redis_client: redis.Redis) -> None:
    # Else the charge's script could remove the mark before the write adds it, and the
    # mark would stay in the set for the whole run.
    admitted(ledger, "ds", ["r1"])
    entered, go = threading.Event(), threading.Event()

    def slow_write(batch: Sequence[tuple[str, str]]) -> None:
        entered.set()
        assert go.wait(10)
        ledger.mark_started(batch)

    marks = StartedMarks(slow_write, every_s=3600)
    marks.mark("ds", "r1")
    flusher = threading.Thread(target=marks.flush)
    flusher.start()
    assert entered.wait(10)
    ended = threading.Event()

    def end_request() -> None:
        marks.forget("r1")
        ledger.charge("ds", "s1", "r1", 10, 20)
        ended.set()

    charger = threading.Thread(target=end_request)
    charger.start()
    assert not ended.wait(0.3)  # held while the mark is being written
    go.set()
    flusher.join(10)
    charger.join(10)
    assert ended.is_set()
    assert started(redis_client, "ds") == set()
    assert ledger.inflight_rids("ds") == []


def test_redis_away_loses_the_batch_not_the_thread(ledger: Ledger,
                                                   redis_client: redis.Redis) -> None:
    admitted(ledger, "ds", ["r1", "r2"])
    calls: list[int] = []

    def flaky(batch: Sequence[tuple[str, str]]) -> None:
        calls.append(len(batch))
        if len(calls) == 1:
            raise redis.ConnectionError("Redis went away")
        ledger.mark_started(batch)

    marks = StartedMarks(flaky, every_s=0.05)
    marks.mark("ds", "r1")
    wait_for(lambda: calls == [1], 10, "the failed write")
    marks.forget("r1")  # does not wait: nothing is being written
    marks.mark("ds", "r2")
    wait_for(lambda: started(redis_client, "ds") == {"r2"}, 10, "the next write")
