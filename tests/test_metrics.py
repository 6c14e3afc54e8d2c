"""Workers' /metrics: scraped and parsed as Prometheus does while a run goes on, and equal
to SQL at its end; a port two workers cannot share; a scrape while Redis is away."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
import requests
import sqlalchemy as sa
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from common.budget import Budget
from common.ledger import Ledger
from common.schema import prompts, results
from common.settings import Settings
from common.store import Store
from ops.localredis import free_port
from tests.conftest import ROOT
from tests.helpers import enqueue_paths, wait_settled, write_dataset
from workers.metrics import LedgerCollector, WorkerMetrics

Scrape = dict[str, list[Sample]]
CAPPED_BUDGET = 1_500
TRANSIENT, PERMANENT = 3, 2  # 500s, then 400s, the simulator answers


def scrape(port: int) -> Scrape:
    """One scrape of a worker, parsed with the Prometheus text parser: samples by name."""
    body = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out: Scrape = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(scrapes: list[Scrape], name: str, **labels: str) -> float:
    """The sum over ``scrapes`` (one per worker) of the samples with these labels."""
    return sum(s.value for one in scrapes for s in one.get(name, [])
               if all(s.labels.get(k) == v for k, v in labels.items()))


@contextmanager
def workers(settings: Settings, ports: list[int],
            log: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``datagen worker`` processes on this host, one metrics port each."""
    procs = []
    for i, port in enumerate(ports):
        env = {**os.environ, **settings.replace(metrics_port=port).to_env()}
        with open(log / f"worker{i}.log", "wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "ops.cli", "worker", "-c", "4", "--loglevel", "INFO",
                 "-n", f"metrics{i}@localhost"], env=env, stdout=out, stderr=subprocess.STDOUT))
    try:
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)


def wait_for(check: object, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout_s:.0f}s")


def sql_counts(store: Store) -> dict[str, dict[str, float]]:
    """Per dataset, what the counters must equal: results by finish reason, their output
    tokens, failed prompts, and the attempts that were retried (every counted attempt of a
    prompt, but a failed prompt's last)."""
    retried = sa.case((prompts.c.state == "failed", prompts.c.attempts - 1),
                      else_=prompts.c.attempts)
    out: dict[str, dict[str, float]] = {}
    with store.engine.connect() as conn:
        for ds, reason, n, tokens in conn.execute(
                sa.select(results.c.dataset, results.c.finish_reason, sa.func.count(),
                          sa.func.sum(results.c.completion_tokens))
                .group_by(results.c.dataset, results.c.finish_reason)):
            row = out.setdefault(ds, {})
            row[f"done:{reason}"] = n
            row["done"] = row.get("done", 0) + n
            row["tokens"] = row.get("tokens", 0) + int(tokens)
        for ds, failed, again in conn.execute(
                sa.select(prompts.c.dataset,
                          sa.func.sum(sa.case((prompts.c.state == "failed", 1), else_=0)),
                          sa.func.sum(retried)).group_by(prompts.c.dataset)):
            out.setdefault(ds, {}).update(failed=int(failed), retried=int(again))
    return out


def counted(scrapes: list[Scrape], names: list[str]) -> dict[str, dict[str, float]]:
    """The same figures from the workers' counters."""
    out: dict[str, dict[str, float]] = {}
    for ds in names:
        row = out[ds] = {}
        for s in (s for one in scrapes for s in one.get("datagen_samples_done_total", [])):
            if s.labels["dataset"] == ds:
                key = f"done:{s.labels['finish_reason']}"
                row[key] = row.get(key, 0) + s.value
                row["done"] = row.get("done", 0) + s.value
        row["tokens"] = value(scrapes, "datagen_sample_output_tokens_sum", dataset=ds)
        row["failed"] = value(scrapes, "datagen_samples_failed_total", dataset=ds)
        row["retried"] = value(scrapes, "datagen_sample_retries_total", dataset=ds,
                               reason="error")
    return {ds: {k: v for k, v in row.items() if v or k in ("failed", "retried")}
            for ds, row in out.items()}


def test_metrics_scraped_while_a_run_goes_on_equal_sql_at_its_end(
    settings: Settings, sim: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    settings = settings.replace(max_attempts=2)
    names = ["wide", "capped"]
    store, ledger = Store(settings.database_url), Ledger(redis_client)
    ports = [free_port(), free_port()]
    # Slow enough that scrapes see requests in flight; the first requests fail, the
    # first three with a 500 (retried), then two with a 400 (failed at once).
    requests.post(f"{sim}/sim/faults", json={"latency_s": 0.15, "fail_next": TRANSIENT,
                                             "error_status": 500}, timeout=5)
    with workers(settings, ports, tmp_path) as procs:
        wait_for(lambda: all(value([scrape(p)], "datagen_worker_up") == 1 for p in ports),
                 "both workers consuming")
        enqueue_paths(settings, [str(write_dataset(tmp_path, "wide", 60))])
        enqueue_paths(settings, [str(write_dataset(tmp_path, "capped", 60))],
                      Budget(CAPPED_BUDGET, policy="exact"))
        wait_for(lambda: requests.get(f"{sim}/sim/faults", timeout=5).json()["fail_next"] == 0,
                 "the 500s answered")
        requests.post(f"{sim}/sim/faults", json={"fail_next": PERMANENT, "error_status": 400},
                      timeout=5)
        during: list[list[Scrape]] = []

        def settled() -> bool:
            during.append([scrape(p) for p in ports])
            left = sum(store.prompt_counts(n).get("queued", 0) for n in names
                       if store.dataset(n).state != "closed")
            return left == 0

        wait_for(settled, "the run settled")
        wait_settled(store, names, timeout_s=5)
        # Seen mid-run: requests in flight, messages queued, tokens charged below the end.
        assert any(value(s, "datagen_requests_in_flight") > 0 for s in during)
        assert any(value(s[:1], "datagen_dataset_queued_messages") > 0 for s in during)
        # A task's counters move just after its commit: wait for them to catch up.
        expected = sql_counts(store)
        final: list[Scrape] = []

        def caught_up() -> bool:
            final[:] = [scrape(p) for p in ports]
            return counted(final, names) == expected

        try:
            wait_for(caught_up, "the counters equal SQL", timeout_s=15)
        except AssertionError:
            assert counted(final, names) == expected
        for p in procs:
            assert p.poll() is None, "a worker exited"

    assert expected["wide"]["failed"] + expected["capped"]["failed"] == PERMANENT
    assert expected["wide"]["retried"] + expected["capped"]["retried"] == TRANSIENT
    # Both workers did some of the work.
    assert all(value([s], "datagen_samples_done_total") > 0 for s in final)
    # Every answered request of the uncapped dataset was timed and stored.
    assert value(final, "datagen_request_duration_seconds_count", dataset="wide") == \
        expected["wide"]["done"]
    assert value(final, "datagen_sample_output_tokens_count", dataset="wide") == \
        expected["wide"]["done"]
    assert value(final, "datagen_requests_in_flight") == 0
    assert not [n for one in final for n in one if n.endswith("_created")]  # not stored twice
    # The ledger as each worker reads it at the scrape, and the close it made.
    for one in final:
        for name in names:
            state = ledger.state(name)
            assert value([one], "datagen_dataset_used_tokens", dataset=name) == state.used_tokens
            assert value([one], "datagen_dataset_budget_tokens", dataset=name) == \
                state.budget_tokens
        assert value([one], "datagen_dataset_open", dataset="capped") == 0
        assert value([one], "datagen_dataset_open", dataset="wide") == 1
        assert value([one], "datagen_dataset_closed_timestamp_seconds", dataset="capped",
                     reason="budget") == ledger.state("capped").closed_at
        assert value([one], "datagen_ledger_up") == 1
        assert value([one], "datagen_worker_threads") == 4
        started = value([one], "datagen_worker_start_time_seconds")
        assert 0 < started <= value([one], "datagen_worker_last_heartbeat_timestamp_seconds")
    assert ledger.state("capped").used_tokens == CAPPED_BUDGET
    assert value(final, "datagen_dataset_closes_total", dataset="capped", reason="budget") == 1
    assert value(final, "datagen_dataset_closes_total", dataset="wide") == 0
    last = max(value([s], "datagen_worker_last_store_timestamp_seconds") for s in final)
    with store.engine.connect() as conn:
        newest = conn.scalar(sa.select(sa.func.max(results.c.created_at)))
    assert newest is not None and abs(last - newest.timestamp()) < 60


def test_two_workers_cannot_share_a_port(settings: Settings, tmp_path: Path) -> None:
    """The second worker on a port exits 2 with one line saying what to do."""
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, **settings.replace(metrics_port=port).to_env()}
        done = subprocess.run([sys.executable, "-m", "ops.cli", "worker", "-c", "2"], env=env,
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"DATAGEN_METRICS_PORT={port}: cannot serve /metrics there" in done.stderr
    assert "a port of its own" in done.stderr


def test_a_worker_waiting_for_redis_is_scraped_as_not_up(settings: Settings,
                                                          tmp_path: Path) -> None:
    """/metrics answers from the start: a worker still waiting for its services is seen."""
    port = free_port()
    away = settings.replace(redis_url="redis://127.0.0.1:1/0", start_wait_s=120)
    with workers(away, [port], tmp_path) as [proc]:
        wait_for(lambda: scrape(port), "the waiting worker's /metrics")
        first = scrape(port)
        assert proc.poll() is None
    assert value([first], "datagen_worker_up") == 0
    assert value([first], "datagen_ledger_up") == 0
    assert value([first], "datagen_worker_start_time_seconds") > 0


def test_a_scrape_while_redis_is_away_says_so_and_answers() -> None:
    metrics = WorkerMetrics()
    metrics.registry.register(LedgerCollector(Ledger(redis.Redis(port=1, socket_timeout=1))))
    text = generate_latest(metrics.registry).decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["datagen_ledger_up"] == 0
    assert samples["datagen_worker_start_time_seconds"] > 0
    assert "process_cpu_seconds_total" in samples


DASHBOARD = ROOT / "monitoring" / "grafana" / "dashboards" / "datagen.json"
# The series each Prometheus type adds to its family's name.
SERIES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
          "summary": ("_sum", "_count"), "gauge": ("",), "info": ("_info",)}


def exported(text: str) -> set[str]:
    """Every series name a scrape's text declares, samples or not (a labelled counter no
    task has moved yet is declared all the same)."""
    return {family.name + suffix for family in text_string_to_metric_families(text)
            for suffix in SERIES.get(family.type, ("",))}


def queries(node: object) -> Iterator[str]:
    """Every PromQL expression of a dashboard: panels' targets, annotations, variables."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            else:
                yield from queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from queries(item)


def test_the_dashboard_queries_only_what_workers_and_sglang_export(ledger: Ledger,
                                                                   sim: str) -> None:
    board = json.loads(DASHBOARD.read_text())
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        box = p["gridPos"]
        assert box["x"] + box["w"] <= 24, p["title"]
        assert p["type"] == "row" or p["targets"], p["title"]
    ledger.configure("probe", Budget(1_000))
    metrics = WorkerMetrics()
    metrics.registry.register(LedgerCollector(ledger))
    ours = exported(generate_latest(metrics.registry).decode())
    sglang = exported(requests.get(f"{sim}/metrics", timeout=5).text)
    asked = list(queries(board))
    used = {name for q in asked for name in re.findall(r"\b(?:datagen|process)_\w+", q)}
    assert {n for n in used if n.startswith("datagen_")}, "the board queries no datagen metric"
    assert used <= ours, f"not exported by a worker: {sorted(used - ours)}"
    used_sglang = {name for q in asked for name in re.findall(r"\bsglang:\w+", q)}
    assert used_sglang <= sglang, f"not exported by SGLang: {sorted(used_sglang - sglang)}"
    # The board's dataset variable lists the datasets a worker's scrape names.
    variable = board["templating"]["list"][0]
    assert variable["name"] == "dataset"
    assert re.findall(r"\bdatagen_\w+", variable["definition"])[0] in ours


# Grafana's variables, as a query would have them filled in.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "1h", "$dataset": ".*"}


def test_prometheus_parses_its_config_and_every_query_of_the_board(tmp_path: Path) -> None:
    """``promtool`` (Debian's prometheus package) reads the scrape configuration, and the
    board's expressions as recording rules: a PromQL syntax error fails here."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (CI: apt-get install -y prometheus)")
    config = ROOT / "monitoring" / "prometheus.yml"
    done = subprocess.run([promtool, "check", "config", str(config)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    board = json.loads(DASHBOARD.read_text())
    variable = board["templating"]["list"][0]["definition"]  # Grafana's, not PromQL
    exprs = [q for q in queries(board) if q != variable]
    for name, filled in GRAFANA_VARIABLES.items():
        exprs = [q.replace(name, filled) for q in exprs]
    assert not [q for q in exprs if "$" in q], "a Grafana variable left unfilled"
    rules = tmp_path / "board.yml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "board", "rules": [
        {"record": f"board_query_{i}", "expr": q} for i, q in enumerate(exprs)]}]}))
    done = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(exprs)} rules found" in done.stdout
