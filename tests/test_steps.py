"""The steps tasks take together (workers/steps.py): a sample's prompt read with its
admission, and its charge with its store, each done for a group of concurrent tasks. Each
sample is still charged once and stored once; a database outage at the commit keeps the
charge and stores the row once the database is back; one bad row fails only its sample."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from common.ledger import Ledger
from common.settings import Settings
from common.store import Store
from tests.helpers import assert_invariants, enqueue_paths
from tests.test_pipeline_e2e import write_dataset
from workers import steps
from workers.context import WorkerContext
from workers.pipeline import Outcome, run_sample


def context_for(settings: Settings, tmp_path: Path, name: str, n: int) -> WorkerContext:
    """A worker's context (no Celery) over a new dataset of ``n`` prompts."""
    enqueue_paths(settings, [str(write_dataset(tmp_path, name, n))])
    return WorkerContext.build(settings)


def run_all(ctx: WorkerContext, name: str, n: int) -> list[Any]:
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


def test_a_group_of_every_task_the_worker_runs_does_not_wait_for_more(
    settings: Settings, store: Store, tmp_path: Path
) -> None:
    # Four threads in a worker of concurrency 4: once all four have joined a step, nobody
    # else can, so its leader goes on at once instead of waiting out its linger.
    ctx = context_for(settings.replace(concurrency=4), tmp_path, "full", 4)
    ctx.admissions.linger_s = ctx.settlements.linger_s = 30.0
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(run_sample, ctx, "full", f"full-{i}") for i in range(4)]
        assert [f.result(timeout=15) for f in futures] == [Outcome.DONE] * 4
    assert (ctx.admissions.batches, ctx.settlements.batches) == (1, 1)
    assert store.prompt_counts("full") == {"done": 4}


def test_a_database_outage_at_the_commit_keeps_the_charge(
    settings: Settings, store: Store, ledger: Ledger, sim: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = context_for(settings, tmp_path, "outage", 8)
    real, failures = ctx.store.save_results, [2]

    def flaky(rows: Any) -> Any:
        if failures[0]:
            failures[0] -= 1
            raise OperationalError("INSERT", {}, Exception("server closed the connection"))
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

    def row(ctx: WorkerContext, ds: Any, sample_id: str, *rest: Any) -> Any:
        if sample_id == "onebad-3":
            raise ValueError("cannot build this row")
        return real(ctx, ds, sample_id, *rest)

    monkeypatch.setattr(steps, "result_row", row)
    outcomes = run_all(ctx, "onebad", 8)
    assert [str(o) for o in outcomes if isinstance(o, Exception)] == ["cannot build this row"]
    assert outcomes.count(Outcome.DONE) == 7
    assert store.prompt_counts("onebad") == {"done": 7, "queued": 1}
