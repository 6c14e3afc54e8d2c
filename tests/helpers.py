"""Running a real worker, waiting for a run to settle, and the invariants every run keeps."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import redis
import sqlalchemy as sa
from celery import Celery, signals
from celery.contrib.testing.worker import start_worker

from common.budget import Budget
from common.celery_app import make_celery
from common.keys import KOMBU_UNACKED, KOMBU_UNACKED_INDEX, WORKERS, dataset_keys, worker_tags
from common.ledger import Ledger
from common.messages import sample_of
from common.replies import text, texts
from common.schema import prompt_inputs, prompts, results
from common.settings import Settings
from common.store import Store
from producer.enqueue import DatasetSummary, Enqueuer, Limits
from producer.plan import Draws, plans_from_paths
from producer.template import BUNDLED_TOKENIZER, ChatTemplater
from workers.app import create_app
from workers.context import WorkerContext

SETTLED = ("done", "failed", "skipped")


T = TypeVar("T")


def all_at_once(make: Callable[[], T], n: int) -> list[T]:
    """What ``make`` returns in each of n threads started together, as n processes starting
    at once would call it; the first failure, if any, is raised."""
    made: list[T] = []
    failures: list[BaseException] = []
    start = threading.Barrier(n)

    def one() -> None:
        start.wait()
        try:
            made.append(make())
        except BaseException as exc:  # raised below, in the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if failures:
        raise failures[0]
    assert len(made) == n, "a thread did not finish"
    return made


def write_dataset(folder: Path, name: str, n: int, start: int = 0) -> Path:
    """A JSONL dataset of ``n`` one-message chats, ids ``{name}-{i}`` from ``start``."""
    path = folder / f"{name}.jsonl"
    with path.open("w") as fh:
        for i in range(start, start + n):
            msgs = [{"role": "user", "content": f"{name} question number {i}: explain item {i}."}]
            fh.write(json.dumps({"id": f"{name}-{i}", "messages": msgs}) + "\n")
    return path


def context_for(settings: Settings, tmp_path: Path, name: str, n: int) -> WorkerContext:
    """A worker's context (no Celery) over a new dataset of ``n`` prompts."""
    enqueue_paths(settings, [str(write_dataset(tmp_path, name, n))])
    return WorkerContext.build(settings)


@contextmanager
def running_worker(settings: Settings, concurrency: int = 16) -> Iterator[Celery]:
    app = create_app(settings)
    worker = None
    try:
        with start_worker(app, pool="threads", concurrency=concurrency,
                          perform_ping_check=False, shutdown_timeout=30) as worker:
            yield app
    finally:
        # Celery's test worker ends by a cold shutdown, which neither waits for the tasks
        # its pool threads still run nor sends worker_shutdown (a real worker's process
        # ends there). A task that went on would find the ledger of a Redis that the test's
        # fixture flushed, rebuild it and pair it with this test's database, as would the
        # heartbeat thread; the next test using that Redis would then be refused.
        if worker is not None:
            _wait_for_tasks(worker)
            signals.worker_shutdown.send(sender=worker)


# Longest a stopped test worker's running tasks are waited for (a request's answer).
TASKS_WAIT_S = 30.0


def _wait_for_tasks(worker: Any) -> None:
    """Cancel the tasks a stopped worker's thread pool has not started and wait (up to
    ``TASKS_WAIT_S``) for those it runs."""
    executor = getattr(getattr(worker, "pool", None), "executor", None)
    if executor is None:  # not the threads pool
        return
    waiter = threading.Thread(target=executor.shutdown,
                              kwargs={"wait": True, "cancel_futures": True}, daemon=True)
    waiter.start()
    waiter.join(TASKS_WAIT_S)


def enqueue_paths(
    settings: Settings, paths: Sequence[str], budget: Budget | None = None,
    max_new_tokens: int = 512, max_seq_len: int = 4096, turns: str | None = "last",
    draws: Draws | None = None,
) -> list[DatasetSummary]:
    store = Store(settings.database_url)
    ledger = Ledger(_redis(settings))
    plans = plans_from_paths(list(paths), budget or Budget(), {"temperature": 1.0},
                             max_new_tokens, turns, draws=draws)
    templater = ChatTemplater(str(BUNDLED_TOKENIZER))
    enqueuer = Enqueuer(store, ledger, make_celery(settings), templater, Limits(max_seq_len))
    return enqueuer.run(plans)


def _redis(settings: Settings) -> redis.Redis:
    return redis.Redis.from_url(settings.redis_url)


def wait_settled(store: Store, datasets: Sequence[str], timeout_s: float = 60.0,
                 client: redis.Redis | None = None, log: Path | None = None) -> None:
    """Until no prompt of these datasets is still queued (closed datasets excepted).

    With ``client`` (and the workers' ``log``), a run that does not settle says where each
    stuck prompt's message is, so a rare failure in CI can be read from its output alone.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = 0
        for name in datasets:
            if store.dataset(name).state == "closed":
                continue
            left += store.prompt_counts(name).get("queued", 0)
        if left == 0:
            return
        time.sleep(0.2)
    where = "" if client is None else "\n" + where_stuck(store, client, datasets, log)
    raise AssertionError(f"run did not settle in {timeout_s}s: {left} prompts still queued{where}")


def where_stuck(store: Store, client: redis.Redis, datasets: Sequence[str],
                log: Path | None = None) -> str:
    """For each prompt still queued: its messages in the queues and the unacked hash (with
    the workers whose heartbeat holds them), and the worker log's lines naming it."""
    beats = {text(w): round(float(s), 1) for w, s in _scored(client, WORKERS)}
    lines = [f"now {time.time():.1f}; workers' last beats: {beats}"]
    holders: dict[str, list[str]] = {}
    for worker in texts(client.zrange(WORKERS, 0, -1)):
        for tag in texts(client.smembers(worker_tags(worker))):
            holders.setdefault(tag, []).append(worker)
    log_lines = log.read_text(errors="replace").splitlines() if log and log.exists() else []
    for name in datasets:
        for sample_id in store.sample_ids(name, "queued"):
            lines.append(f"{name}/{sample_id}:")
            for key in dataset_keys(name).queue_lists:
                for raw in client.lrange(key, 0, -1):
                    if sample_of(json.loads(raw)) == (name, sample_id):
                        lines.append(f"  queued in {key!r}")
            index = {text(t): float(s) for t, s in _scored(client, KOMBU_UNACKED_INDEX)}
            for tag, raw in client.hscan_iter(KOMBU_UNACKED):
                if sample_of(json.loads(raw)[0]) == (name, sample_id):
                    t = text(tag)
                    lines.append(f"  unacked {t} since {index.get(t)}, held by "
                                 f"{holders.get(t, [])}")
            lines += [f"  log: {line}" for line in log_lines if sample_id in line][-20:]
    return "\n".join(lines)


def _scored(client: redis.Redis, key: str) -> list[tuple[Any, Any]]:
    return list(client.zrange(key, 0, -1, withscores=True))  # type: ignore[arg-type]


def duplicate_results(store: Store) -> list[tuple[str, str, int]]:
    q = (
        sa.select(results.c.dataset, results.c.sample_id, sa.func.count())
        .group_by(results.c.dataset, results.c.sample_id)
        .having(sa.func.count() > 1)
    )
    with store.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(q)]  # type: ignore[misc]


def assert_invariants(store: Store, ledger: Ledger, datasets: Sequence[str]) -> None:
    """Every prompt settled once; results unique; Redis counters equal SQL sums."""
    assert duplicate_results(store) == []
    for name in datasets:
        ds = store.dataset(name)
        if ds.state != "closed":
            assert set(store.prompt_counts(name)) <= set(SETTLED), store.prompt_counts(name)
        assert ledger.state(name).used_tokens == store.used_tokens(name, ds.budget), name
        with store.engine.connect() as conn:
            done = conn.scalar(sa.select(sa.func.count()).where(
                prompts.c.dataset == name, prompts.c.state == "done"))
            kept = conn.scalar(sa.select(sa.func.count()).where(results.c.dataset == name))
        assert done == kept, (name, done, kept)


def turn_rows(store: Store, dataset: str) -> dict[str, list[Any]]:
    """A dataset's turns by conversation, in order: each turn's prompt, state and error, and
    its result's text and ids (None while it has none)."""
    q = (sa.select(prompt_inputs.c.conversation, prompt_inputs.c.turn, prompt_inputs.c.messages,
                   prompt_inputs.c.input_ids, prompts.c.state, prompts.c.error,
                   results.c.output_text, results.c.output_ids)
         .join(prompts, sa.and_(prompts.c.dataset == prompt_inputs.c.dataset,
                                prompts.c.sample_id == prompt_inputs.c.sample_id))
         .join(results, sa.and_(results.c.dataset == prompt_inputs.c.dataset,
                                results.c.sample_id == prompt_inputs.c.sample_id), isouter=True)
         .where(prompt_inputs.c.dataset == dataset)
         .order_by(prompt_inputs.c.conversation, prompt_inputs.c.turn))
    by: dict[str, list[Any]] = {}
    with store.engine.connect() as conn:
        for row in conn.execute(q):
            by.setdefault(row.conversation, []).append(row)
    return by


def history_with_own_answers(
    messages: Sequence[dict[str, Any]], turn: int,
    own: Callable[[int, dict[str, Any]], dict[str, Any]],
) -> list[dict[str, Any]]:
    """A reference for turn ``turn``'s prompt messages, built apart from datagen's code:
    the line's messages up to that turn's answer, its k-th answer (a run of assistant
    messages) replaced by ``own(k, first message of the run)``."""
    out: list[dict[str, Any]] = []
    seen, previous = 0, None
    for message in messages:
        if message["role"] == "assistant":
            if previous == "assistant":
                continue
            seen += 1
            if seen == turn:
                break
            out.append(own(seen, message))
        else:
            out.append(message)
        previous = message["role"]
    return out
