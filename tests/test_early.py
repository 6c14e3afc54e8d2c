"""Admission at delivery: the consumer admits a pop's samples, their tasks take it."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

import redis

from common.celery_app import GENERATE_TASK, make_celery
from common.keys import queue_name
from common.ledger import Admission, Ledger
from common.settings import Settings
from common.store import Store
from ops.localredis import free_port
from tests.helpers import assert_invariants, context_for, running_worker, wait_settled
from workers.context import WorkerContext, get_context
from workers.early import EarlyAdmissions, sample_of


def queued_payloads(client: redis.Redis, dataset: str) -> list[dict[str, Any]]:
    """The dataset's queued messages as a pop hands them to the consumer."""
    return [json.loads(raw) for raw in client.lrange(queue_name(dataset), 0, -1)]


def delivered(settings: Settings, client: redis.Redis, tmp_path: Path, name: str,
              n: int) -> tuple[WorkerContext, EarlyAdmissions, list[dict[str, Any]]]:
    """A new dataset of ``n`` prompts whose queued messages were all popped in one go."""
    ctx = context_for(settings, tmp_path, name, n)
    early = EarlyAdmissions(ctx, ttl_s=60.0)
    payloads = queued_payloads(client, name)
    early.on_delivery(payloads)
    return ctx, early, payloads


def reserved(ledger: Ledger, dataset: str) -> int:
    return ledger.state(dataset).reserved_tokens


def test_a_generate_message_is_read_and_any_other_left_alone(
    settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    context_for(settings, tmp_path, "parsed", 2)
    payloads = queued_payloads(redis_client, "parsed")
    found = sorted(s[1:] for s in map(sample_of, payloads) if s is not None)
    assert found == [("parsed", "parsed-0"), ("parsed", "parsed-1")]
    tags = {p["properties"]["delivery_tag"] for p in payloads}
    assert {s[0] for s in map(sample_of, payloads) if s is not None} == tags

    due_later = {**payloads[0], "headers": {**payloads[0]["headers"], "eta": "2030-01-01T00:00"}}
    other_task = {**payloads[0], "headers": {**payloads[0]["headers"], "task": "other"}}
    with_args = {**payloads[0], "body": base64.b64encode(
        json.dumps([["x"], {"dataset": "parsed", "sample_id": "parsed-0"}, {}]).encode()).decode()}
    garbled = {**payloads[0], "body": "not base64 json"}
    for payload in (due_later, other_task, with_args, garbled, {}):
        assert sample_of(payload) is None


def test_the_admissions_of_a_pop_are_taken_by_their_tasks_or_given_back(
    settings: Settings, ledger: Ledger, redis_client: redis.Redis, tmp_path: Path
) -> None:
    ctx, early, payloads = delivered(settings, redis_client, tmp_path, "popped", 3)
    assert (early.made, len(early)) == (3, 3)
    assert reserved(ledger, "popped") > 0
    assert len(ctx.live_rids.snapshot()) == 3

    first, second, third = (sample_of(p) for p in payloads)
    assert first and second and third
    taken = early.take(first[0], first[1], first[2])
    assert taken is not None and taken.sample_id == first[2]
    prompt, admission = taken.admitted
    assert prompt is not None and prompt.state == "queued" and admission is Admission.ADMITTED
    assert early.take(first[0], first[1], first[2]) is None  # taken once

    # A revoked message's task never runs: its reservation goes back at once.
    before = reserved(ledger, "popped")
    early.drop(second[0])
    assert reserved(ledger, "popped") < before
    # One not taken within the TTL goes back at the next look.
    assert early.expire(now=taken.at + 61.0) == 1
    assert len(early) == 0 and early.given_back == 2
    # Only the taken one's rid is still claimed, and only its reservation still held
    # (its task releases it by its charge, or here by hand).
    assert ctx.live_rids.snapshot() == [taken.rid]
    ledger.release("popped", taken.rid)
    assert reserved(ledger, "popped") == 0


def test_a_message_delivered_again_keeps_one_admission(
    settings: Settings, ledger: Ledger, redis_client: redis.Redis, tmp_path: Path
) -> None:
    ctx, early, payloads = delivered(settings, redis_client, tmp_path, "again", 2)
    once = reserved(ledger, "again")
    # Put back by a consumer restart, the same messages come again with their tags.
    early.on_delivery(payloads)
    assert (early.made, len(early), early.given_back) == (4, 2, 2)
    assert reserved(ledger, "again") == once
    assert len(ctx.live_rids.snapshot()) == 2


def test_no_more_are_admitted_than_there_are_threads_free(
    settings: Settings, ledger: Ledger, redis_client: redis.Redis, tmp_path: Path
) -> None:
    ctx = context_for(settings.replace(concurrency=4), tmp_path, "room", 3)
    ctx.live_rids.add("a-running-task")
    ctx.live_rids.add("another")
    early = EarlyAdmissions(ctx)
    payloads = queued_payloads(redis_client, "room")
    early.on_delivery(payloads)
    assert (early.made, len(early)) == (2, 2)  # the third admits itself when it runs
    assert len(ctx.live_rids) == 4
    early.on_delivery(queued_payloads(redis_client, "room"))  # no thread free now
    assert early.made == 2


def test_a_message_under_another_sample_is_not_taken(
    settings: Settings, ledger: Ledger, redis_client: redis.Redis, tmp_path: Path
) -> None:
    ctx, early, payloads = delivered(settings, redis_client, tmp_path, "mixed", 1)
    tag = payloads[0]["properties"]["delivery_tag"]
    assert early.take(tag, "mixed", "mixed-9") is None
    assert reserved(ledger, "mixed") == 0 and ctx.live_rids.snapshot() == []


def test_a_failed_admission_leaves_the_tasks_to_admit_themselves(
    settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    ctx = context_for(settings, tmp_path, "away", 2)
    payloads = queued_payloads(redis_client, "away")
    # Redis is away: ADMIT does not answer.
    ledger, ctx.ledger = ctx.ledger, Ledger(redis.Redis(port=free_port(), socket_timeout=2))
    early = EarlyAdmissions(ctx, pause_s=30.0)
    early.on_delivery(payloads, now=1000.0)
    assert (early.made, len(early)) == (0, 0) and ctx.live_rids.snapshot() == []
    # Paused: the next pops do not try again at once, even with the database back.
    ctx.ledger = ledger
    early.on_delivery(payloads, now=1029.0)
    assert early.made == 0
    early.on_delivery(payloads, now=1031.0)  # the pause is over
    assert early.made == 2


def test_the_worker_admits_at_delivery_and_settles_everything(
    settings: Settings, store: Store, ledger: Ledger, sim: str, tmp_path: Path
) -> None:
    context_for(settings, tmp_path, "delivered", 40)
    with running_worker(settings, concurrency=8) as app:
        wait_settled(store, ["delivered"])
        early = get_context(app).early
        # Every message was fresh, so every task found its admission waiting.
        assert early.made == 40 and early.taken == 40 and early.given_back == 0
    assert store.prompt_counts("delivered") == {"done": 40}
    assert reserved(ledger, "delivered") == 0
    assert_invariants(store, ledger, ["delivered"])


def test_a_revoked_message_gives_its_admission_back(
    settings: Settings, store: Store, ledger: Ledger, redis_client: redis.Redis, sim: str,
    tmp_path: Path,
) -> None:
    context_for(settings, tmp_path, "revoked", 1)
    redis_client.delete(queue_name("revoked"))  # the sample's own message is gone
    with running_worker(settings, concurrency=4) as app:
        # Broadcast: a worker that has only just started may not listen yet, so ask
        # until it answers.
        deadline = time.monotonic() + 30
        while not app.control.revoke("revoked-task", reply=True, timeout=1):
            assert time.monotonic() < deadline, "the worker did not answer the revoke"
        # The sample's message again, under the revoked task id.
        make_celery(settings).send_task(GENERATE_TASK, task_id="revoked-task",
                                        kwargs={"dataset": "revoked", "sample_id": "revoked-0"},
                                        queue=queue_name("revoked"))
        early = get_context(app).early
        deadline = time.monotonic() + 20
        while early.given_back == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (early.made, early.taken, early.given_back) == (1, 0, 1)
    assert reserved(ledger, "revoked") == 0
    assert store.prompt_counts("revoked") == {"queued": 1}
