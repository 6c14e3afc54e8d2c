"""A permanent error every sample meets stops its dataset; ``datagen retry`` brings the
failed prompts back, once, and clears the stop. On a real worker, Redis, SQL and the
simulator, which refuses a top_p of 7 as SGLang does (HTTP 400)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from common.failures import STOPPED, commonest_error, requeue_failed, streak
from common.keys import dataset_keys
from common.ledger import Ledger
from common.rows import NewPrompt, ResultRow
from common.settings import Settings
from common.store import Store
from ops.cli import main
from tests.faultkit import sim_log
from tests.helpers import assert_invariants, running_worker, wait_settled, write_dataset

PROMPTS = 40


@pytest.fixture
def env(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Settings:
    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    return settings


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout_s}s")


def queue_length(client: redis.Redis, name: str) -> int:
    return sum(int(client.llen(q)) for q in dataset_keys(name).queue_lists)


def requests_of(sim: str, name: str) -> list[dict[str, object]]:
    return [r for r in sim_log(sim) if str(r["rid"]).endswith(f"-{name}")]


def stored_typo(env: Settings, tmp_path: Path, name: str) -> Store:
    """A dataset stored with top_p 7, as versions without the door's check stored it."""
    assert main(["enqueue", str(write_dataset(tmp_path, name, PROMPTS)), "-q",
                 "--max-new-tokens", "64"]) == 0
    store = Store(env.database_url)
    store.set_sampling(name, {**store.dataset(name).sampling, "top_p": 7})
    return store


def test_a_shared_permanent_error_stops_the_dataset_and_retry_brings_it_back_once(
    env: Settings, sim: str, tmp_path: Path, redis_client: redis.Redis,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store, ledger = stored_typo(env, tmp_path, "typo"), Ledger(redis_client)
    with running_worker(env, concurrency=4):
        wait_for(lambda: store.dataset("typo").state == "closed", "the dataset stops")
        wait_for(lambda: ledger.state("typo").inflight == 0, "its requests end")
        # Purged, as at a close. Checked while the worker runs: at its shutdown kombu
        # returns the messages it had reserved to the queue, where the next worker drops
        # them, since the dataset is closed.
        assert queue_length(redis_client, "typo") == 0
    ds = store.dataset("typo")
    assert ds.close_reason == STOPPED
    counts = store.prompt_counts("typo")
    # Stopped after 5, give or take the requests already in flight; the rest stay queued.
    assert 5 <= counts["failed"] < PROMPTS and "done" not in counts, counts
    assert counts["queued"] == PROMPTS - counts["failed"]
    # Refused with SGLang's 400, sent in the stream (the request is streamed under drain).
    refused = [r for r in requests_of(sim, "typo") if r["finish_type"] == "error"]
    assert len(refused) == counts["failed"]

    capsys.readouterr()
    assert main(["status", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["datasets"]
    assert row["state"] == "stopped"
    assert "HTTP 400: top_p must be in (0, 1], got 7.0." in row["stop_error"]
    assert main(["status"]) == 0
    shown = capsys.readouterr().out
    assert "stopped" in shown and "datagen retry typo" in shown

    # Twice, with no worker running: the second finds nothing to send.
    assert main(["retry", "typo", "--top-p", "0.9"]) == 0
    first = capsys.readouterr().out
    assert f"{counts['failed']} failed prompts back to queued" in first
    assert f"{PROMPTS} prompts enqueued" in first and "no longer stopped" in first
    assert main(["retry", "typo", "--top-p", "0.9"]) == 0
    assert "nothing to retry" in capsys.readouterr().out
    assert queue_length(redis_client, "typo") == PROMPTS  # one message per prompt
    assert store.prompt_counts("typo") == {"queued": PROMPTS}
    ds = store.dataset("typo")
    assert (ds.state, ds.close_reason, ds.sampling["top_p"]) == ("open", None, 0.9)

    with running_worker(env, concurrency=4):
        wait_settled(store, ["typo"], client=redis_client)
    assert store.prompt_counts("typo") == {"done": PROMPTS}
    answered = [r for r in requests_of(sim, "typo") if r["finish_type"] in ("stop", "length")]
    assert len(answered) == PROMPTS  # each prompt sent once after the fix
    assert ledger.state("typo").samples == PROMPTS
    assert_invariants(store, ledger, ["typo"])


def test_retry_while_workers_run_sends_with_the_fixed_sampling(
    env: Settings, sim: str, tmp_path: Path, redis_client: redis.Redis,
) -> None:
    # The workers hold the dataset's row (old sampling) for a few seconds: a prompt sent
    # back before they re-read it would fail again, and stop the dataset again.
    store, ledger = stored_typo(env, tmp_path, "live"), Ledger(redis_client)
    with running_worker(env, concurrency=4):
        wait_for(lambda: store.dataset("live").state == "closed", "the dataset stops")
        assert main(["retry", "live", "--top-p", "0.9"]) == 0
        wait_settled(store, ["live"], client=redis_client)
        wait_for(lambda: ledger.state("live").inflight == 0, "its requests end")
    assert store.dataset("live").state == "open"
    assert store.prompt_counts("live") == {"done": PROMPTS}, commonest_error(store, "live")
    assert_invariants(store, ledger, ["live"])


def test_failures_with_results_between_them_do_not_stop_the_dataset(
    env: Settings, sim: str, tmp_path: Path, redis_client: redis.Redis,
) -> None:
    # The simulator answers 400 to the next four requests, then serves: a worker with one
    # thread meets four failures in a row, one fewer than the stop needs.
    assert main(["enqueue", str(write_dataset(tmp_path, "few", 12)), "-q",
                 "--max-new-tokens", "64"]) == 0
    import requests

    requests.post(f"{sim}/sim/faults", json={"fail_next": 4, "error_status": 400},
                  timeout=5).raise_for_status()
    store = Store(env.database_url)
    with running_worker(env, concurrency=1):
        wait_settled(store, ["few"], client=redis_client)
    assert store.dataset("few").state == "open"
    assert store.prompt_counts("few") == {"failed": 4, "done": 8}


def _result(name: str, sample_id: str) -> ResultRow:
    return ResultRow(dataset=name, sample_id=sample_id, rid=f"r-{sample_id}", prompt_tokens=3,
                     completion_tokens=2, finish_reason="stop", output_ids=[1, 2],
                     output_text="ok", server="s", model="m")


def test_the_streak_counts_one_message_since_the_last_result(
    env: Settings, tmp_path: Path,
) -> None:
    assert main(["enqueue", str(write_dataset(tmp_path, "s", 10)), "-q"]) == 0
    store = Store(env.database_url)
    for i in range(3):
        store.mark_failed("s", f"s-{i}", "HTTP 400: bad")
    store.mark_failed("s", "s-3", "HTTP 400: other")
    assert streak(store, "s", "HTTP 400: bad") == 3
    time.sleep(0.01)  # timestamps of separate steps differ, on any clock resolution
    store.save_results([_result("s", "s-4")])
    time.sleep(0.01)
    assert streak(store, "s", "HTTP 400: bad") == 0
    store.mark_failed("s", "s-5", "HTTP 400: bad")
    assert streak(store, "s", "HTTP 400: bad") == 1


def test_retry_error_filter_takes_only_matching_prompts_and_resets_attempts(
    env: Settings, tmp_path: Path, redis_client: redis.Redis,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["enqueue", str(write_dataset(tmp_path, "f", 6)), "-q"]) == 0
    store = Store(env.database_url)
    redis_client.delete(*dataset_keys("f").queue_lists)  # as if workers had taken them all
    for i in range(4):
        store.record_attempt("f", f"f-{i}", "x")
        store.mark_failed("f", f"f-{i}", "HTTP 400: Top_P 100%_wrong" if i < 3 else "timeout")
    capsys.readouterr()
    assert main(["retry", "f", "--error", "top_p 100%"]) == 0
    assert "3 failed prompts back to queued" in capsys.readouterr().out
    assert queue_length(redis_client, "f") == 3
    assert sorted(p.sample_id for p in store.prompts([("f", f"f-{i}") for i in range(4)])
                  if p is not None and p.state == "queued" and p.attempts == 0) == [
        "f-0", "f-1", "f-2"]
    assert store.prompt_counts("f") == {"queued": 5, "failed": 1}
    # `%` and `_` are plain characters: "100_" matches nothing.
    assert requeue_failed(store, "f", "100_") == []
    assert requeue_failed(store, "f", None) == ["f-3"]


def test_retry_leaves_failed_a_turn_that_could_not_be_built(
    env: Settings, tmp_path: Path, redis_client: redis.Redis,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A conversation's turn whose prompt could not be rendered is stored failed with no
    token ids: sending it again would send an empty prompt."""
    assert main(["enqueue", str(write_dataset(tmp_path, "t", 2)), "-q"]) == 0
    store = Store(env.database_url)
    redis_client.delete(*dataset_keys("t").queue_lists)  # as if workers had taken them all
    store.record_attempt("t", "t-0", "timeout")
    store.mark_failed("t", "t-0", "timeout")
    store.insert_prompts([NewPrompt(dataset="t", sample_id="c#turn2", state="failed",
                                    prompt_tokens=0, max_new_tokens=0, source="t.jsonl:9",
                                    messages=[], input_ids=[],
                                    error="turn 2 could not be built: boom",
                                    conversation="c", turn=2)])
    capsys.readouterr()
    assert main(["retry", "t"]) == 0
    out = capsys.readouterr().out
    assert "1 failed prompts back to queued" in out
    assert "1 failed turns could not be built" in out and "stay failed" in out
    assert queue_length(redis_client, "t") == 1
    assert store.prompt("t", "c#turn2").state == "failed"  # type: ignore[union-attr]
    assert main(["retry", "t"]) == 0
    out = capsys.readouterr().out
    assert "nothing to retry" in out and "1 failed turns could not be built" in out
