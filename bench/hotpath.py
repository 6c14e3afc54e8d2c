"""The worker's per-task steps in isolation, one at a time and grouped (µs per call).

Single thread, sequential calls, same data, side by side:
  * the /generate call: a bare ``requests`` session (``trust_env`` on: proxy and netrc
    lookups in os.environ on every request; and off) vs ``SGLangClient.generate`` (the
    same, ``trust_env`` off, with its error sorting and the answer's checks);
  * a prompt read and a result's store one at a time (``Store.prompt``,
    ``Store.save_result``) vs 8 at a time as the worker's groups do (``Store.prompts``,
    ``Store.save_results``), per prompt;
  * the ledger's scripts of a task (``admit`` + ``charge``), one at a time vs 8 in one
    batched script call each (``admit_many``, ``charge_many``), per task;
  * a connection pool under 64 threads: SQLAlchemy's default for SQLite vs 64 slots;
  * Prometheus metrics: a sample's updates on the task's path (in flight and latency
    around the request, the stored counter and output histogram), and one scrape of a
    worker's registry with the ledgers of 10 datasets read from Redis.

    python -m bench.hotpath [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import requests
import sqlalchemy as sa

from bench.harness import Processes, bench_settings, fresh_db, fresh_redis, start_sim
from bench.report import Summary, emit, table
from bench.synth import enqueue, prompt_files
from common.budget import Budget
from common.db import pooled_engine
from common.ledger import AdmitArgs, ChargeArgs, Ledger
from common.rows import ResultRow
from common.sglang_client import SGLangClient
from common.store import Store
from workers.metrics import LedgerCollector, WorkerMetrics

# Items per group in the grouped cases: about what a worker's groups hold at full rate.
GROUP = 8


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.hotpath", description=__doc__)
    p.add_argument("--quick", action="store_true", help="300 calls per case, 1 rep")
    p.add_argument("--calls", type=int, help="calls per case (default 1000)")
    p.add_argument("--reps", type=int, help="default 3")
    p.add_argument("--dbs", default="sqlite,postgresql")
    args = p.parse_args(argv)
    args.calls = args.calls or (300 if args.quick else 1000)
    args.reps = args.reps or (1 if args.quick else 3)
    return args


def prompt_caller(store: Store, keys: list[tuple[str, str]]) -> Callable[[int], Any]:
    return lambda i: store.prompt(*keys[i % len(keys)])


def per_call(fn: Callable[[int], Any], n: int) -> tuple[float, float]:
    """(wall µs, CPU µs of this thread) per call: CPU is what a GIL-bound worker pays."""
    t0, c0 = time.perf_counter(), time.thread_time()
    for i in range(n):
        fn(i)
    return 1e6 * (time.perf_counter() - t0) / n, 1e6 * (time.thread_time() - c0) / n


def http_cases(url: str, payloads: list[dict[str, Any]]) -> dict[str, Callable[[int], Any]]:
    default, plain = requests.Session(), requests.Session()
    plain.trust_env = False

    def post(session: requests.Session, i: int) -> Any:
        body = {**payloads[i % len(payloads)], "rid": uuid.uuid4().hex}
        return session.post(f"{url}/generate", json=body, timeout=(5, 60)).json()

    client = SGLangClient((url,), read_timeout_s=60)

    def lean(i: int) -> Any:
        p = payloads[i % len(payloads)]
        return client.generate(url, uuid.uuid4().hex, p["input_ids"], p["sampling_params"])

    return {"/generate, requests trust_env=True": lambda i: post(default, i),
            "/generate, requests trust_env=False": lambda i: post(plain, i),
            "/generate, SGLangClient.generate (as is)": lean}


def sql_cases(store: Store, keys: list[tuple[str, str]]) -> dict[str, Callable[[int], Any]]:
    fresh = itertools.count()  # every rep stores new rows, never a duplicate one

    def row(i: int, tag: str) -> ResultRow:
        ds, sid = keys[i % len(keys)]
        return ResultRow(dataset=ds, sample_id=f"{sid}-{tag}-{next(fresh)}",
                         rid=uuid.uuid4().hex,
                         prompt_tokens=300, completion_tokens=16, cached_tokens=0,
                         reasoning_tokens=0, finish_reason="stop", finish_detail={"type": "stop"},
                         output_ids=list(range(16)), output_text="t" * 60, e2e_latency_s=0.01,
                         server="http://127.0.0.1:9", model="sim")

    def grouped(i: int) -> Any:
        if i % GROUP == 0:
            store.save_results([row(i + k, "g") for k in range(GROUP)])

    def group_read(i: int) -> Any:
        if i % GROUP == 0:
            store.prompts([keys[(i + k) % len(keys)] for k in range(GROUP)])

    return {"Store.prompt, one a SELECT": lambda i: store.prompt(*keys[i % len(keys)]),
            f"Store.prompts, {GROUP} keys a SELECT (per prompt)": group_read,
            "Store.save_result, one a commit": lambda i: store.save_result(row(i, "a")),
            f"Store.save_results, {GROUP} rows a commit (per row)": grouped}


def ledger_cases(ledger: Ledger) -> dict[str, Callable[[int], Any]]:
    ledger.configure("hotpath", Budget(10**12, "output", "drain"))
    fresh = itertools.count()  # a new request and sample each call: never a duplicate charge

    def task() -> tuple[AdmitArgs, ChargeArgs]:
        n = next(fresh)
        return (AdmitArgs("hotpath", f"r{n}", 1024, 2048),
                ChargeArgs("hotpath", f"s{n}", f"r{n}", 300, 16))

    def single(_: int) -> Any:
        admit, charge = task()
        ledger.admit(admit.name, admit.rid, admit.max_new_tokens, admit.default_expected)
        ledger.charge(charge.name, charge.sample_id, charge.rid, charge.prompt_tokens,
                      charge.completion_tokens)

    def grouped(i: int) -> Any:
        if i % GROUP == 0:
            admits, charges = zip(*(task() for _ in range(GROUP)), strict=True)
            ledger.admit_many(list(admits))
            ledger.charge_many(list(charges))

    return {"Ledger.admit + Ledger.charge, one script a round trip": single,
            f"Ledger.admit_many + charge_many, {GROUP} a round (per task)": grouped}


def metrics_cases(ledger: Ledger, datasets: int = 10) -> dict[str, Callable[[int], Any]]:
    from prometheus_client import generate_latest

    names = [f"metrics{k}" for k in range(datasets)]
    for name in names:
        ledger.configure(name, Budget(10**7, "output", "drain"))
    metrics = WorkerMetrics()
    metrics.registry.register(LedgerCollector(ledger))
    rows = [ResultRow(dataset=name, sample_id="s", rid="r", prompt_tokens=300,
                      completion_tokens=500, finish_reason="stop", output_ids=[],
                      output_text="", server="", model="") for name in names]

    def sample(i: int) -> None:
        row = rows[i % datasets]
        with metrics.request(row.dataset):
            pass
        metrics.stored(row)

    return {"metrics: a sample's updates (request, stored)": sample,
            f"metrics: a scrape, {datasets} datasets' ledgers read": lambda _: generate_latest(
                metrics.registry)}


def pool_rate(store: Store, keys: list[tuple[str, str]], threads: int = 64,
              seconds: float = 2.0) -> float:
    """Store.prompt calls/s with ``threads`` threads sharing the store's pool."""
    stop, count, lock = time.monotonic() + seconds, [0], threading.Lock()

    def loop() -> None:
        i = 0
        while time.monotonic() < stop:
            store.prompt(*keys[i % len(keys)])
            i += 1
        with lock:
            count[0] += i

    workers = [threading.Thread(target=loop) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(seconds + 60)
    return count[0] / seconds


def variant_engines(store: Store) -> dict[str, sa.engine.Engine]:
    """The store's engine, one with 64 pool slots, and (PostgreSQL) one that pings each
    connection it hands out (SQLAlchemy's pre-ping) instead of looking at its socket."""
    url = store.engine.url.render_as_string(hide_password=False)
    variants = {"pool as configured": store.engine,
                "pool_size=64": pooled_engine(url, pool_size=64, max_overflow=0)}
    if store.engine.dialect.name == "postgresql":
        variants["pool_pre_ping=True"] = sa.create_engine(url, pool_size=8, max_overflow=64,
                                                          pool_pre_ping=True)
    return variants


def db_cases(kind: str, sim_url: str, n_prompts: int) -> tuple[Store, list[tuple[str, str]]]:
    fresh_redis()
    settings = bench_settings(fresh_db(kind, "hotpath"), sim_url)
    enqueue(settings, prompt_files(n_prompts), max_new_tokens=16)
    store = Store(settings.database_url)
    keys = [(ds, sid) for ds in store.dataset_names() for sid in store.sample_ids(ds, "queued")]
    return store, keys


def run(args: argparse.Namespace) -> dict[str, Any]:
    results_us: dict[str, list[tuple[float, float]]] = {}
    pools: dict[str, list[float]] = {}
    with Processes() as procs:
        url, _ = start_sim(procs, slots=64, decode=0, mean_output=16)
        for kind in (k for k in args.dbs.split(",") if k):
            store, keys = db_cases(kind, url, 600)
            payloads = [{"input_ids": store.prompt(*k).input_ids,  # type: ignore[union-attr]
                         "sampling_params": {"max_new_tokens": 16}, "stream": False}
                        for k in keys[:200]]
            cases = {**(http_cases(url, payloads) if kind == args.dbs.split(",")[0] else {}),
                     **{f"{k} [{kind}]": v for k, v in sql_cases(store, keys).items()},
                     **ledger_cases(Ledger(fresh_redis()))}
            if kind == args.dbs.split(",")[0]:
                cases.update(metrics_cases(Ledger(fresh_redis())))
            for _ in range(args.reps):
                for name, fn in cases.items():
                    results_us.setdefault(name, []).append(per_call(fn, args.calls))
                for label, engine in variant_engines(store).items():
                    default_engine, store.engine = store.engine, engine
                    if label.startswith("pool_pre_ping"):
                        results_us.setdefault(f"Store.prompt, {label} [{kind}]", []).append(
                            per_call(prompt_caller(store, keys), args.calls))
                    else:
                        pools.setdefault(f"{kind}, {label}", []).append(pool_rate(store, keys))
                    store.engine = default_engine
                    if engine is not default_engine:
                        engine.dispose()
            store.engine.dispose()
    fresh_redis()
    us = {k: Summary.of([w for w, _ in v]) for k, v in results_us.items()}
    cpu = {k: Summary.of([c for _, c in v]) for k, v in results_us.items()}
    table(f"worker steps, one at a time and grouped, {args.calls} sequential calls, "
          f"{args.reps} reps (µs per call, median [min-max])",
          ["case", "wall µs/call", "CPU µs/call (thread)"],
          [(k, v.fmt(0), cpu[k].fmt(0)) for k, v in us.items()])
    pool = {k: Summary.of(v) for k, v in pools.items()}
    table("Store.prompt from 64 threads for 2 s (calls/s)", ["pool", "calls/s"],
          [(k, v.fmt(0)) for k, v in pool.items()])
    return {"us_per_call": us, "cpu_us_per_call": cpu, "pool_calls_per_s": pool}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    emit("hotpath", args, run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
