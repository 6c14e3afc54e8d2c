"""Start-up in any order: a worker started before Redis or the database waits for them with
one line per service, and once they answer it rebuilds what Redis lost and drains every
dataset's queue by itself, with no ``datagen enqueue`` re-run and no wait for the sweep
(Settings.sweep_s, 5 minutes, is left at its default in each test). A Redis that restarts
empty under a running worker is rebuilt the same way."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import redis

from common.audit import queued_in_redis
from common.celery_app import make_celery
from common.errors import ServiceUnavailable
from common.keys import REBUILT, dataset_keys
from common.ledger import Ledger
from common.publish import Publisher
from common.settings import Settings
from common.store import Store
from ops.localredis import free_port
from tests.conftest import make_settings
from tests.faultkit import PrivateRedis, Sim, Workers, wait_for
from tests.faultkit_pg import PrivatePostgres
from tests.helpers import assert_invariants, enqueue_paths, wait_settled, write_dataset
from workers.recovery import rebuild_if_lost
from workers.startup import wait_for_services

DRAIN_S = 60.0
PACED = {"decode_tok_per_s": 200, "mean_output_tokens": 60, "max_running_requests": 64}


def _waited_in_one_line_each(text: str, needle: str) -> None:
    assert needle in text, text[-3000:]
    assert "Traceback" not in text, text[-6000:]
    assert "raised:" not in text, text[-6000:]  # Celery's "Signal handler ... raised"


def test_a_worker_started_before_an_empty_redis_drains_what_sql_holds_queued(
    sqlite_url: str, sim: str, tmp_path: Path
) -> None:
    server = PrivateRedis()
    settings = make_settings(sqlite_url, sim, redis_url=server.url)
    store = Store(settings.database_url)
    try:
        server.start()
        enqueue_paths(settings, [str(write_dataset(tmp_path, "early", 12))])
        server.crash()  # no persistence: the queue, the ledger and the pairing are gone
        with Workers(settings, tmp_path / "worker.log") as workers:
            proc = workers.start("first", 4)
            needle = f"waiting for Redis at {server.url}: connection refused"
            wait_for(lambda: needle in workers.text(), 30, "the worker to wait for Redis")
            assert proc.poll() is None  # waiting, not gone
            server.start()  # empty; nothing is enqueued again
            wait_settled(store, ["early"], timeout_s=DRAIN_S, client=server.client(),
                         log=workers.log)
            text = workers.text()
    finally:
        server.close()
    _waited_in_one_line_each(text, needle)
    assert f"Redis at {server.url} answers" in text
    assert "early: 12 queued prompts enqueued again" in text
    assert store.prompt_counts("early") == {"done": 12}


def test_a_worker_started_before_its_database_drains_once_it_answers(
    redis_client: redis.Redis, sim: str, tmp_path: Path
) -> None:
    with PrivatePostgres() as pg:
        settings = make_settings(pg.url, sim)
        store = Store(settings.database_url)
        enqueue_paths(settings, [str(write_dataset(tmp_path, "dbfirst", 8))])
        store.engine.dispose()
        pg.stop()
        with Workers(settings, tmp_path / "worker.log") as workers:
            proc = workers.start("first", 4)
            needle = f"waiting for the database at {pg.url}: connection refused"
            wait_for(lambda: needle in workers.text(), 30, "the worker to wait for the database")
            assert proc.poll() is None
            pg.start()
            wait_settled(store, ["dbfirst"], timeout_s=DRAIN_S)
            text = workers.text()
        assert store.prompt_counts("dbfirst") == {"done": 8}
        store.engine.dispose()
    _waited_in_one_line_each(text, needle)
    assert f"the database at {pg.url} answers" in text


def test_redis_restarted_empty_under_a_running_worker_is_rebuilt_at_once(
    sqlite_url: str, tmp_path: Path
) -> None:
    with PrivateRedis() as server, Sim(tmp_path / "sim.jsonl", **PACED) as sim:
        settings = make_settings(sqlite_url, sim.url, redis_url=server.url, heartbeat_s=1.0,
                                 dead_after_s=5.0)
        store = Store(settings.database_url)
        enqueue_paths(settings, [str(write_dataset(tmp_path, "midrun", 60))])
        with Workers(settings, tmp_path / "worker.log") as workers:
            workers.start("w", 4)
            wait_for(lambda: store.prompt_counts("midrun").get("done", 0) >= 8, 60,
                     "some prompts done")
            server.restart_empty()
            assert store.prompt_counts("midrun").get("queued", 0) > 0
            wait_for(lambda: server.client().exists(REBUILT), 30, "the worker to rebuild")
            workers.revive()  # a supervisor's restart, should the reconnect end the worker
            wait_settled(store, ["midrun"], timeout_s=DRAIN_S, client=server.client(),
                         log=workers.log)
            text = workers.text()
        assert "Redis had lost its data: ledgers rebuilt from SQL" in text
        assert store.prompt_counts("midrun") == {"done": 60}
        # The ledger counts every stored result once: those from before the loss
        # were charged again from SQL, the others as they came.
        assert_invariants(store, Ledger(server.client()), ["midrun"])


def test_a_redis_that_kept_its_data_is_not_rebuilt(
    settings: Settings, store: Store, ledger: Ledger, tmp_path: Path
) -> None:
    enqueue_paths(settings, [str(write_dataset(tmp_path, "kept", 5))])
    client = ledger.redis
    publisher = Publisher(make_celery(settings))
    client.delete(*dataset_keys("kept").queue_lists)  # lost, but not the whole Redis
    client.set(REBUILT, "1")
    assert rebuild_if_lost(store, client, publisher) is None  # left to the sweep
    assert queued_in_redis(client, "kept") == set()
    client.delete(REBUILT)  # the whole Redis was lost: rebuilt at once, however recent
    assert rebuild_if_lost(store, client, publisher) == {"kept": 5}
    assert len(queued_in_redis(client, "kept")) == 5
    assert client.exists(REBUILT)
    assert rebuild_if_lost(store, client, publisher) is None  # once


def test_the_wait_says_one_line_per_service_and_gives_up_naming_the_setting(
    sqlite_url: str, sim: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    settings = make_settings(sqlite_url, sim, redis_url=url, start_wait_s=1.0)
    with caplog.at_level("WARNING", logger="datagen.worker"), \
            pytest.raises(ServiceUnavailable) as gone:
        wait_for_services(settings, poll_s=0.1, note_every_s=30.0)
    # The wait's own lines: a worker an earlier test ran in this process may have left its
    # SGLang watch thread behind, logging to the same logger.
    lines = [r.getMessage() for r in caplog.records if r.thread == threading.get_ident()]
    safe = url.replace("s3cret", "***")
    assert lines == [f"waiting for Redis at {safe}: connection refused"]  # not one a poll
    assert "did not answer within 1 s (connection refused)" in str(gone.value)
    assert "DATAGEN_REDIS_URL" in str(gone.value) and "s3cret" not in str(gone.value)
