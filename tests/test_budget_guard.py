"""The budget guard on the real stack: policies at 64 in flight, purge, resume."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests

from common.budget import Budget
from common.celery_app import make_celery
from common.ledger import Ledger
from common.publish import Publisher
from common.settings import Settings
from common.store import Store
from ops.cli import main as cli_main
from tests.conftest import REDIS_URL, make_settings
from tests.helpers import (
    assert_invariants,
    enqueue_paths,
    running_worker,
    wait_settled,
    write_dataset,
)

BUDGET = 20_000
# Requests admitted just before a close may reach the server a moment after it.
ADMIT_TO_SEND_GRACE_S = 0.25
# That moment holds on a machine with a core to spare, not beside three other test workers.
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def slow_sim() -> Iterator[str]:
    """A server slow enough that 64 requests are in flight when a budget is crossed."""
    from producer.template import BUNDLED_TOKENIZER
    from sim import SimConfig, SimServer

    server = SimServer(SimConfig(port=0, decode_tok_per_s=1500, mean_output_tokens=300,
                                 max_running_requests=128, tokenizer=str(BUNDLED_TOKENIZER)))
    url = server.start()
    yield url
    server.stop()


@pytest.fixture
def guard_settings(slow_sim: str, sqlite_url: str, redis_client: redis.Redis) -> Settings:
    requests.post(f"{slow_sim}/sim/reset", timeout=5).raise_for_status()
    return make_settings(sqlite_url, slow_sim, concurrency=64)


def requests_after_close(sim: str, dataset: str, closed_at: float) -> list[dict]:
    log = requests.get(f"{sim}/sim/requests", timeout=10).json()
    late = closed_at + ADMIT_TO_SEND_GRACE_S
    return [r for r in log if r["rid"].endswith(f"-{dataset}") and r["arrived_ts"] > late]


def run_three(settings: Settings, tmp_path: Path, policy: str) -> tuple[Store, Ledger]:
    small = [str(write_dataset(tmp_path, n, 150)) for n in ("small1", "small2")]
    big = str(write_dataset(tmp_path, "big", 40))
    enqueue_paths(settings, small, Budget(BUDGET, policy=policy))  # type: ignore[arg-type]
    enqueue_paths(settings, [big], Budget(10_000_000, policy=policy))  # type: ignore[arg-type]
    store, ledger = Store(settings.database_url), Ledger(redis.Redis.from_url(REDIS_URL))
    with running_worker(settings, concurrency=64):
        wait_settled(store, ["small1", "small2", "big"], timeout_s=120)
        deadline = time.monotonic() + 30
        while any(ledger.state(n).inflight for n in ("small1", "small2")):
            assert time.monotonic() < deadline, "in-flight requests never finished"
            time.sleep(0.1)
    return store, ledger


@pytest.mark.parametrize("policy", ["drain", "abort", "exact"])
def test_policies_close_at_the_crossing(
    guard_settings: Settings, slow_sim: str, tmp_path: Path, policy: str
) -> None:
    store, ledger = run_three(guard_settings, tmp_path, policy)
    assert_invariants(store, ledger, ["small1", "small2", "big"])
    for name in ("small1", "small2"):
        ds, state = store.dataset(name), ledger.state(name)
        assert ds.state == "closed" and ds.close_reason == "budget"
        assert state.closed_at is not None
        assert requests_after_close(slow_sim, name, state.closed_at) == []
        overshoot = ds.budget.overshoot(state.used_tokens)
        if policy == "exact":
            assert state.used_tokens == BUDGET
        elif policy == "abort":
            with store.engine.connect() as conn:
                crossing = conn.exec_driver_sql(
                    "SELECT MAX(completion_tokens) FROM results WHERE dataset = ?", (name,)
                ).scalar()
            assert overshoot <= crossing
        assert state.used_tokens >= BUDGET
    assert store.prompt_counts("big") == {"done": 40}
    assert store.dataset("big").state == "open"


def test_a_task_of_a_closed_dataset_sends_no_request(
    guard_settings: Settings, slow_sim: str, tmp_path: Path
) -> None:
    enqueue_paths(guard_settings, [str(write_dataset(tmp_path, "shut", 10))])
    store, ledger = Store(guard_settings.database_url), Ledger(redis.Redis.from_url(REDIS_URL))
    assert ledger.close("shut", "manual").purged == 10
    # Messages that come back after the close, as a crashed worker's unacked ones would.
    Publisher(make_celery(guard_settings)).publish("shut", store.dataset("shut").stamp,
                                                   [f"shut-{i}" for i in range(10)])
    assert ledger.state("shut").queued == 10
    with running_worker(guard_settings, concurrency=8):
        deadline = time.monotonic() + 20
        while ledger.state("shut").queued and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
    assert ledger.state("shut").queued == 0
    assert requests.get(f"{slow_sim}/sim/requests", timeout=5).json() == []
    assert store.prompt_counts("shut") == {"queued": 10}


def test_purge_a_running_dataset_and_an_unknown_one(
    guard_settings: Settings, slow_sim: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for key, value in guard_settings.to_env().items():
        monkeypatch.setenv(key, value)
    enqueue_paths(guard_settings, [str(write_dataset(tmp_path, "live", 400))])
    store, ledger = Store(guard_settings.database_url), Ledger(redis.Redis.from_url(REDIS_URL))
    with running_worker(guard_settings, concurrency=16):
        while store.prompt_counts("live").get("done", 0) < 20:
            time.sleep(0.05)
        assert cli_main(["purge", "live"]) == 0
        out = capsys.readouterr().out
        state = ledger.state("live")
        time.sleep(1.0)
    assert "removed" in out and state.queued == 0
    assert state.closed_at is not None and store.dataset("live").close_reason == "manual"
    assert requests_after_close(slow_sim, "live", state.closed_at) == []
    assert cli_main(["purge", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "unknown dataset 'nosuch'" in err and "live" in err


def test_resume_after_redis_loss_with_a_lower_budget_sends_nothing(
    guard_settings: Settings, slow_sim: str, tmp_path: Path, redis_client: redis.Redis
) -> None:
    path = str(write_dataset(tmp_path, "b2", 30))
    enqueue_paths(guard_settings, [path])
    store = Store(guard_settings.database_url)
    with running_worker(guard_settings, concurrency=16):
        wait_settled(store, ["b2"])
    done_tokens = store.used_tokens("b2", store.dataset("b2").budget)
    redis_client.flushdb()
    requests.post(f"{slow_sim}/sim/reset", timeout=5).raise_for_status()
    summary = enqueue_paths(guard_settings, [path], Budget(done_tokens // 2))[0]
    assert summary.closed and summary.enqueued == 0 and summary.already_done == 30
    ledger = Ledger(redis_client)
    assert ledger.state("b2").used_tokens == done_tokens
    with running_worker(guard_settings, concurrency=4):
        time.sleep(1.0)
    assert requests.get(f"{slow_sim}/sim/requests", timeout=5).json() == []
    assert store.dataset("b2").state == "closed"
