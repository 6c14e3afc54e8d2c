"""Group commit of results: many threads' rows in few transactions, each ``save`` returning
only once its own row is committed, duplicates reported, and one bad row or a database
error never settling another task's row wrongly."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from common.rows import NewPrompt, ResultRow
from common.schema import prompts, results
from common.store import Store
from workers.results import ResultWriter


def add_prompts(store: Store, n: int, dataset: str = "w") -> None:
    store.insert_prompts([NewPrompt(dataset=dataset, sample_id=f"s{i}", state="queued",
                                    messages=[], input_ids=[1, 2], prompt_tokens=2,
                                    max_new_tokens=8, source=None)
                          for i in range(n)])


def row(i: int, dataset: str = "w", **over: Any) -> ResultRow:
    return ResultRow(**{
        "dataset": dataset, "sample_id": f"s{i}", "rid": f"r{i}", "prompt_tokens": 2,
        "completion_tokens": 3, "cached_tokens": 0, "reasoning_tokens": 0,
        "finish_reason": "stop", "finish_detail": {"type": "stop"}, "output_ids": [7, 8, 9],
        "output_text": "abc", "e2e_latency_s": 0.1, "server": "http://s", "model": "m",
        **over})


def bare(i: int, rid: str = "") -> ResultRow:
    """A row that leaves the optional fields to their defaults."""
    return ResultRow(dataset="w", sample_id=f"s{i}", rid=rid or f"r{i}", prompt_tokens=2,
                     completion_tokens=3, finish_reason="stop", output_ids=[7, 8, 9],
                     output_text="abc", server="http://s", model="m")


def stored(store: Store) -> dict[str, Any]:
    with store.engine.connect() as conn:
        n = conn.scalar(sa.select(sa.func.count()).select_from(results))
        states: dict[str, int] = dict(conn.execute(sa.select(prompts.c.state, sa.func.count())
                                   .group_by(prompts.c.state)).all())
    return {"results": n, "states": states}


def held_commits(store: Store) -> threading.Event:
    """Commits of ``store`` wait for the returned event, so rows queue up behind the first."""
    release = threading.Event()
    real = store.save_results

    def held(rows: Any) -> Any:
        release.wait(5)
        return real(rows)

    store.save_results = held  # type: ignore[method-assign]
    return release


def test_many_threads_commit_in_groups_and_each_sees_its_own_outcome(db_url: str) -> None:
    store = Store(db_url)
    add_prompts(store, 300)
    writer = ResultWriter(store, max_group=16)
    commits = []
    real = store.save_results

    def counting(rows: Any) -> Any:
        commits.append(len(rows))
        return real(rows)

    store.save_results = counting  # type: ignore[method-assign]
    # Every sample twice (a redelivery racing the original): one insert, one duplicate.
    with ThreadPoolExecutor(64) as pool:
        outcomes = list(pool.map(lambda i: (i % 300, writer.save(row(i % 300))), range(600)))
    inserted = [i for i, ok in outcomes if ok]
    assert sorted(inserted) == list(range(300))
    assert stored(store) == {"results": 300, "states": {"done": 300}}
    assert sum(commits) == 600 and max(commits) <= 16
    assert len(commits) < 600  # rows did share transactions


def test_save_returns_after_the_commit_is_visible(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    add_prompts(store, 50)
    writer = ResultWriter(store)

    def save_then_look(i: int) -> bool:
        writer.save(row(i))
        return store.has_result("w", f"s{i}")

    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(save_then_look, range(50)))


def test_one_bad_row_fails_only_its_own_task(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    add_prompts(store, 8)
    writer = ResultWriter(store)
    release = held_commits(store)

    def save(i: int) -> Any:
        try:
            # A NULL in a NOT NULL column: the database refuses this row alone.
            return writer.save(row(i, model=None) if i == 5 else row(i))
        except sa_exc.IntegrityError as exc:
            return exc

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(save, i) for i in range(8)]
        threading.Timer(0.3, release.set).start()
        outcomes = [f.result(30) for f in futures]
    assert isinstance(outcomes[5], sa_exc.IntegrityError)
    assert [o for i, o in enumerate(outcomes) if i != 5] == [True] * 7
    assert stored(store) == {"results": 7, "states": {"done": 7, "queued": 1}}


def test_a_database_error_reaches_every_task_of_the_group(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    add_prompts(store, 4)
    writer = ResultWriter(store)

    def down(rows: Any) -> Any:
        raise sa_exc.OperationalError("INSERT", {}, Exception("database is away"))

    store.save_results = down  # type: ignore[method-assign]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(writer.save, row(i)) for i in range(4)]
        for f in futures:
            with pytest.raises(sa_exc.OperationalError):
                f.result(10)
    del store.save_results  # the database is back: the retried saves go through
    assert [writer.save(row(i)) for i in range(4)] == [True] * 4
    assert stored(store) == {"results": 4, "states": {"done": 4}}


def test_two_deliveries_of_a_sample_in_one_group_store_one_and_say_so(db_url: str) -> None:
    store = Store(db_url)
    add_prompts(store, 2)
    writer = ResultWriter(store)
    release = held_commits(store)
    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(writer.save, row(0))
        threading.Event().wait(0.2)
        racing = [pool.submit(writer.save, row(1, rid=f"r1-{k}")) for k in range(4)]
        threading.Timer(0.3, release.set).start()
        assert first.result(30) is True
        won = [k for k, f in enumerate(racing) if f.result(30)]
    assert len(won) == 1
    with store.engine.connect() as conn:
        rid = conn.scalar(sa.select(results.c.rid).where(results.c.sample_id == "s1"))
    assert rid == f"r1-{won[0]}"


def test_a_group_with_samples_stored_before_reports_only_the_new_ones(db_url: str) -> None:
    store = Store(db_url)
    add_prompts(store, 4)
    assert store.save_results([row(1, rid="first")]) == {("w", "s1")}
    # A row leaving its optional fields to their defaults is stored in the same group.
    bare3 = bare(3, rid="again")
    assert store.save_results([row(0), row(1, rid="again"), row(2), bare3]) == {
        ("w", "s0"), ("w", "s2"), ("w", "s3")}
    assert store.save_results([row(2, rid="third"), bare3]) == set()
    with store.engine.connect() as conn:
        rids = dict(conn.execute(sa.select(results.c.sample_id, results.c.rid)).all())
    assert rids == {"s0": "r0", "s1": "first", "s2": "r2", "s3": "again"}
    assert stored(store) == {"results": 4, "states": {"done": 4}}


def test_rows_read_back_as_a_plain_sqlalchemy_insert_writes_them(db_url: str) -> None:
    store = Store(db_url)
    add_prompts(store, 2)
    fast = row(0, finish_detail={"type": "length", "length": 3}, e2e_latency_s=None,
               output_text="é ✓ 'quoted'", output_ids=[0, 2**32 - 1, 17],
               sampling={"temperature": 0.7, "stop": ["é", "\n"]})
    core = dataclasses.asdict(fast) | {"sample_id": "s1"}
    assert store.save_results([fast]) == {("w", "s0")}
    with store.engine.begin() as conn:
        conn.execute(sa.insert(results), [core])
    with store.engine.connect() as conn:
        got = {r.sample_id: r._asdict() for r in conn.execute(sa.select(results))}
        prompt_rows = {r.sample_id: r for r in conn.execute(sa.select(prompts))}
    a, b = got["s0"], got["s1"]
    for name in ("id", "sample_id"):
        a.pop(name), b.pop(name)
    created_a, created_b = a.pop("created_at"), b.pop("created_at")
    assert a == b
    assert type(created_a) is type(created_b)
    assert abs((created_a - created_b).total_seconds()) < 60
    assert prompt_rows["s0"].state == "done" and prompt_rows["s0"].error is None
    assert type(prompt_rows["s0"].updated_at) is type(prompt_rows["s1"].updated_at)
    assert prompt_rows["s1"].state == "queued"
    # The JSON as the database holds it, not only as it reads back: the exports copy it.
    as_text = sa.select(results.c.sample_id, sa.cast(results.c.finish_detail, sa.Text),
                        sa.cast(results.c.sampling, sa.Text))
    with store.engine.connect() as conn:
        stored = {sid: (detail, sampling) for sid, detail, sampling in conn.execute(as_text)}
    assert stored["s0"] == stored["s1"]


def test_fields_a_row_leaves_out_are_stored_as_their_defaults(db_url: str) -> None:
    store = Store(db_url)
    add_prompts(store, 3)
    assert store.save_results([bare(0), row(1, cached_tokens=5)]) == {("w", "s0"), ("w", "s1")}
    with store.engine.connect() as conn:
        got = dict(conn.execute(sa.select(results.c.sample_id, results.c.cached_tokens)).all())
    assert got == {"s0": 0, "s1": 5}


def test_a_connection_serves_other_statements_after_a_failed_group(db_url: str) -> None:
    """A group's statements, failed or not, leave their pooled connection as the next
    statements expect it: back in the pool, in a transaction of its own."""
    store = Store(db_url)
    add_prompts(store, 3)
    assert store.prompts([("w", "s0")])[0] is not None
    assert store.save_results([row(0)]) == {("w", "s0")}
    with pytest.raises(sa_exc.IntegrityError):
        store.save_results([row(1, model=None)])  # NULL in a NOT NULL column
    # Other statements, on the same pooled connection.
    assert store.prompt_counts("w") == {"done": 1, "queued": 2}
    assert store.has_result("w", "s0") and not store.has_result("w", "s1")
    assert store.engine.pool.checkedin() == 1  # one connection served every statement
    if store.engine.dialect.name == "postgresql":
        # A connection left in autocommit would turn every later transaction on it into
        # separate commits.
        with store.engine.connect() as conn:
            assert conn.connection.driver_connection.autocommit is False  # type: ignore[union-attr]
