"""The steps tasks take together (workers/steps.py): a sample's prompt read with its
admission, and its charge with its store, each done for a group of concurrent tasks. Each
sample is still charged once and stored once; a database outage at the commit keeps the
charge and stores the row once the database is back; one bad row fails only its sample."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import exc as sa_exc
from sqlalchemy.exc import OperationalError

from common.budget import Budget
from common.ledger import Ledger
from common.settings import AUTO, Settings
from common.store import Store
from tests.helpers import assert_invariants, context_for, enqueue_paths, write_dataset
from workers import steps
from workers.context import DATASET_CACHE_S, DATASET_STALE_S, WorkerContext
from workers.pipeline import Outcome, run_sample


def run_all(ctx: WorkerContext, name: str, n: int) -> list[Any]:
    """Each sample as a task of its own."""
    def one(i: int) -> Any:
        try:
            return run_sample(ctx, name, f"{name}-{i}")
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_concurrent_samples_share_steps_and_each_is_counted_once(
    settings: Settings, store: Store, ledger: Ledger, sim: str, tmp_path: Path
) -> None:
    ctx = context_for(settings, tmp_path, "shared", 32)
    assert run_all(ctx, "shared", 32) == [Outcome.DONE] * 32
    assert ctx.admissions.items == ctx.settlements.items == 32
    assert ctx.admissions.batches < 32 and ctx.settlements.batches < 32
    # A second delivery of every message: nothing generated, charged or stored again.
    assert run_all(ctx, "shared", 32) == [Outcome.ALREADY_DONE] * 32
    assert store.prompt_counts("shared") == {"done": 32}
    assert_invariants(store, ledger, ["shared"])


def test_a_step_goes_on_once_half_the_workers_tasks_have_joined(
    settings: Settings, store: Store, tmp_path: Path
) -> None:
    # Two tasks in a worker of concurrency 4: with every slot busy the others would be in
    # the other step, so each step's leader goes on with these two instead of waiting out
    # its linger for them.
    ctx = context_for(settings.replace(concurrency=4), tmp_path, "half", 2)
    ctx.admissions.linger_s = ctx.settlements.linger_s = 30.0
    assert (ctx.admissions.enough, ctx.settlements.enough) == (2, 2)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run_sample, ctx, "half", f"half-{i}") for i in range(2)]
        assert [f.result(timeout=15) for f in futures] == [Outcome.DONE] * 2
    assert (ctx.admissions.batches, ctx.settlements.batches) == (1, 1)
    assert (ctx.admissions.items, ctx.settlements.items) == (2, 2)
    assert store.prompt_counts("half") == {"done": 2}


@pytest.mark.parametrize("error", [
    OperationalError("INSERT", {}, Exception("server closed the connection")),
    # The pool had no connection free in time: the database is slow, not the rows wrong.
    sa_exc.TimeoutError("QueuePool limit of size 4 overflow 0 reached, connection timed out"),
], ids=["closed", "no-connection"])
def test_a_database_outage_at_the_commit_keeps_the_charge(
    settings: Settings, store: Store, ledger: Ledger, sim: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    ctx = context_for(settings, tmp_path, "outage", 8)
    real, failures = ctx.store.save_results, [2]

    def flaky(rows: Any) -> Any:
        if failures[0]:
            failures[0] -= 1
            raise error
        return real(rows)

    monkeypatch.setattr(ctx.store, "save_results", flaky)
    monkeypatch.setattr("workers.pipeline.time.sleep", lambda s: None)
    assert run_all(ctx, "outage", 8) == [Outcome.DONE] * 8
    assert failures == [0]
    assert store.prompt_counts("outage") == {"done": 8}
    assert ledger.state("outage").samples == 8
    assert_invariants(store, ledger, ["outage"])


def test_a_row_that_cannot_be_built_fails_only_its_sample(
    settings: Settings, store: Store, sim: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = context_for(settings, tmp_path, "onebad", 8)
    real = steps.result_row

    def row(ds: Any, sample_id: str, *rest: Any, **named: Any) -> Any:
        if sample_id == "onebad-3":
            raise ValueError("cannot build this row")
        return real(ds, sample_id, *rest, **named)

    monkeypatch.setattr(steps, "result_row", row)
    outcomes = run_all(ctx, "onebad", 8)
    assert [str(o) for o in outcomes if isinstance(o, Exception)] == ["cannot build this row"]
    assert outcomes.count(Outcome.DONE) == 7
    assert store.prompt_counts("onebad") == {"done": 7, "queued": 1}


@pytest.mark.parametrize("away", ["database", "redis"])
def test_an_outage_at_the_crossing_still_records_the_close(
    settings: Settings, store: Store, ledger: Ledger, sim: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, away: str) -> None:
    """The crossing task is the only one that knows of the close: if it gave up on the SQL
    record, its retry would find its sample done and SQL would show the dataset open."""
    enqueue_paths(settings, [str(write_dataset(tmp_path, "cross", 3))],
                  budget=Budget(1, "output", "drain"))
    ctx = WorkerContext.build(settings)
    owner, name = (ctx.store, "record_close") if away == "database" else (ctx.ledger, "state")
    real, failures = getattr(owner, name), [2]

    def flaky(*args: Any) -> Any:
        if failures[0]:
            failures[0] -= 1
            if away == "redis":
                raise redis.ConnectionError("Connection refused")
            raise OperationalError("UPDATE", {}, Exception("server closed the connection"))
        return real(*args)

    monkeypatch.setattr(owner, name, flaky)
    monkeypatch.setattr("workers.pipeline.time.sleep", lambda s: None)
    assert run_sample(ctx, "cross", "cross-0") is Outcome.DONE
    assert failures == [0]
    assert store.dataset("cross").state == "closed"
    assert store.dataset("cross").close_reason == "budget"
    assert run_sample(ctx, "cross", "cross-1") is Outcome.CLOSED


def test_a_tasks_place_at_the_server_is_given_back_before_its_charge_and_store(
        settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under concurrency auto the place is the server's: once the answer is in, the next
    request may have it while this one is charged and stored."""
    ctx = context_for(settings.replace(concurrency=AUTO), tmp_path, "place", 1)
    assert ctx.gate is not None
    held_at_settle: list[int] = []
    settle = ctx.settlements

    def watched(item: Any) -> Any:
        held_at_settle.append(sum(ctx.gate.inflight().values()) if ctx.gate else -1)
        return settle(item)

    monkeypatch.setattr(ctx, "settlements", watched)
    assert run_sample(ctx, "place", "place-0") is Outcome.DONE
    assert held_at_settle == [0]


def test_expired_terms_are_read_again_by_one_task_while_the_others_go_on(
        settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At full rate many tasks find a dataset's cached terms expired at once: one reads
    them again, the others go on with the terms they have; a first read is waited for."""
    ctx = context_for(settings, tmp_path, "terms", 1)
    reads: list[Any] = []

    def slow_read(name: str) -> Any:
        time.sleep(0.3)  # long enough for every thread below to arrive meanwhile
        reads.append(Store.dataset(ctx.store, name))
        return reads[-1]

    monkeypatch.setattr(ctx.store, "dataset", slow_read)
    with ThreadPoolExecutor(8) as pool:
        first = list(pool.map(lambda _: ctx.dataset("terms"), range(8)))
    assert len(reads) == 1 and all(row is reads[0] for row in first)

    ctx._datasets["terms"] = (time.monotonic() - DATASET_CACHE_S - 1, reads[0])
    with ThreadPoolExecutor(8) as pool:
        later = list(pool.map(lambda _: ctx.dataset("terms"), range(8)))
    assert len(reads) == 2
    assert sum(row is reads[1] for row in later) == 1  # the one that read them again
    assert sum(row is reads[0] for row in later) == 7
    assert ctx.dataset("terms") is reads[1]

    # Terms older than DATASET_STALE_S are never used: every task waits for the new read,
    # so a command that changed them knows when the old ones are gone.
    ctx._datasets["terms"] = (time.monotonic() - DATASET_STALE_S - 1, reads[0])
    with ThreadPoolExecutor(8) as pool:
        waited = list(pool.map(lambda _: ctx.dataset("terms"), range(8)))
    assert len(reads) == 3 and all(row is reads[2] for row in waited)
