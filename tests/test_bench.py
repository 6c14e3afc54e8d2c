"""`make bench`'s plan, its summary of figures against targets, and its database set-up
(no benchmark is run)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis
import requests
import sqlalchemy as sa

from bench.__main__ import commands, parse
from bench.concurrency import summary as concurrency_summary
from bench.costs import RedisMonitor
from bench.harness import (
    BUNDLED_TOKENIZER,
    Processes,
    _answers,
    context_switches,
    cpu_seconds,
    database_seconds,
    free_port,
    main_thread,
    wait_until,
)
from bench.memory import growth_per_10k, long_key
from bench.overhead import round_order
from bench.report import RESULT_PREFIX
from bench.runs import watch
from bench.summary import headline
from tests.conftest import POSTGRES_URL, REDIS_URL, ROOT
from tests.isolation import create_database


def bench_env(workdir: Path) -> dict[str, str]:
    """A benchmark subprocess's environment: the tests' services and a directory of its own."""
    return {**os.environ, "DATAGEN_BENCH_REDIS_URL": REDIS_URL,
            "DATAGEN_BENCH_POSTGRES_URL": POSTGRES_URL, "DATAGEN_BENCH_DIR": str(workdir)}


def _flags(argv: list[str]) -> dict[str, list[str]]:
    return {name: cmd[3:] for name, cmd in commands(parse(argv))}


def test_overhead_profiles_at_full_scale_only() -> None:
    full, quick = _flags([]), _flags(["--quick"])
    assert full["overhead"] == ["--profile"]
    assert quick["overhead"] == ["--quick"]
    assert "--profile" not in _flags(["--no-profile"])["overhead"]
    # Beside it, every leg on a worker process per core, never profiled (py-spy follows one).
    assert full["overhead-per-core"] == ["--workers", "cores"]
    assert quick["overhead-per-core"] == ["--workers", "cores", "--quick"]
    assert list(_flags(["--only", "guard,memory"])) == ["memory", "guard"]


def _summary(rate: float, low: float, high: float) -> dict[str, float]:
    return {"median": rate, "min": low, "max": high, "n": 3}


def test_overhead_rows_judge_each_ratio_and_rate_against_its_target() -> None:
    overhead = {
        "bare": {"rate": _summary(600, 590, 610)},
        "sqlite": {"rate": _summary(540, 500, 600), "ratio_to_bare": _summary(0.9, 0.8, 1)},
        "postgresql": {"rate": _summary(380, 350, 420), "ratio_to_bare": _summary(0.63, 0.6, 0.7)},
    }
    rows = {figure: (value, verdict) for _, figure, value, _, verdict in
            headline({"overhead": overhead})}
    assert rows["pipeline sqlite, completions/s"] == ("540", "met")
    assert rows["pipeline sqlite / bare (requests)"] == ("0.900", "met")
    assert rows["pipeline postgresql / bare (requests)"] == ("0.630", "MISSED")
    assert rows["pipeline postgresql, completions/s"] == ("380", "MISSED")
    assert rows["bare Celery task (requests), completions/s"] == ("600", "-")
    per_core = {figure: (value, verdict) for bench, figure, value, _, verdict in
                headline({"overhead-per-core": {**overhead, "workers": 2}})}
    assert per_core["pipeline sqlite / bare (requests), 2 worker processes"] == (
        "0.900", "met")


def test_the_guards_reference_case_is_shown_but_not_judged() -> None:
    def case(p99: float, reference: bool = False) -> dict[str, float | bool]:
        return {"n": 200, "p50_ms": p99 / 2, "p99_ms": p99, "max_ms": p99, "reference": reference}

    guard = {"cases": {"after_close abort, sqlite, 64 in flight": case(60.0),
                       "after_close abort, sqlite, 64 in flight, old way": case(80.0, True)}}
    rows = {figure: (target, verdict) for _, figure, _, target, verdict in
            headline({"guard": guard})}
    assert rows["p99 ms, after_close abort, sqlite, 64 in flight"] == ("< 50", "MISSED")
    assert rows["p99 ms, after_close abort, sqlite, 64 in flight, old way (reference)"] == \
        ("-", "-")


def test_a_benchmark_that_failed_or_did_not_run_says_so() -> None:
    rows = headline({"producer": None, "saturation": {"ratio": _summary(0.99, 0.98, 1.0)}})
    assert rows[0] == ("producer", "-", "-", "-", "failed")
    assert rows[1][2:] == ("0.990", ">= 0.97", "met")
    missing = headline({"overhead": {"bare": {}}})
    assert all(verdict == "not run" for *_, verdict in missing[1:])


def test_the_bench_database_is_created_on_a_server_that_lacks_it() -> None:
    url = sa.make_url(POSTGRES_URL).set(database=f"bench_{uuid.uuid4().hex[:12]}")
    admin = sa.create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        create_database(url)
        create_database(url)  # a second time finds it there
        with admin.connect() as conn:
            names = conn.scalars(sa.text("SELECT datname FROM pg_database")).all()
        assert url.database in names
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{url.database}"'))
        admin.dispose()


def test_context_switches_count_every_thread_of_the_process() -> None:
    """A second thread's blocking calls show in the process's count, not only the main
    thread's (/proc/PID/status alone would miss them)."""
    napped, release = threading.Event(), threading.Event()

    def nap() -> None:
        for _ in range(20):
            time.sleep(0.002)  # each sleep blocks the thread: a voluntary switch
        napped.set()
        release.wait()  # stay alive, so the count still holds this thread's switches

    before = context_switches(os.getpid())
    t = threading.Thread(target=nap)
    t.start()
    napped.wait()
    after = context_switches(os.getpid())
    release.set()
    t.join()
    assert after - before >= 20


def test_the_main_threads_own_cpu_and_switches_leave_out_the_other_threads() -> None:
    """What the overhead benchmark reports as the consumer: the main thread only."""
    spun, release = threading.Event(), threading.Event()

    def spin() -> None:
        while time.thread_time() < 0.3:  # CPU of this thread, however busy the machine
            pass
        for _ in range(20):
            time.sleep(0.002)
        spun.set()
        release.wait()

    pid = os.getpid()
    cpu0, switches0 = main_thread(pid)
    process0 = cpu_seconds(pid)
    t = threading.Thread(target=spin)
    t.start()
    spun.wait()
    cpu1, switches1 = main_thread(pid)
    process1, all_switches = cpu_seconds(pid), context_switches(pid)
    release.set()
    t.join()
    assert process1 - process0 >= 0.25  # the other thread's 0.3 s, in 10 ms ticks
    assert cpu1 - cpu0 < 0.1  # the main thread only waited
    assert switches1 - switches0 < 20 <= all_switches - switches1


def test_the_database_servers_cpu_counts_the_backend_that_worked() -> None:
    """A backend that spends CPU shows it under its pid; SQLite has no server to count."""
    engine = sa.create_engine(POSTGRES_URL, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        pid = conn.scalar(sa.text("SELECT pg_backend_pid()"))
        before = database_seconds(POSTGRES_URL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # at least 0.3 s of this backend's CPU
            conn.scalar(sa.text("SELECT count(*) FROM generate_series(1, 2000000)"))
            if database_seconds(POSTGRES_URL)[f"database:{pid}"] - before[f"database:{pid}"] \
                    >= 0.3:
                break
        else:
            pytest.fail("the backend's CPU never showed")
    engine.dispose()
    assert database_seconds("sqlite:////tmp/x.db") == {}


def test_a_leg_that_stops_progressing_fails_fast_naming_the_cause(tmp_path: Path) -> None:
    """A leg whose server finishes nothing (workers failing every task) or whose process
    died fails within seconds, not at the leg's full timeout."""
    port = free_port()
    with Processes() as procs:
        sim = procs.start([sys.executable, "-m", "ops.cli", "sim", "--host", "127.0.0.1",
                           "--port", str(port), "--tokenizer", str(BUNDLED_TOKENIZER)],
                          log=tmp_path / "sim.log")
        url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: _answers(url), 30), "the simulator did not start"
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no request finished for 1s"):
            watch(url, 5, {"sim": sim.pid}, timeout_s=60, stall_s=1)
        assert time.monotonic() - t0 < 30
        done = subprocess.Popen([sys.executable, "-c", "pass"])
        done.wait()
        with pytest.raises(RuntimeError, match="gone exited after 0 of 5 requests"):
            watch(url, 5, {"sim": sim.pid, "gone": done.pid}, timeout_s=60)


@pytest.mark.serial
def test_make_bench_runs_end_to_end_at_quick_scale(tmp_path: Path,
                                                   redis_client: redis.Redis) -> None:
    """The guard and overhead benchmarks, quick, on the test services: the harness starts the
    simulator, pipeline workers on both databases and the bare tasks, and the summary
    judges what they measured. Their figures are not asserted (this machine is shared)."""
    out = tmp_path / "results.json"
    env = bench_env(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--only", "guard,overhead",
         "--out", str(out)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    for kind in ("sqlite", "postgresql", "bare"):
        assert results["overhead"][kind]["rate"]["median"] > 0, kind
        # Every task blocks at least on its HTTP answer: a worker that made no switch
        # would mean the count reads the wrong process or threads.
        assert results["overhead"][kind]["worker_switches_per_task"]["median"] >= 1, kind
    # Only the PostgreSQL leg has a database server's processes to count.
    assert results["overhead"]["postgresql"]["database_cpu_ms_per_task"]["median"] > 0
    assert results["overhead"]["sqlite"]["database_cpu_ms_per_task"]["median"] == 0
    assert results["overhead"]["sqlite"]["ratio_to_bare"]["n"] == 2
    assert any("crossing" in case for case in results["guard"]["cases"])
    # The close with every rid sent to every server is the one case marked as a reference.
    marked = [case for case, v in results["guard"]["cases"].items() if v["reference"]]
    assert len(marked) == 1 and marked[0].endswith("every rid to every server"), marked
    assert "not run" not in done.stdout and "failed" not in done.stdout


def test_the_redis_count_goes_on_after_a_quiet_second(redis_client: redis.Redis) -> None:
    """A worker whose requests all take seconds sends nothing for seconds: the count must
    still take what it sends after."""
    with RedisMonitor(REDIS_URL) as mon:
        time.sleep(1.2)
        for k in range(3):
            redis_client.set(f"bench-monitor-{k}", k)
    redis_client.delete(*(f"bench-monitor-{k}" for k in range(3)))
    assert mon.direct["SET"] == 3, mon.direct


@pytest.mark.serial
def test_the_fleet_projection_counts_costs_at_a_paced_rate(tmp_path: Path,
                                                          redis_client: redis.Redis) -> None:
    """The scaling benchmark, cut short: the paced run really is paced (a fraction of the
    instant server's rate), its counts and an idle worker's are taken, and the projection
    says which costs it uses."""
    env = bench_env(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "bench.scaling", "--quick", "--workers", "1",
         "--samples", "300", "--cost-samples", "100", "--paced-samples", "64"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "(sqlite, costs paced)" in done.stdout, done.stdout[-3000:]
    result = next(json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines()
                  if line.startswith("bench-result "))
    full, paced = result["sqlite_x1"], result["paced_sqlite"]
    # 64 answers at a time, each taking seconds: a few a second, where the instant server
    # gives hundreds.
    assert 0 < paced["rate"] < full["rate"]["median"] / 3, (paced, full)
    counted = result["paced_costs_sqlite"]
    assert counted["worker_redis"] > 0 and counted["worker_sql"] > 0, counted
    # An idle worker still polls for work: its commands and CPU are measured, not assumed.
    assert counted["idle_redis_per_s"] > 0, counted
    assert paced["idle_worker_core_pct"] > 0, paced


def test_the_overhead_legs_take_turns_in_each_place_of_a_round() -> None:
    kinds = ["sqlite", "postgresql", "sqlite@baseline", "postgresql@baseline", "bare"]
    orders = [round_order(kinds, i) for i in range(4)]
    assert orders[0] == orders[2] == kinds and orders[1] == orders[3] == kinds[::-1]
    # Over two rounds every leg is as often early as late: its places add up the same.
    places = {k: sum(order.index(k) for order in orders[:2]) for k in kinds}
    assert set(places.values()) == {len(kinds) - 1}


def test_a_benchmark_run_alone_makes_its_directory(tmp_path: Path) -> None:
    """`python -m bench.<name>` on a fresh machine: the simulator, usually the first
    thing a benchmark starts, takes the bench directory and makes it for its log."""
    workdir = tmp_path / "not-yet"
    code = ("from bench.harness import Processes, start_sim\n"
            "with Processes() as procs:\n"
            "    print(start_sim(procs, slots=4)[0])\n")
    env = bench_env(workdir)
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("http://127.0.0.1:")
    assert (workdir / "sim.log").stat().st_size > 0


@pytest.mark.serial
def test_the_overhead_legs_run_on_as_many_worker_processes_as_asked(
        tmp_path: Path, redis_client: redis.Redis) -> None:
    """``--workers 2``: every leg, the bare tasks' included, is measured over two worker
    processes, so the ratio compares the same settings."""
    env = bench_env(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "bench.overhead", "--dbs", "sqlite", "--samples", "200",
         "--rounds", "1", "--workers", "2", "--concurrency", "8"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith(RESULT_PREFIX))
    results = json.loads(line.removeprefix(RESULT_PREFIX))
    for kind in ("sqlite", "bare"):
        assert results[kind]["worker_processes"] == 2, kind
        assert results[kind]["rate"]["median"] > 0, kind
    assert "2 worker process(es) at c=8" in done.stdout


@pytest.mark.serial
def test_the_long_memory_run_settles_each_part_as_new_prompts(tmp_path: Path,
                                                              redis_client: redis.Redis) -> None:
    """``bench.memory``'s long run, cut short, on both databases: every part is a new
    set of prompts, all settled by the one worker before its RSS is read, so each run's
    results table ends with every sample of every part, once."""
    env = bench_env(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "bench.memory", "--quick", "--concurrency", "64",
         "--samples", "200", "--queued", "200", "--long", "600", "--long-parts", "3",
         "--long-dbs", "sqlite,postgresql"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = next(json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines()
                  if line.startswith("bench-result "))
    for kind in ("sqlite", "postgresql"):
        long = result[long_key(kind)]
        assert [p["samples"] for p in long["points"]] == [0, 200, 400, 600], (kind, long)
        assert all(p["rss"] > 0 for p in long["points"]), (kind, long)
        assert long["end"] == long["points"][-1]["rss"]
    assert _stored(POSTGRES_URL) == (600, 600, 0)  # nothing after the run empties it
    assert _stored(f"sqlite:///{tmp_path / 'memory-long.db'}") == (600, 600, 0)


def _stored(url: str) -> tuple[int, int, int]:
    """Results, distinct samples among them, and prompts not done."""
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        rows, distinct = conn.execute(sa.text(
            "SELECT COUNT(*), COUNT(DISTINCT dataset || '/' || sample_id) FROM results")).one()
        queued = conn.execute(sa.text(
            "SELECT COUNT(*) FROM prompts WHERE state != 'done'")).scalar()
    engine.dispose()
    return int(rows), int(distinct), int(queued)


def test_the_long_runs_growth_is_read_over_its_second_half() -> None:
    points = [{"samples": 20_000.0 * k, "rss": rss} for k, rss in
              enumerate([80.0, 130.0, 150.0, 160.0, 165.0, 170.0])]
    # From 60,000 samples (the first point past halfway) to 100,000: 10 MB over 40,000.
    assert growth_per_10k(points) == pytest.approx(2.5)
    assert growth_per_10k(points[:3]) == pytest.approx(10.0)  # from 20,000 to 40,000
    assert growth_per_10k(points[:2]) == 0.0  # one part: no second half to read


def test_the_prefix_cache_report_puts_the_legs_side_by_side() -> None:
    from bench.prefix_cache import report

    leg = {"requests": 8, "prompt": 1000, "cached": 0, "prefilled": 1000,
           "later_prompt": 800, "later_cached": 0, "retracted": 0, "gpu_s": 10.0,
           "wall_s": 2.0}
    ahead = {**leg, "cached": 600, "prefilled": 400, "later_cached": 600, "gpu_s": 8.0}
    lines = report(ahead, leg)
    assert lines[0].split() == ["ahead", "fifo", "ahead/fifo"]
    rows = {line[:40].strip(): line[40:].split() for line in lines[1:]}
    assert rows["prompt tokens prefilled (computed)"] == ["400", "1,000", "0.400"]
    assert rows["simulated GPU time, s"] == ["8", "10", "0.800"]
    assert rows["cache hit rate, turns 2-4"][:2] == ["0.750", "0.000"]


def _leg(concurrency: int | str, whole: float, window: float = 300, running: float = 30,
         inflight: float = 36, at_close: int = 3) -> dict[str, object]:
    return {"concurrency": concurrency, "whole_tok_per_s": whole, "tok_per_s": window,
            "median_running": running, "median_inflight": inflight,
            "inflight_at_close": at_close}


def test_concurrency_compares_the_median_legs_of_each_concurrency() -> None:
    # Fixed 64's lucky draw (350) is not its figure: the median of its three legs is.
    legs = [_leg("auto", 335), _leg(16, 334, inflight=16), _leg(64, 350, inflight=64),
            _leg(64, 330, inflight=64), _leg(64, 338, inflight=64),
            _leg(16, 333, inflight=16), _leg("auto", 333, at_close=5),
            _leg("auto", 337, running=31, inflight=38)]
    s = concurrency_summary("agentic", legs)
    assert s["medians"] == {"auto": 335, "16": 333.5, "64": 338}
    assert (s["best_fixed"], s["best_fixed_tok_per_s"]) == (64, 338)
    assert s["ratio"] == pytest.approx(335 / 338)
    # In flight: auto's worst leg, against the most any leg kept running.
    assert (s["auto_inflight"], s["auto_inflight_at_close"]) == (38, 5)
    assert s["running_capacity"] == 31 and s["inflight_vs_capacity"] == pytest.approx(38 / 31)


def test_concurrency_judges_the_stored_rate_and_shows_the_window_beside() -> None:
    # 512 decodes the most in the window (a deep queue putting recompute off), 64 stores
    # the most over the leg: the target's ratio is on the stored rate, each with its best.
    legs = [_leg("auto", 300, window=310), _leg(64, 306, window=302),
            _leg(512, 296, window=321)]
    s = concurrency_summary("agentic", legs)
    assert (s["best_fixed"], s["ratio"]) == (64, pytest.approx(300 / 306))
    assert (s["window_best_fixed"], s["window_ratio"]) == (512, pytest.approx(310 / 321))
    assert s["window_medians"] == {"auto": 310, "64": 302, "512": 321}


def test_concurrency_polls_once_a_server_second_at_any_time_scale() -> None:
    from bench.concurrency import parse
    from bench.harness import MIN_POLL_S, scaled_poll_s

    assert parse([]).poll == 1.0  # the worker's default, read as the server's seconds
    assert scaled_poll_s(5.0, 1.0) == pytest.approx(0.2)
    assert scaled_poll_s(30.0) == pytest.approx(1 / 30)
    assert scaled_poll_s(1000.0) == MIN_POLL_S


def test_concurrency_longer_scales_the_budget() -> None:
    from bench.concurrency import SHAPES, parse

    agentic = SHAPES["agentic"]
    assert agentic.budget_tokens(False, 4) == 4 * agentic.budget_tokens(False)
    assert agentic.budget_tokens(True, 4) == agentic.budget_tokens(True)  # --quick wins
    assert parse(["--longer", "4", "--legs", "auto,64"]).longer == 4
    assert parse([]).longer == 1


def test_concurrency_figures_split_the_leg_into_start_window_and_close() -> None:
    from bench.concurrency import Watch, figures

    # Budget 1,000 tokens: the window runs from 200 to 700 generated tokens.
    def sample(clock: float, generated: int, charged: int,
               owed: int = 0) -> dict[str, object]:
        return {"sim_clock_s": clock, "generated_tokens": generated, "charged": charged,
                "running": 4, "waiting": 1, "waiting_retracted": owed,
                "waiting_retracted_tokens": 100 * owed}

    watch = Watch.__new__(Watch)
    watch.samples = [sample(0, 0, 0), sample(5, 50, 0), sample(10, 200, 100),
                     sample(20, 450, 300), sample(30, 700, 600, owed=2),
                     sample(49, 990, 880, owed=3), sample(50, 1000, 900)]
    watch.closed_at = 0.0
    f = figures(watch, [], 1000)
    assert f["tok_per_s"] == pytest.approx(500 / 20) and f["window_sim_s"] == 20
    assert f["head_tok_per_s"] == pytest.approx(150 / 5)  # first token (clock 5) to 10
    assert f["tail_tok_per_s"] == pytest.approx(300 / 20)
    assert f["whole_tok_per_s"] == pytest.approx(900 / 45)
    # Retracted requests waiting at the window's end, and at the reading before the close.
    assert (f["owed_at_end"], f["owed_tokens_at_end"]) == (2, 200)
    assert (f["owed_at_close"], f["owed_tokens_at_close"]) == (3, 300)


@pytest.mark.parametrize("stream", [True, False], ids=["drain", "plain"])
def test_the_bare_task_makes_the_pipelines_call_streamed_where_it_streams(
        sim: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    """The overhead's baseline sends the body the pipeline sends: a drain dataset's
    request streamed, with the stream's interval, and reads its answer whole."""
    payloads = tmp_path / "payloads.json"
    payloads.write_text(json.dumps({"d/s1": {
        "input_ids": [11, 12, 13], "sampling": {"max_new_tokens": 8}, "stream": stream}}))
    monkeypatch.setenv("DATAGEN_BENCH_PAYLOADS", str(payloads))
    monkeypatch.setenv("DATAGEN_SGLANG_URL", sim)
    monkeypatch.setenv("DATAGEN_REDIS_URL", REDIS_URL)
    bare = importlib.reload(importlib.import_module("bench.bare_worker"))
    tokens = bare.generate.run("d", "s1")
    log = requests.get(f"{sim}/sim/requests", timeout=5).json()
    assert [r["stream"] for r in log] == [stream]
    assert tokens == log[0]["completion_tokens"] > 0
