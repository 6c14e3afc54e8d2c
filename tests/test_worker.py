"""The worker against the simulator: duplicates, permanent and transient errors."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import requests
from celery.exceptions import Reject
from kombu.exceptions import OperationalError

from common.celery_app import make_celery
from common.errors import IncompatibleServer
from common.ledger import Ledger
from common.publish import Publisher
from common.rows import NewPrompt
from common.settings import Settings
from common.sglang_client import parse_completion
from common.store import Store
from ops.localredis import free_port
from tests.conftest import make_settings
from tests.helpers import (
    assert_invariants,
    enqueue_paths,
    running_worker,
    wait_settled,
    write_dataset,
)
from workers.app import create_app, prepare
from workers.context import get_context
from workers.tasks import register_tasks, send_retry


def sim_log(sim: str) -> list[dict]:
    return requests.get(f"{sim}/sim/requests", timeout=5).json()


def test_same_message_delivered_twice_stores_and_counts_once(
    settings: Settings, store: Store, ledger: Ledger, sim: str, tmp_path: Path
) -> None:
    enqueue_paths(settings, [str(write_dataset(tmp_path, "twice", 3))])
    publisher = Publisher(make_celery(settings))
    for _ in range(2):  # the same (dataset, sample_id) published twice more
        publisher.publish("twice", store.dataset("twice").stamp, ["twice-0", "twice-1", "twice-2"])
    with running_worker(settings, concurrency=8):
        wait_settled(store, ["twice"])
        used = ledger.state("twice").used_tokens
    assert_invariants(store, ledger, ["twice"])
    assert store.prompt_counts("twice") == {"done": 3}
    assert used == store.used_tokens("twice", store.dataset("twice").budget)


def test_the_shared_steps_are_sized_to_the_threads_the_worker_runs(
    settings: Settings, store: Store, sim: str, tmp_path: Path
) -> None:
    # DATAGEN_CONCURRENCY says 64, the command line 4: the groups follow the pool.
    enqueue_paths(settings, [str(write_dataset(tmp_path, "sized", 8))])
    with running_worker(settings.replace(concurrency=64), concurrency=4) as app:
        wait_settled(store, ["sized"])
        ctx = get_context(app)
        assert (ctx.admissions.max_group, ctx.settlements.max_group) == (4, 4)
    assert store.prompt_counts("sized") == {"done": 8}


def test_a_400_is_recorded_and_not_retried(
    settings: Settings, store: Store, ledger: Ledger, sim: str, tmp_path: Path
) -> None:
    # The simulator's context is 32,768 tokens; asking for 32,767 new ones overflows it.
    enqueue_paths(settings, [str(write_dataset(tmp_path, "toolong", 1))],
                  max_new_tokens=32_767, max_seq_len=40_000)
    with running_worker(settings, concurrency=2):
        wait_settled(store, ["toolong"])
    prompt = store.prompt("toolong", "toolong-0")
    assert prompt is not None and prompt.state == "failed" and prompt.attempts == 1
    assert len(sim_log(sim)) == 1
    with store.engine.connect() as conn:
        error = conn.exec_driver_sql("SELECT error FROM prompts").scalar()
    assert "HTTP 400" in error and "maximum context length" in error
    assert_invariants(store, ledger, ["toolong"])


def test_a_5xx_is_retried_then_succeeds(
    settings: Settings, store: Store, ledger: Ledger, sim: str, tmp_path: Path
) -> None:
    requests.post(f"{sim}/sim/faults", json={"fail_next": 2, "error_status": 500},
                  timeout=5).raise_for_status()
    enqueue_paths(settings, [str(write_dataset(tmp_path, "flaky", 1))])
    with running_worker(settings, concurrency=2):
        wait_settled(store, ["flaky"])
    prompt = store.prompt("flaky", "flaky-0")
    assert prompt is not None and (prompt.state, prompt.attempts) == ("done", 2)
    assert [r["status"] for r in sim_log(sim)] == [500, 500, 200]
    assert_invariants(store, ledger, ["flaky"])


def test_retries_are_bounded_and_the_last_error_kept(
    settings: Settings, store: Store, ledger: Ledger, sim: str, tmp_path: Path
) -> None:
    requests.post(f"{sim}/sim/faults", json={"fail_next": 50, "error_status": 503},
                  timeout=5).raise_for_status()
    enqueue_paths(settings, [str(write_dataset(tmp_path, "down", 1))])
    with running_worker(settings, concurrency=2):
        wait_settled(store, ["down"])
    prompt = store.prompt("down", "down-0")
    assert prompt is not None and (prompt.state, prompt.attempts) == ("failed", 3)
    assert len(sim_log(sim)) == settings.max_attempts
    assert ledger.state("down").used_tokens == 0


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"text": "hi", "meta_info": {"completion_tokens": 2}}, "no output_ids"),
        ({"output_ids": [1, 2, 3], "meta_info": {"completion_tokens": 2}}, "0.5.4"),
    ],
)
def test_incompatible_servers_are_named(body: dict, needle: str) -> None:
    with pytest.raises(IncompatibleServer, match=needle) as err:
        parse_completion(body, "rid", "http://old:30000")
    assert "SGLang >= 0.5.5" in str(err.value)


def test_a_server_down_then_back_fails_nothing(
    sqlite_url: str, redis_client: object, tmp_path: Path
) -> None:
    from ops.localredis import free_port
    from sim import SimConfig, SimServer

    port = free_port()  # nothing listens here yet: connections are refused
    settings = make_settings(sqlite_url, f"http://127.0.0.1:{port}", max_attempts=2,
                             retry_base_s=0.2, retry_max_s=0.5)
    enqueue_paths(settings, [str(write_dataset(tmp_path, "outage", 6))])
    store = Store(settings.database_url)
    with running_worker(settings, concurrency=4):
        time.sleep(2.5)  # several refused tries per sample, more than max_attempts
        assert store.prompt_counts("outage") == {"queued": 6}
        with SimServer(SimConfig(port=port, decode_tok_per_s=0)):
            wait_settled(store, ["outage"], timeout_s=30)
    assert store.prompt_counts("outage") == {"done": 6}


def test_prompts_redis_lost_are_found_and_enqueued_again(
    settings: Settings, store: Store, ledger: Ledger, sim: str, tmp_path: Path
) -> None:
    from common.audit import queued_in_redis, requeue_lost
    from common.keys import dataset_keys

    path = str(write_dataset(tmp_path, "lost", 8))
    enqueue_paths(settings, [path])
    client = ledger.redis
    assert queued_in_redis(client, "lost") == {f"lost-{i}" for i in range(8)}
    client.delete(*dataset_keys("lost").queue_lists)  # Redis loses the messages, SQL does not
    assert queued_in_redis(client, "lost") == set()
    publisher = Publisher(make_celery(settings))
    assert requeue_lost(store, client, publisher, quiet_for_s=3600) == {}  # too recent
    assert requeue_lost(store, client, publisher, quiet_for_s=0) == {"lost": 8}
    assert len(queued_in_redis(client, "lost")) == 8
    again = enqueue_paths(settings, [path])[0]  # a re-run finds them queued now
    assert (again.enqueued, again.already_queued) == (0, 8)
    with running_worker(settings, concurrency=4):
        wait_settled(store, ["lost"])
    assert_invariants(store, ledger, ["lost"])
    assert store.prompt_counts("lost") == {"done": 8}


def test_a_prompt_settled_while_the_sweep_looks_is_not_taken_for_lost(
    settings: Settings, store: Store, ledger: Ledger, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sweep reads what Redis holds and what SQL holds as queued, one after the other.
    A task that ends in between (its prompt marked done, then its message acked) must be
    found in one or the other: it is not lost, and publishing it again would only make a
    duplicate (and a false warning that Redis lost prompts)."""
    from common import audit
    from common.keys import dataset_keys

    enqueue_paths(settings, [str(write_dataset(tmp_path, "race", 1))])
    client = ledger.redis
    assert audit.queued_in_redis(client, "race") == {"race-0"}
    settled: list[str] = []

    def settle() -> None:  # the task ends, once, right after the sweep's first read
        if not settled:
            store.set_prompt_states("race", ["race-0"], "done")
            client.delete(*dataset_keys("race").queue_lists)
            settled.append("race-0")

    read_sql, read_redis = store.sample_ids, audit.queued_in_redis

    def sql_then_settle(*args: Any, **kwargs: Any) -> list[str]:
        ids = read_sql(*args, **kwargs)
        settle()
        return ids

    def redis_then_settle(*args: Any, **kwargs: Any) -> set[str]:
        held = read_redis(*args, **kwargs)
        settle()
        return held

    monkeypatch.setattr(store, "sample_ids", sql_then_settle)
    monkeypatch.setattr(audit, "queued_in_redis", redis_then_settle)
    publisher = Publisher(make_celery(settings))
    assert audit.requeue_lost(store, client, publisher, quiet_for_s=0) == {}
    assert settled == ["race-0"]
    assert read_redis(client, "race") == set()  # nothing published again
    assert store.prompt_counts("race") == {"done": 1}


def test_a_message_taken_by_a_worker_that_died_before_recording_it_is_swept_back(
    settings: Settings, store: Store, ledger: Ledger, sim: str, tmp_path: Path
) -> None:
    """kombu's BRPOP takes a message and records it as unacked in a second round trip: a
    worker killed in between leaves it nowhere in Redis, for neither the reaper nor the
    visibility timeout. The workers' own SQL sweep publishes it again, and every prompt is
    done once."""
    from common.audit import queued_in_redis
    from common.keys import dataset_keys
    from workers.liveness import Heartbeat

    enqueue_paths(settings, [str(write_dataset(tmp_path, "gap", 6))])
    client = ledger.redis
    for _ in range(2):  # what the dead worker's BRPOPs took
        assert client.rpop(dataset_keys("gap").prompts) is not None
    assert len(queued_in_redis(client, "gap")) == 4
    with running_worker(settings, concurrency=4) as app:
        # What the worker's ready signal starts under `celery worker` (workers/app.py).
        received = app.datagen_received  # type: ignore[attr-defined]
        beat = Heartbeat(app, client, "sweeper@test", received, 0.5, 5.0, sweep_s=1.0,
                         sweep_quiet_s=0.0)
        beat.start()
        try:
            wait_settled(store, ["gap"], timeout_s=30)
        finally:
            beat.stop()
    assert store.prompt_counts("gap") == {"done": 6}
    assert_invariants(store, ledger, ["gap"])
    done = [e for e in sim_log(sim) if e.get("status") == 200]
    assert len(done) == 6, done  # the four still queued ran once, the two swept back once


def test_a_retry_redis_never_takes_is_given_up_after_its_window(
    sqlite_url: str, sim: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A task holds its message while its retry cannot be sent, but only for its window:
    then Celery's reject goes on, so a Redis that never comes back cannot hold a worker's
    slots for good."""
    settings = make_settings(sqlite_url, sim, redis_url=f"redis://127.0.0.1:{free_port()}/0")
    task = register_tasks(make_celery(settings), settings)
    task.push_request(called_directly=False, id="away-1", args=["away", "s1"], kwargs={},
                      retries=0, delivery_info={"exchange": "", "routing_key": "datagen.q.away"})
    started = time.monotonic()
    try:
        with caplog.at_level("WARNING", logger="workers.pipeline"), \
                pytest.raises(Reject) as rejected:
            send_retry(task, countdown=1.0, window_s=1.0)
    finally:
        task.pop_request()
    assert rejected.value.requeue is False
    assert isinstance(rejected.value.reason, OperationalError)
    # It tried again until its window ran out, then let the reject through.
    assert "could not send the retry of away-1" in caplog.text
    assert time.monotonic() - started >= 1.0


def test_a_worker_starting_on_prompts_without_statistics_gathers_them(
    settings: Settings, store: Store
) -> None:
    store.insert_prompts([NewPrompt(dataset="ds", sample_id=f"s{i}", state="queued",
                                    messages=[{"role": "user", "content": "hi"}],
                                    input_ids=[1, 2], prompt_tokens=2, max_new_tokens=8,
                                    source=None) for i in range(20)])
    prepare(create_app(settings))
    # Gathered by the start (PostgreSQL), so there is nothing left to gather.
    assert store.ensure_statistics() is False
    if store.engine.dialect.name == "postgresql":
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM pg_stats "
                                        "WHERE tablename = 'prompts'").scalar()
