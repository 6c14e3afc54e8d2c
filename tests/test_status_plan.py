"""``datagen status`` throughput, ETA and totals, and ``datagen plan``, on the real stack.

Every expected number is recomputed here from SQL rows with plain arithmetic, not with
the queries of ops.progress, so a wrong window, basis or rounding shows up as a mismatch.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import socket
import subprocess
import sys
import threading
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from rich.console import Console

from common.concurrency import LimitState
from common.keys import AUTO_LIMITS, STORE_ID
from common.schema import prompts, results
from common.settings import Settings
from common.store import Store, as_utc
from ops.cli import main
from ops.localredis import free_port
from ops.plan import MIN_OBSERVED, add_plan_parser, run_plan
from ops.status import duration, eta_seconds
from ops.status_servers import NO_READING, collect_servers, render_servers
from tests.faultkit import wait_for
from tests.helpers import running_worker, wait_settled, write_dataset

STATUS_KEYS = {
    "name", "state", "prompts", "done", "failed", "skipped", "queued", "used_tokens",
    "budget_tokens", "basis", "policy", "inflight", "closed_at", "overshoot_tokens",
    "tok_per_s", "eta_s", "retrying", "last_error", "last_error_count", "stop_error",
    "conversations",
    "order", "seed", "mixtures", "generations", "not_kept",
}
TOTALS_KEYS = {
    "datasets", "open", "prompts", "done", "failed", "skipped", "queued", "inflight",
    "used_tokens", "budget_tokens", "overshoot_tokens", "tok_per_s", "eta_s", "retrying",
}
SUMMED = ("prompts", "done", "failed", "skipped", "queued", "inflight", "used_tokens",
          "budget_tokens", "overshoot_tokens", "retrying")


@pytest.fixture
def env(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Settings:
    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    return settings


def enqueue(path: Path, *flags: str) -> None:
    assert main(["enqueue", str(path), "-q", *flags]) == 0


def run_until_settled(env: Settings, names: list[str]) -> None:
    with running_worker(env, concurrency=4):
        wait_settled(Store(env.database_url), names)


def status_json(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["status", "--json"]) == 0
    return dict(json.loads(capsys.readouterr().out))


def plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """Run ``datagen plan`` through the parser ops.plan exposes (cli.py wires the same)."""
    parser = argparse.ArgumentParser(prog="datagen")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    capsys.readouterr()
    code = run_plan(parser.parse_args(["plan", *argv]), Settings.from_env())
    return code, capsys.readouterr().out


def result_rows(env: Settings, name: str) -> list[tuple[int, int, datetime]]:
    """(completion_tokens, prompt_tokens, created_at as aware UTC) of a dataset's results."""
    q = sa.select(results.c.completion_tokens, results.c.prompt_tokens, results.c.created_at)
    with Store(env.database_url).engine.connect() as conn:
        rows = conn.execute(q.where(results.c.dataset == name)).all()
    return [(c, p, as_utc(t)) for c, p, t in rows]  # type: ignore[misc]


def completion_since(env: Settings, name: str, moment: datetime) -> int:
    return sum(c for c, _, t in result_rows(env, name) if t >= moment)


def test_status_json_adds_rate_eta_and_totals(
    env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    enqueue(write_dataset(tmp_path, "st", 6), "--budget-tokens", "50k")
    run_until_settled(env, ["st"])
    before = datetime.now(UTC)
    doc = status_json(capsys)
    after = datetime.now(UTC)
    (row,) = doc["datasets"]
    assert set(row) == STATUS_KEYS and set(doc["totals"]) == TOTALS_KEYS
    # The window's bound moved while status ran; both ends must give the same sum.
    recent = completion_since(env, "st", after - timedelta(seconds=60))
    assert recent == completion_since(env, "st", before - timedelta(seconds=60)) > 0
    assert row["tok_per_s"] == round(recent / 60, 1) > 0
    assert (row["state"], row["done"], row["eta_s"]) == ("open", 6, 0)  # nothing left to do
    totals = doc["totals"]
    assert {k: totals[k] for k in SUMMED} == {k: row[k] for k in SUMMED}
    assert (totals["datasets"], totals["open"], totals["eta_s"]) == (1, 1, 0)
    assert totals["tok_per_s"] == row["tok_per_s"]


def test_rate_counts_only_the_last_minute_and_eta_follows_it(
    env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    enqueue(write_dataset(tmp_path, "eta", 10), "--budget-tokens", "50k")
    run_until_settled(env, ["eta"])
    with Store(env.database_url).engine.begin() as conn:  # two results stored 2 minutes ago
        first = sa.select(results.c.id, results.c.completion_tokens).order_by(results.c.id)
        old = conn.execute(first.limit(2)).all()
        conn.execute(results.update().where(results.c.id.in_([i for i, _ in old]))
                     .values(created_at=datetime.now(UTC) - timedelta(seconds=120)))
    # 15 more prompts (same budget), and no worker to take them.
    enqueue(write_dataset(tmp_path, "eta", 25), "--budget-tokens", "50k")
    doc = status_json(capsys)
    (row,) = doc["datasets"]
    rows = result_rows(env, "eta")
    used, n = sum(c for c, _, _ in rows), len(rows)
    recent = used - sum(c for _, c in old)
    assert recent == completion_since(env, "eta", datetime.now(UTC) - timedelta(seconds=60))
    assert row["tok_per_s"] == round(recent / 60, 1)
    budget_left, prompts_left = 50_000 - used, 15
    expected = round(min(budget_left, prompts_left * (used / n)) / (recent / 60))
    assert (row["queued"], row["eta_s"]) == (15, expected) and expected > 0
    assert doc["totals"]["eta_s"] == expected


def test_eta_is_null_for_a_closed_dataset(
    env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    enqueue(write_dataset(tmp_path, "cl", 30), "--budget-tokens", "600")
    enqueue(write_dataset(tmp_path, "op", 3))
    with running_worker(env, concurrency=2):
        wait_settled(Store(env.database_url), ["cl", "op"])
    doc = status_json(capsys)
    rows = {r["name"]: r for r in doc["datasets"]}
    assert rows["cl"]["state"] == "closed" and rows["cl"]["closed_at"] is not None
    assert rows["cl"]["eta_s"] is None and rows["op"]["eta_s"] == 0
    assert (doc["totals"]["open"], doc["totals"]["eta_s"]) == (1, 0)  # the open one's ETA
    assert doc["totals"]["overshoot_tokens"] == rows["cl"]["used_tokens"] - 600
    capsys.readouterr()
    assert main(["status"]) == 0
    table = capsys.readouterr().out
    assert "tok/s" in table and "ETA" in table and "1 open" in table


def _planned(env: Settings, name: str, basis: str) -> tuple[int, int, int]:
    """(results, tokens on the basis, output tokens) of a dataset, summed in Python."""
    rows = result_rows(env, name)
    cost = sum(c + (p if basis == "total" else 0) for c, p, _ in rows)
    return len(rows), cost, sum(c for c, _, _ in rows)


def test_plan_from_observed_results_matches_sql_arithmetic(
    env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    enqueue(write_dataset(tmp_path, "po", 25))
    enqueue(write_dataset(tmp_path, "pt", 25), "--budget-basis", "total", "--budget-tokens", "50k")
    run_until_settled(env, ["po", "pt"])
    enqueue(write_dataset(tmp_path, "po", 40))  # 15 queued left for the plan
    code, out = plan(capsys, "--json", "--tok-per-s", "930")
    assert code == 0
    doc = json.loads(out)
    rows = {r["name"]: r for r in doc["datasets"]}
    n, cost, _ = _planned(env, "po", "output")
    po = rows["po"]
    assert n >= MIN_OBSERVED and po["mean_source"] == "observed"
    assert po["mean_tokens"] == round(cost / n, 1) and po["used_tokens"] == cost
    assert po["samples"] == 25 + (10_000_000 - cost) * n // cost
    assert (po["usable_prompts"], po["short_by"]) == (40, po["samples"] - 40)
    to_go = round(min(Fraction(10_000_000 - cost), Fraction(15 * cost, n)))
    assert po["tokens_to_go"] == po["output_tokens_to_go"] == to_go
    assert po["hours"] == pytest.approx(to_go / 930 / 3600, abs=1e-3)
    n_t, cost_t, _ = _planned(env, "pt", "total")
    pt = rows["pt"]
    assert pt["used_tokens"] == cost_t and pt["mean_tokens"] == round(cost_t / n_t, 1)
    assert pt["samples"] == 25 + (50_000 - cost_t) * n_t // cost_t
    assert (pt["state"], pt["tokens_to_go"]) == ("open", 0)  # nothing queued: none to go
    total = doc["total"]
    assert (total["tok_per_s"], total["tok_per_s_source"]) == (930.0, "--tok-per-s")
    assert total["tokens_to_go"] == to_go and total["left_out"] == []


def test_plan_observed_throughput_is_the_last_ten_minutes(
    env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    enqueue(write_dataset(tmp_path, "tp", 8))
    run_until_settled(env, ["tp"])
    code, out = plan(capsys, "--json")
    total = json.loads(out)["total"]
    recent = completion_since(env, "tp", datetime.now(UTC) - timedelta(seconds=600))
    assert code == 0 and recent == _planned(env, "tp", "output")[2]
    assert (total["tok_per_s"], total["tok_per_s_source"]) == (
        round(recent / 600, 1), "observed, last 10 min")
    row = json.loads(out)["datasets"][0]
    assert row["mean_source"] == "observed, n=8"  # fewer than 20 and no guess given


def _mean_prompt(env: Settings, name: str) -> Fraction:
    q = sa.select(prompts.c.prompt_tokens).where(prompts.c.dataset == name)
    with Store(env.database_url).engine.connect() as conn:
        lengths = list(conn.scalars(q))
    return Fraction(sum(lengths), len(lengths))


def test_plan_with_a_guess_on_datasets_without_results(
    env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    enqueue(write_dataset(tmp_path, "ga", 30), "--budget-tokens", "100k")
    enqueue(write_dataset(tmp_path, "gs", 5), "--budget-tokens", "100k")
    enqueue(write_dataset(tmp_path, "gt", 30), "--budget-tokens", "100k", "--budget-basis", "total")
    code, out = plan(capsys, "--mean-tokens", "4100", "--tok-per-s", "930", "--json")
    assert code == 0
    doc = json.loads(out)
    rows = {r["name"]: r for r in doc["datasets"]}
    ga, gs, gt = rows["ga"], rows["gs"], rows["gt"]
    assert ga["samples"] == 100_000 // 4100 == 24 and ga["mean_source"] == "--mean-tokens"
    assert (ga["short_by"], ga["tokens_to_go"]) == (0, min(100_000, 30 * 4100))
    assert ga["hours"] == pytest.approx(100_000 / 930 / 3600, abs=1e-3)
    assert (gs["samples"], gs["short_by"], gs["tokens_to_go"]) == (24, 19, 5 * 4100)
    mean_t = 4100 + _mean_prompt(env, "gt")  # basis total: the prompt counts too
    assert gt["samples"] == math.floor(100_000 / mean_t)
    assert gt["output_tokens_to_go"] == round(Fraction(100_000) * 4100 / mean_t)
    # The share each budget keeps: budget / (usable prompts × mean), at most all of them.
    assert (ga["kept_fraction"], gs["kept_fraction"]) == (round(100_000 / (30 * 4100), 4), 1.0)
    assert gt["kept_fraction"] == round(float(Fraction(100_000) / (30 * mean_t)), 4)
    out_to_go = 100_000 + 5 * 4100 + gt["output_tokens_to_go"]
    assert doc["total"]["output_tokens_to_go"] == out_to_go
    assert doc["total"]["hours"] == pytest.approx(out_to_go / 930 / 3600, abs=1e-3)
    _, text = plan(capsys, "--mean-tokens", "4100", "--tok-per-s", "930")
    assert "enough" in text and "short by 19" in text and "--tok-per-s" in text
    assert "81.3%" in text and "100.0%" in text


def test_plan_without_rate_or_guess_says_how_to_give_them(
    env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    enqueue(write_dataset(tmp_path, "nr", 4))
    code, out = plan(capsys, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["total"]["hours"] is None and doc["total"]["left_out"] == ["nr"]
    assert doc["datasets"][0]["samples"] is None
    _, text = plan(capsys)
    assert "pass --tok-per-s N" in text and "pass --mean-tokens N" in text
    _, guessed = plan(capsys, "--json", "--mean-tokens", "100")
    assert json.loads(guessed)["datasets"][0]["hours"] is None  # a mean, still no rate


def test_eta_and_duration_arithmetic() -> None:
    def eta(prompts_left: int, closed: bool = False) -> int | None:
        return eta_seconds(closed=closed, prompts_left=prompts_left, budget_left=1_000,
                           mean=100.0, rate=10.0)

    assert (eta(3), eta(50), eta(0)) == (30, 100, 0)  # prompts end first; budget first; done
    assert eta(50, closed=True) is None
    assert eta_seconds(closed=False, prompts_left=5, budget_left=10, mean=None, rate=0) is None
    assert [duration(s) for s in (None, 42, 725, 18_420, 183_600)] == [
        "", "42s", "12m 05s", "5h 07m", "2d 03h"]


# -- what status must not hide ---------------------------------------------------------

# Not the queue lengths: the flush took the messages, and SQL's prompts come back by
# enqueue or the workers' sweep, not by status.
COMPARED = ("state", "prompts", "done", "used_tokens", "budget_tokens", "overshoot_tokens",
            "closed_at", "inflight")


def test_status_on_an_emptied_redis_rebuilds_the_ledgers_from_sql(
    env: Settings, redis_client: redis.Redis, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    enqueue(write_dataset(tmp_path, "cl", 30), "--budget-tokens", "600")
    enqueue(write_dataset(tmp_path, "op", 4))
    run_until_settled(env, ["cl", "op"])
    before = {r["name"]: r for r in status_json(capsys)["datasets"]}
    redis_client.flushdb()  # a Redis restarted without its data, or a new database
    capsys.readouterr()
    assert main(["status", "--json"]) == 0
    out, err = capsys.readouterr()
    after = {r["name"]: r for r in json.loads(out)["datasets"]}
    for name in ("cl", "op"):
        sql_tokens = sum(c for c, _, _ in result_rows(env, name))
        assert after[name]["used_tokens"] == sql_tokens > 0  # not 0 / budget
        assert {k: after[name][k] for k in COMPARED} == {k: before[name][k] for k in COMPARED}
    # A drain close may land exactly on the budget: the overshoot is whatever SQL holds.
    cl_tokens = sum(c for c, _, _ in result_rows(env, "cl"))
    assert after["cl"]["state"] == "closed" and cl_tokens >= 600
    assert after["cl"]["overshoot_tokens"] == cl_tokens - 600
    assert "held no ledger of cl, op: rebuilt from SQL" in err
    assert redis_client.get(STORE_ID) == Store(env.database_url).store_id.encode()
    assert main(["status"]) == 0  # rebuilt once: the next look finds the ledgers there
    table = capsys.readouterr().out
    assert "rebuilt from SQL" not in table
    assert f"{sum(r['used_tokens'] for r in before.values()):,} / " in table


def _retrying_in_sql(env: Settings) -> int:
    q = sa.select(sa.func.count()).where(prompts.c.state == "queued",
                                         prompts.c.error.is_not(None))
    with Store(env.database_url).engine.connect() as conn:
        return int(conn.scalar(q) or 0)


def _set_error(env: Settings, ids: list[str], error: str, at: datetime) -> None:
    with Store(env.database_url).engine.begin() as conn:
        conn.execute(prompts.update().where(prompts.c.sample_id.in_(ids))
                     .values(error=error, updated_at=at))


def test_status_shows_samples_waiting_on_an_unreachable_server(
    env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as s:  # a port nothing listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    down = env.replace(sglang_urls=(dead,))
    for key, value in down.to_env().items():
        monkeypatch.setenv(key, value)
    enqueue(write_dataset(tmp_path, "un", 5))
    with running_worker(down, concurrency=8):
        wait_for(lambda: _retrying_in_sql(down) == 5, 60, "5 samples retried")
        doc = status_json(capsys)
        capsys.readouterr()
        assert main(["status"]) == 0
        table = capsys.readouterr().out
    (row,) = doc["datasets"]
    assert (row["done"], row["failed"], row["retrying"], row["last_error_count"]) == (0, 0, 5, 5)
    assert row["last_error"] == f"{dead}: connection refused"
    assert doc["totals"]["retrying"] == 5
    assert "un: 5 samples waiting to be retried; last error (5 of them): " \
           f"{dead}: connection refused" in table
    # The newest error is the one shown, counted among the samples that hold it.
    now = datetime.now(UTC)
    _set_error(down, ["un-0", "un-1"], "HTTP 503: queue full", now - timedelta(hours=1))
    row = status_json(capsys)["datasets"][0]
    assert (row["retrying"], row["last_error"], row["last_error_count"]) == (
        5, f"{dead}: connection refused", 3)
    _set_error(down, ["un-0", "un-1"], "HTTP 503: queue full", now + timedelta(hours=1))
    row = status_json(capsys)["datasets"][0]
    assert (row["retrying"], row["last_error"], row["last_error_count"]) == (
        5, "HTTP 503: queue full", 2)
    # Closed, its queued prompts are dropped when met, not retried.
    assert main(["purge", "un"]) == 0
    row = status_json(capsys)["datasets"][0]
    assert (row["state"], row["retrying"], row["last_error"]) == ("closed", 0, None)


def _frames(proc: subprocess.Popen[str], wanted: int) -> list[list[str]]:
    """Frames read from the pipe, each from its title line up to the next one, until
    ``wanted`` whole frames were read."""
    assert proc.stdout is not None
    frames: list[list[str]] = []
    for line in proc.stdout:
        if line.startswith("datagen status  "):
            if len(frames) == wanted:
                break
            frames.append([])
        if frames and line.strip():
            frames[-1].append(line.rstrip())
    return frames


def test_status_watch_into_a_pipe_writes_frames(env: Settings, tmp_path: Path) -> None:
    enqueue(write_dataset(tmp_path, "wp", 3))
    proc = subprocess.Popen([sys.executable, "-m", "ops.cli", "status", "--watch"],
                            env={**os.environ, "NO_COLOR": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    got: list[list[list[str]]] = []
    reader = threading.Thread(target=lambda: got.append(_frames(proc, 2)), daemon=True)
    reader.start()
    reader.join(60)  # a bound on a hang, not on speed: frames come every 2 s
    proc.terminate()
    _, err = proc.communicate(timeout=30)
    assert got, f"status --watch wrote no two frames into a pipe; stderr: {err}"
    (frames,) = got
    assert len(frames) == 2
    for frame in frames:
        assert frame[0].startswith("datagen status  ") and frame[0].endswith("Z")
        assert any(line.split()[:2] == ["wp", "open"] for line in frame)
        assert any(line.split()[:3] == ["total", "1", "open"] for line in frame)
        # The server's own load, under the datasets.
        assert any(line.split()[0] == env.sglang_urls[0] for line in frame[-3:])
    assert frames[0][0] <= frames[1][0]  # each frame under its own timestamp


def test_status_shows_each_servers_load(env: Settings, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    enqueue(write_dataset(tmp_path, "sv", 2))
    (server,) = status_json(capsys)["servers"]
    assert server["url"] == env.sglang_urls[0] and server["error"] is None
    assert server["max_running"] > 0 and server["running"] >= 0 and server["waiting"] >= 0
    assert 0 <= server["token_usage"] <= 1 and server["gen_throughput"] >= 0
    assert server["auto_limit"] is None  # no worker polled the servers
    with redis.Redis.from_url(env.redis_url) as client:
        client.hset(AUTO_LIMITS, env.sglang_urls[0], LimitState(12, 0, 3).to_json())
    (server,) = status_json(capsys)["servers"]
    assert server["auto_limit"] == 12
    silent = f"http://127.0.0.1:{free_port()}"
    (row,) = collect_servers(env.replace(sglang_urls=(silent,)))
    assert (row.url, row.running, row.error) == (silent, None, NO_READING)
    console = Console(width=160, file=io.StringIO(), no_color=True)
    console.print(render_servers([row]))
    lines = console.file.getvalue().splitlines()  # type: ignore[attr-defined]
    assert any(silent in line and NO_READING in line for line in lines)
