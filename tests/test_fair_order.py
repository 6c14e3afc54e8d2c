"""What a budget keeps is a uniform random subset: every path that publishes sends a
dataset's prompts in its seeded rank order. Real Redis, a real worker, the simulator,
SQLite and PostgreSQL.

The datasets are written sorted: the first half of the lines about topic ``a``, the
second half about ``b``. Kept in file order, a budget of 20% would hold no ``b`` at all.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from common.celery_app import make_celery
from common.failures import requeue_failed
from common.keys import dataset_keys
from common.ledger import Ledger
from common.messages import sample_of
from common.order import Order
from common.publish import Publisher
from common.schema import prompts, results
from common.settings import Settings
from common.store import Store
from ops.cli import main
from tests.conftest import _fresh_postgres
from tests.faultkit import wait_for
from tests.helpers import assert_invariants, running_worker
from tests.test_stop_retry import env as settings_in_env
from workers.recovery import rebuild_if_lost

# The simulator's mean output (tests/conftest.py); a budget of n × MEAN × 0.2 keeps ~20%.
MEAN = 60
# z of a two-sided 99% interval.
Z99 = 2.5758
# The fixture: the test's settings in the environment, for the command line.
env = settings_in_env


def write_sorted(folder: Path, name: str, n: int) -> Path:
    """``n`` prompts, the first half about topic a, the second about topic b."""
    path = folder / f"{name}.jsonl"
    with path.open("w") as fh:
        for i in range(n):
            topic = "a" if i < n // 2 else "b"
            msgs = [{"role": "user", "content": f"Topic {topic}, question {i}: explain it."}]
            fh.write(json.dumps({"id": f"{name}-{i:05d}", "messages": msgs}) + "\n")
    return path


def is_b(sample_id: str, n: int) -> bool:
    return int(sample_id.rsplit("-", 1)[1]) >= n // 2


def enqueue(path: Path, *flags: str) -> int:
    return main(["enqueue", str(path), "-q", "--max-new-tokens", "512", *flags])


def load(env: Settings, tmp_path: Path, name: str, n: int,
         *flags: str) -> tuple[Path, Store, list[str]]:
    """Write and enqueue a sorted dataset: its file, its store and its rank order."""
    path = write_sorted(tmp_path, name, n)
    assert enqueue(path, *flags) == 0
    store = Store(env.database_url)
    return path, store, rank_order(store, name)


def delivery_order(client: redis.Redis, name: str) -> list[str]:
    """The dataset's queued messages' sample ids in the order workers will take them
    (kombu pushes on the left and pops on the right)."""
    ids = []
    for key in dataset_keys(name).queue_lists:
        for raw in reversed(client.lrange(key, 0, -1)):
            sample = sample_of(json.loads(raw))
            assert sample is not None and sample[0] == name
            ids.append(sample[1])
    return ids


def rank_order(store: Store, name: str, state: str | None = None) -> list[str]:
    """The dataset's sample ids in rank order, as the README's SQL lists them."""
    q = sa.select(prompts.c.sample_id).where(prompts.c.dataset == name)
    if state is not None:
        q = q.where(prompts.c.state == state)
    with store.engine.connect() as conn:
        return list(conn.scalars(q.order_by(prompts.c.rank, prompts.c.sample_id)))


def kept(store: Store, name: str) -> set[str]:
    with store.engine.connect() as conn:
        return set(conn.scalars(sa.select(results.c.sample_id)
                                .where(results.c.dataset == name)))


def run_to_close(settings: Settings, name: str, concurrency: int) -> set[str]:
    """Run a worker until the dataset's budget closes it and its requests end."""
    store, ledger = Store(settings.database_url), Ledger(redis.Redis.from_url(settings.redis_url))
    with running_worker(settings, concurrency=concurrency):
        wait_for(lambda: store.dataset(name).state == "closed", 120, f"{name} closes")
        wait_for(lambda: ledger.state(name).inflight == 0, 60, f"{name}'s requests end")
    assert store.dataset(name).close_reason == "budget"
    assert_invariants(store, ledger, [name])
    return kept(store, name)


def assert_head(samples: set[str], ordered: list[str], concurrency: int) -> None:
    """``samples`` are the head of ``ordered`` but for its last few, and none lies far
    past it. Near the end of a budget some messages are reserved and not run at the close,
    and some wait for the budget's admission while the next ones are taken, so the last
    samples kept are spread over the next stretch of the queue."""
    slack = 4 * concurrency
    assert set(ordered[: len(samples) - slack]) <= samples
    places = sorted(ordered.index(s) for s in samples)
    assert places[-1] < 2 * len(samples) + slack, (len(samples), places[-slack:])


def assert_even_share(samples: set[str], n: int) -> None:
    """The share of topic b among ``samples`` is within the 99% interval of 0.5."""
    share = sum(is_b(s, n) for s in samples) / len(samples)
    half_width = Z99 * math.sqrt(0.25 / len(samples))
    assert abs(share - 0.5) <= half_width, (share, len(samples), half_width)


def test_a_budget_keeps_a_uniform_random_subset_of_a_sorted_dataset(
    env: Settings, redis_client: redis.Redis, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    n = 2000
    _, _, ordered = load(env, tmp_path, "sorted", n, "--budget-tokens", str(n * MEAN // 5))
    assert delivery_order(redis_client, "sorted") == ordered
    assert ordered == [sid for _, sid in Order("shuffle", 0).arrange(ordered, str)]
    capsys.readouterr()
    assert main(["plan", "--json", "--mean-tokens", str(MEAN)]) == 0
    [planned] = json.loads(capsys.readouterr().out)["datasets"]
    assert planned["kept_fraction"] == 0.2
    assert main(["status", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["datasets"]
    assert (row["order"], row["seed"]) == ("shuffle", 0)

    samples = run_to_close(env, "sorted", concurrency=16)
    assert n // 10 < len(samples) < n * 35 // 100
    assert_even_share(samples, n)
    assert_head(samples, ordered, concurrency=16)


def test_file_order_keeps_the_head_of_the_file(
    env: Settings, redis_client: redis.Redis, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    n = 1000
    path = write_sorted(tmp_path, "head", n)
    assert enqueue(path, "--order", "file", "--budget-tokens", str(n * MEAN // 5)) == 0
    in_file = [f"head-{i:05d}" for i in range(n)]
    store = Store(env.database_url)
    assert rank_order(store, "head") == in_file == delivery_order(redis_client, "head")
    samples = run_to_close(env, "head", concurrency=16)
    assert_head(samples, in_file, concurrency=16)
    assert not any(is_b(s, n) for s in samples)
    capsys.readouterr()
    assert main(["status", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["datasets"]
    assert (row["order"], row["seed"]) == ("file", None)


def _fresh(settings: Settings, tmp_path: Path, tag: str) -> Settings:
    if settings.database_url.startswith("sqlite"):
        return settings.replace(database_url=f"sqlite:///{tmp_path / tag}.db")
    return settings.replace(database_url=_fresh_postgres())


def test_the_same_seed_on_a_fresh_database_keeps_the_same_ids(
    env: Settings, redis_client: redis.Redis, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    n = 300
    path = write_sorted(tmp_path, "again", n)
    runs = []
    for tag in ("first", "second"):
        settings = _fresh(env, tmp_path, tag)
        monkeypatch.setenv("DATAGEN_DATABASE_URL", settings.database_url)
        redis_client.flushdb()
        assert enqueue(path, "--seed", "5", "--budget-tokens", str(n * MEAN // 5)) == 0
        queued = delivery_order(redis_client, "again")
        # One thread: each sample starts after the last one's charge, so the sample that
        # crosses the budget, and so the set kept, depends on the order alone.
        runs.append((queued, run_to_close(settings, "again", concurrency=1)))
    (first_queue, first_kept), (second_queue, second_kept) = runs
    assert first_queue == second_queue
    assert first_kept == second_kept and len(first_kept) > n // 10
    assert_head(first_kept, first_queue, concurrency=1)

    out = tmp_path / "export"
    assert main(["export", "--format", "parquet", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.datagen").read_text())
    assert {k: manifest["datasets"]["again"][k] for k in ("order", "seed")} == {
        "order": "shuffle", "seed": 5}
    capsys.readouterr()


def test_a_reenqueue_after_a_redis_flush_keeps_going_in_the_same_order(
    env: Settings, redis_client: redis.Redis, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    n, budget = 1000, ("--budget-tokens", str(1000 * MEAN // 5))
    path, store, ordered = load(env, tmp_path, "flushed", n, "--seed", "3", *budget)
    with running_worker(env, concurrency=4):
        wait_for(lambda: store.prompt_counts("flushed").get("done", 0) >= 50, 60, "50 done")
    redis_client.flushdb()  # a Redis restarted without its data: queues and ledger gone

    capsys.readouterr()
    assert enqueue(path, "--seed", "4", *budget) == 2  # it would re-draw the subset
    assert "shuffled with seed 3" in capsys.readouterr().err
    assert delivery_order(redis_client, "flushed") == []
    assert enqueue(path, *budget) == 0  # the stored seed, without saying it
    queued = rank_order(store, "flushed", "queued")
    assert delivery_order(redis_client, "flushed") == queued
    assert queued == [s for s in ordered if s in set(queued)]

    samples = run_to_close(env, "flushed", concurrency=4)
    assert_head(samples, ordered, concurrency=4)
    assert_even_share(samples, n)


def test_the_workers_rebuild_and_sweep_publish_in_rank_order(
    env: Settings, redis_client: redis.Redis, tmp_path: Path,
) -> None:
    _, store, _ = load(env, tmp_path, "lost", 500)
    with store.engine.begin() as conn:  # some done: the rest must still go in order
        conn.execute(prompts.update().where(prompts.c.sample_id.like("lost-000%"))
                     .values(state="done"))
    queued = rank_order(store, "lost", "queued")
    assert len(queued) == 400
    redis_client.flushdb()
    publisher = Publisher(make_celery(env))
    assert rebuild_if_lost(store, redis_client, publisher) == {"lost": 400}
    assert delivery_order(redis_client, "lost") == queued

    from common.audit import requeue_lost

    for key in dataset_keys("lost").queue_lists:  # the messages alone lost
        redis_client.delete(key)
    assert requeue_lost(store, redis_client, publisher, quiet_for_s=0) == {"lost": 400}
    assert delivery_order(redis_client, "lost") == queued


def test_reopen_with_twice_the_budget_keeps_a_superset(
    env: Settings, redis_client: redis.Redis, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    n, budget = 1000, 1000 * MEAN // 10
    _, store, ordered = load(env, tmp_path, "grow", n, "--budget-tokens", str(budget))
    smaller = run_to_close(env, "grow", concurrency=8)
    assert main(["reopen", "grow", "--budget-tokens", str(2 * budget)]) == 0
    queued = rank_order(store, "grow", "queued")
    # Behind any message the stopped worker gave back to the queue as it shut down.
    assert delivery_order(redis_client, "grow")[-len(queued):] == queued
    larger = run_to_close(env, "grow", concurrency=8)
    assert smaller < larger and len(larger) > 1.5 * len(smaller)
    assert_head(larger, ordered, concurrency=8)
    capsys.readouterr()


def test_retry_sends_failed_prompts_in_rank_order(
    env: Settings, redis_client: redis.Redis, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, store, ordered = load(env, tmp_path, "again", 200)
    failing = ordered[::3]
    for sid in reversed(failing):
        store.mark_failed("again", sid, "timed out")
    assert main(["retry", "again"]) == 0
    sent = delivery_order(redis_client, "again")[-len(failing):]
    assert sent == failing  # behind the queued ones, in rank order
    for sid in failing[::2]:
        store.mark_failed("again", sid, "timed out")
    assert requeue_failed(store, "again") == failing[::2]
    capsys.readouterr()
