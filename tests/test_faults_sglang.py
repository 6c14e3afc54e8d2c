"""SGLang faults from the simulator on the real stack: 500s, 503 queue full, dropped
connections, aborted answers, slow answers, timeouts, a server down for a while and a
server process stopped then started again on the same port.

Required of every one: retried with backoff, at most ``max_attempts`` requests per sample,
each counted attempt matching a failed request the server saw, the error recorded in
``prompts.error``, and nothing counted in the ledger for a failed request.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

from common.ledger import Ledger
from common.store import Store
from tests.conftest import make_settings
from tests.faultkit import PrivateRedis, Sim, sim_faults, sim_log
from tests.faultkit_sglang import BASE_DECODE, sglang_faults, unanswered_attempt
from tests.faultkit_stack import Outcome, Stack
from tests.helpers import (
    context_for,
    enqueue_paths,
    running_worker,
    wait_settled,
    write_dataset,
)
from workers.tasks import _attempt

RECOVERY_LIMIT_S = 60.0
MAX_ATTEMPTS = 8
RETRY_BASE_S = 0.3


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    with PrivateRedis() as server:
        yield server


def run_phases(tmp: Path, rs: PrivateRedis, phases: tuple[str, ...], per_dataset: int,
               request_timeout_s: float = 2.0) -> Outcome:
    with Sim(tmp / "sim.jsonl", decode_tok_per_s=BASE_DECODE, mean_output_tokens=80,
             max_running_requests=64) as sim:
        settings = make_settings(f"sqlite:///{tmp / 'db.sqlite'}", sim.url, redis_url=rs.url,
                                 request_timeout_s=request_timeout_s, max_attempts=MAX_ATTEMPTS,
                                 retry_base_s=RETRY_BASE_S, retry_max_s=1.5)
        stack = Stack(settings, tmp, sim, redis=rs, workers=1)
        return sglang_faults(stack, per_dataset, phases)


def assert_retried_well(out: Outcome, phases: tuple[str, ...]) -> None:
    out.check.assert_ok()
    assert [f.split(" for ")[0] for f in out.faults] == list(phases)  # every phase hit work
    assert out.notes["retried_samples"] > 0
    assert out.check.requests_max <= MAX_ATTEMPTS
    assert out.notes["attempts_not_matching_server"] == []
    assert out.notes["failed_without_error"] == 0
    assert out.notes["min_retry_gap_s"] >= RETRY_BASE_S / 2  # full jitter's lower bound
    assert out.check.regenerated == 0  # a retry follows a failure, never a success


def test_errors_disconnects_aborts_and_slow_answers_are_retried(
    private_redis: PrivateRedis, tmp_path: Path
) -> None:
    phases = ("http_500", "queue_full_503", "disconnects", "aborts", "slow")
    out = run_phases(tmp_path, private_redis, phases, per_dataset=120)
    assert_retried_well(out, phases)
    assert out.check.states["done"] + out.check.states["failed"] == 240


def test_timeouts_count_as_attempts_and_are_bounded(
    private_redis: PrivateRedis, tmp_path: Path
) -> None:
    out = run_phases(tmp_path, private_redis, ("timeouts",), per_dataset=40,
                     request_timeout_s=1.5)
    assert_retried_well(out, ("timeouts",))
    assert out.check.states == {"done": 80}  # timed out during the fault only


def test_server_down_then_back_and_restarted_fails_nothing(
    private_redis: PrivateRedis, tmp_path: Path
) -> None:
    phases = ("down_for_s", "process_restart")
    out = run_phases(tmp_path, private_redis, phases, per_dataset=60)
    assert_retried_well(out, phases)
    assert out.check.states == {"done": 120}  # refused connections use up no attempt
    assert len(out.recovery_s) == 2 and max(out.recovery_s) < RECOVERY_LIMIT_S


@pytest.mark.parametrize(
    ("faults", "needle"),
    [
        ({"error_rate": 1.0, "error_status": 500}, "HTTP 500"),
        ({"error_rate": 1.0, "error_status": 503}, "HTTP 503: The request queue is full"),
        ({"disconnect_rate": 1.0}, "connection failed"),
        ({"abort_next": 100}, "request aborted by the server"),
        ({"latency_s": 1.5}, "timed out"),
    ],
    ids=["500", "503", "disconnect", "abort", "timeout"],
)
def test_a_fault_that_never_clears_fails_the_sample_and_counts_nothing(
    sqlite_url: str, sim: str, redis_client: redis.Redis, tmp_path: Path,
    faults: dict, needle: str,
) -> None:
    settings = make_settings(sqlite_url, sim, max_attempts=3, retry_base_s=0.05,
                             retry_max_s=0.1, request_timeout_s=0.5)
    enqueue_paths(settings, [str(write_dataset(tmp_path, "stuck", 2))])
    sim_faults(sim, **faults)
    store, ledger = Store(settings.database_url), Ledger(redis_client)
    with running_worker(settings, concurrency=2):
        wait_settled(store, ["stuck"], timeout_s=30)
    assert store.prompt_counts("stuck") == {"failed": 2}
    for i in range(2):
        prompt = store.prompt("stuck", f"stuck-{i}")
        assert prompt is not None and prompt.attempts == 3
    with store.engine.connect() as conn:
        errors = list(conn.exec_driver_sql("SELECT error FROM prompts").scalars())
    assert all(e.startswith("after 3 attempts: ") and needle in e for e in errors), errors
    assert len(sim_log(sim)) == 6  # three requests per sample, no more
    state = ledger.state("stuck")
    assert (state.used_tokens, state.samples, state.reserved_tokens, state.inflight) == (0,) * 4


class _Retry(Exception):
    """What the test's stand-in for a Celery task raises where Celery would retry."""

    def __init__(self, countdown: float) -> None:
        super().__init__(countdown)


@pytest.mark.parametrize("max_attempts", [3, 1], ids=["retried", "last-attempt"])
def test_the_restart_allowance_reads_what_a_worker_logs_for_an_unanswered_attempt(
    max_attempts: int, sqlite_url: str, sim: str, redis_client: redis.Redis, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The restart runs' attempt accounting finds unanswered attempts in the workers' log:
    reworded, its lines would quietly make that allowance zero, so a real line is parsed.
    A dropped connection counts an attempt, retried or the last one."""
    settings = make_settings(sqlite_url, sim, max_attempts=max_attempts)
    ctx = context_for(settings, tmp_path, "unanswered", 1)
    sim_faults(sim, disconnect_next=1)
    task = SimpleNamespace(request=SimpleNamespace(properties={}), retry=_Retry)
    with caplog.at_level(logging.INFO, logger="workers.tasks"):
        if max_attempts > 1:
            with pytest.raises(_Retry):
                _attempt(task, ctx, settings, "unanswered", "unanswered-0")
        else:
            assert _attempt(task, ctx, settings, "unanswered", "unanswered-0") == "failed"
    found = [unanswered_attempt(r.getMessage()) for r in caplog.records]
    assert [f for f in found if f is not None] == [("unanswered", "unanswered-0")], found
    row = ctx.store.prompt("unanswered", "unanswered-0")
    assert row is not None and row.attempts == 1
