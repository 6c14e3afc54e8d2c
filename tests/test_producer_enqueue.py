"""The producer's pipelined enqueue: exact counts over many chunks and datasets, resume
after lost messages, skips, closed datasets, and errors raised from the writer thread."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from common.budget import Budget
from common.celery_app import make_celery
from common.errors import ServiceUnavailable
from common.keys import dataset_keys
from common.ledger import Ledger
from common.messages import sample_of
from common.publish import Publisher
from common.rows import ResultRow
from common.settings import Settings
from common.store import Store
from producer import enqueue as enqueue_module
from producer.enqueue import Enqueuer, Limits
from producer.plan import plans_from_paths
from producer.template import BUNDLED_TOKENIZER, ChatTemplater
from tests.conftest import _fresh_postgres, make_settings


@pytest.fixture
def settings(sqlite_url: str, redis_client: redis.Redis) -> Settings:
    return make_settings(sqlite_url, "http://127.0.0.1:9")


@pytest.fixture(scope="module")
def templater() -> ChatTemplater:
    return ChatTemplater(str(BUNDLED_TOKENIZER))


def _write(folder: Path, name: str, n: int, long_every: int = 0) -> Path:
    path = folder / f"{name}.jsonl"
    with path.open("w") as fh:
        for i in range(n):
            words = 400 if long_every and i % long_every == 0 else 6
            text = " ".join(f"{name}{i}w{k}" for k in range(words))
            fh.write(json.dumps({"id": f"{name}-{i}", "messages": [
                {"role": "user", "content": text}]}) + "\n")
    return path


def _run(settings: Settings, templater: ChatTemplater, paths: list[Path],
         max_seq_len: int = 4096, budget: Budget | None = None,
         progress: list[int] | None = None,
         in_child: bool = True) -> dict[str, enqueue_module.DatasetSummary]:
    plans = plans_from_paths([str(p) for p in paths], budget or Budget(), {}, 256)
    enqueuer = Enqueuer(Store(settings.database_url),
                        Ledger(redis.Redis.from_url(settings.redis_url)),
                        make_celery(settings), templater, Limits(max_seq_len),
                        progress=None if progress is None else progress.append,
                        publish_in_child=in_child)
    return {s.name: s for s in enqueuer.run(plans)}


def _messages(client: redis.Redis, name: str) -> Counter[str]:
    seen: Counter[str] = Counter()
    for key in dataset_keys(name).queue_lists:
        for raw in client.lrange(key, 0, -1):
            sample = sample_of(json.loads(raw))
            assert sample is not None and sample[0] == name
            seen[sample[1]] += 1
    return seen


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Many chunks per dataset, so the pipeline has several in flight at once.
    monkeypatch.setattr(enqueue_module, "CHUNK", 37)


def test_many_chunks_over_datasets_store_and_publish_each_prompt_once(
    settings: Settings, templater: ChatTemplater, redis_client: redis.Redis, tmp_path: Path
) -> None:
    sizes = {"a": 300, "b": 37, "c": 1, "d": 150}
    progress: list[int] = []
    out = _run(settings, templater, [_write(tmp_path, n, k) for n, k in sizes.items()],
               progress=progress)
    store = Store(settings.database_url)
    for name, n in sizes.items():
        assert (out[name].read, out[name].enqueued, out[name].skipped) == (n, n, 0)
        assert _messages(redis_client, name) == Counter({f"{name}-{i}": 1 for i in range(n)})
        assert store.prompt_counts(name) == {"queued": n}
        first = store.prompt(name, f"{name}-0")
        assert first is not None
        assert first.input_ids == templater.encode_batch(
            [[{"role": "user", "content": " ".join(f"{name}0w{k}" for k in range(6))}]])[0]
    assert sum(progress) == sum(sizes.values())


def test_rerun_sends_nothing_twice_and_resends_what_redis_lost(
    settings: Settings, templater: ChatTemplater, redis_client: redis.Redis, tmp_path: Path
) -> None:
    path = _write(tmp_path, "again", 120)
    _run(settings, templater, [path])
    again = _run(settings, templater, [path])["again"]
    assert (again.enqueued, again.already_queued) == (0, 120)
    lost = [f"again-{i}" for i in range(0, 120, 3)]
    for key in dataset_keys("again").queue_lists:
        kept = [raw for raw in redis_client.lrange(key, 0, -1)
                if (sample_of(json.loads(raw)) or ("", ""))[1] not in lost]
        redis_client.delete(key)
        if kept:
            redis_client.rpush(key, *kept)
    third = _run(settings, templater, [path])["again"]
    assert (third.enqueued, third.already_queued) == (len(lost), 120 - len(lost))
    assert _messages(redis_client, "again") == Counter({f"again-{i}": 1 for i in range(120)})


def test_prompts_too_long_are_stored_skipped_and_not_sent(
    settings: Settings, templater: ChatTemplater, redis_client: redis.Redis, tmp_path: Path
) -> None:
    path = _write(tmp_path, "long", 100, long_every=10)
    first = _run(settings, templater, [path], max_seq_len=1000)["long"]
    assert (first.enqueued, first.skipped) == (90, 10)
    assert set(_messages(redis_client, "long")) == {f"long-{i}" for i in range(100) if i % 10}
    store = Store(settings.database_url)
    assert store.prompt_counts("long") == {"queued": 90, "skipped": 10}
    again = _run(settings, templater, [path], max_seq_len=1000)["long"]
    assert (again.enqueued, again.skipped, again.already_queued) == (0, 10, 90)


def test_a_closed_dataset_is_stored_but_not_sent(
    settings: Settings, templater: ChatTemplater, redis_client: redis.Redis, tmp_path: Path
) -> None:
    _run(settings, templater, [_write(tmp_path, "shut", 80)])
    Ledger(redis_client).close("shut", "manual")
    out = _run(settings, templater, [_write(tmp_path, "shut", 120)])["shut"]
    assert out.closed and out.enqueued == 0
    assert not _messages(redis_client, "shut")
    assert Store(settings.database_url).prompt_counts("shut") == {"queued": 120}


def test_a_failed_publish_stops_the_run_and_the_rerun_completes_it(
    settings: Settings, templater: ChatTemplater, redis_client: redis.Redis, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = _write(tmp_path, "flaky", 200)
    calls = Counter[str]()
    real = Publisher.publish

    def publish_then_fail(self: Publisher, dataset: str, stamp: str,
                          ids: list[str], ahead: bool = False) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise redis.ConnectionError("Redis went away")
        real(self, dataset, stamp, ids, ahead)

    # Changed in this process only, so the publishing stays in a thread of it.
    monkeypatch.setattr(Publisher, "publish", publish_then_fail)
    with pytest.raises(redis.ConnectionError):
        _run(settings, templater, [path], in_child=False)
    sent = _messages(redis_client, "flaky")
    assert len(sent) == 2 * 37 and max(sent.values()) == 1
    monkeypatch.setattr(Publisher, "publish", real)
    rerun = _run(settings, templater, [path])["flaky"]
    assert rerun.enqueued + rerun.already_queued == 200
    assert _messages(redis_client, "flaky") == Counter({f"flaky-{i}": 1 for i in range(200)})


def test_a_flush_failed_mid_chunk_is_resent_from_sql_not_replayed(
    settings: Settings, templater: ChatTemplater, redis_client: redis.Redis, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A pipeline is not a transaction: the third chunk's connection drops after Redis took
    # a part of it, and kombu cannot tell which part.
    path = _write(tmp_path, "torn", 200)
    flushes = Counter[str]()
    real = redis.client.Pipeline.execute

    def tear_the_third(self: redis.client.Pipeline, raise_on_error: bool = True) -> Any:
        if any(args[0] == "LPUSH" for args, _ in self.command_stack):
            flushes["n"] += 1
            if flushes["n"] == 3:
                del self.command_stack[10:]
                real(self, raise_on_error)
                raise redis.ConnectionError("Connection closed by server.")
        return real(self, raise_on_error)

    monkeypatch.setattr(redis.client.Pipeline, "execute", tear_the_third)
    with pytest.raises(ServiceUnavailable, match="datagen enqueue"):
        _run(settings, templater, [path], in_child=False)
    sent = _messages(redis_client, "torn")
    assert len(sent) == 2 * 37 + 10 and max(sent.values()) == 1
    monkeypatch.setattr(redis.client.Pipeline, "execute", real)
    rerun = _run(settings, templater, [path])["torn"]
    assert (rerun.already_queued, rerun.enqueued) == (2 * 37 + 10, 200 - 2 * 37 - 10)
    assert _messages(redis_client, "torn") == Counter({f"torn-{i}": 1 for i in range(200)})


def test_after_a_load_postgresql_finds_a_group_of_one_dataset_by_its_primary_key(
    redis_client: redis.Redis, templater: ChatTemplater, tmp_path: Path
) -> None:
    # Without statistics (a fresh load, autovacuum not yet by or off), the planner read such
    # a group through the (dataset, state) index: every row of the dataset, for each group.
    # 20,000 prompts: on a few thousand, a hash join over the whole table is the planner's
    # cheaper way to the 32 rows of a group's one-statement commit, statistics or not.
    settings = make_settings(_fresh_postgres(), "http://127.0.0.1:9")
    _run(settings, templater, [_write(tmp_path, "one", 20000)])
    store = Store(settings.database_url)
    keys = [("one", f"one-{i}") for i in range(0, 20000, 640)]
    sent: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        # The commit's UPDATE is a CTE of one statement on PostgreSQL (WITH ...).
        if statement.lstrip().startswith(("SELECT", "UPDATE", "WITH")):
            sent.append((statement, params))

    # The statements a worker's group sends, as the store sends them: its read and the
    # UPDATE of its commit.
    sa.event.listen(store.engine, "before_cursor_execute", record)
    assert all(store.prompts(keys))
    store.save_results([ResultRow(dataset=d, sample_id=sid, rid=sid, prompt_tokens=1,
                                  completion_tokens=1, finish_reason="stop", output_ids=[1],
                                  output_text="x", server="s", model="m") for d, sid in keys])
    sa.event.remove(store.engine, "before_cursor_execute", record)
    assert len(sent) == 2
    with store.engine.connect() as conn:
        for statement, params in sent:
            plan = "\n".join(conn.exec_driver_sql("EXPLAIN " + statement, params).scalars())
            assert "prompts_pkey" in plan, plan
            assert "ix_prompts_dataset_state" not in plan, plan


def test_a_rerun_does_not_take_a_prompt_settled_meanwhile_for_lost(
    settings: Settings, templater: ChatTemplater, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A re-run reads what Redis holds and the prompts' states in SQL, one after the
    other; a task that ends in between (done in SQL, then its message acked) is counted
    done, not published again as a message Redis lost."""
    path = _write(tmp_path, "rerun", 1)
    _run(settings, templater, [path])
    client = redis.Redis.from_url(settings.redis_url)
    settled: list[str] = []

    def settle() -> None:  # the task ends, once, right after the re-run's first read
        if not settled:
            Store(settings.database_url).set_prompt_states("rerun", ["rerun-0"], "done")
            client.delete(*dataset_keys("rerun").queue_lists)
            settled.append("rerun-0")

    read_sql, read_redis = Store.prompt_states, enqueue_module.queued_in_redis

    def sql_then_settle(self: Store, dataset: str) -> dict[str, str]:
        states = read_sql(self, dataset)
        settle()
        return states

    def redis_then_settle(*args: Any) -> set[str]:
        held = read_redis(*args)
        settle()
        return held

    monkeypatch.setattr(Store, "prompt_states", sql_then_settle)
    monkeypatch.setattr(enqueue_module, "queued_in_redis", redis_then_settle)
    again = _run(settings, templater, [path])["rerun"]
    assert settled == ["rerun-0"]
    assert (again.enqueued, again.already_done, again.already_queued) == (0, 1, 0)
    assert _messages(client, "rerun") == Counter()  # nothing published again
