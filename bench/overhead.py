"""Benchmark 2, overhead at the maximum rate: pipeline vs a bare Celery task.

An instant simulator (``--decode-tok-per-s 0 --mean-output-tokens 16``) makes the worker
the bottleneck. Legs alternate in one run: full pipeline on SQLite, on PostgreSQL, then
the bare task (same options, same messages, the same HTTP call through ``requests``), in
reverse every other round. Targets: pipeline / bare ≥ 0.8 and ≥ 400 completions/s.
``--profile`` adds a leg under py-spy (first database of ``--dbs``) and one of the bare
task, so their per-task CPU can be compared step by step.
``--baseline DIR`` adds, in each round, a leg per database whose worker runs the code of
another checkout (e.g. ``git archive HEAD | tar -x -C DIR``): old and new side by side.
``--workers N`` runs every leg, bare ones included, on N worker processes of
``--concurrency`` threads each (default one process of 64; ``cores``: one per core).
``--metrics`` adds, in each round, a leg per database whose worker serves Prometheus's
/metrics and is scraped every ``--scrape-s`` (1 s: fifteen times Prometheus's default
pace), beside the same leg with no metrics port: the cost of metrics on the hot path.

    python -m bench.overhead [--quick] [--profile] [--baseline DIR] [--workers N|cores]
                             [--metrics [--scrape-s S]]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import requests

from bench import profiling
from bench import runs as bench_runs
from bench.harness import (
    DATABASE,
    MACHINE,
    STEAL,
    WORKDIR,
    Processes,
    bench_settings,
    clean_workdir,
    fresh_db,
    fresh_redis,
    sim_requests,
    start_sim,
)
from bench.report import Summary, emit, table, verdict
from bench.runs import Leg, bare_celery_leg, pipeline_leg
from bench.synth import enqueue, prompt_files
from common.budget import POLICIES, Budget
from common.settings import Settings
from ops.localredis import free_port

TARGET_RATIO, TARGET_RATE = 0.8, 400.0
PROFILE_DELAY_S = 2.0
PROFILE_SAMPLES = 6000
PROFILE_RATE_HZ = 100


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__)
    p.add_argument("--quick", action="store_true", help="600 samples, 2 rounds")
    p.add_argument("--samples", type=int, help="samples per leg (default 3000)")
    p.add_argument("--rounds", type=int, help="rounds of (pipeline..., bare) (default 3)")
    p.add_argument("--dbs", default="sqlite,postgresql")
    p.add_argument("--concurrency", type=int, default=64, help="threads per worker process")
    p.add_argument("--workers", type=_processes, default=1,
                   help="worker processes per leg, the same in every leg: a number, or "
                        "'cores' for one per core this process may run on (default 1)")
    p.add_argument("--profile", action="store_true",
                   help="one more leg under py-spy, on the first of --dbs")
    p.add_argument("--baseline", type=Path, help="a checkout whose worker code to compare with")
    p.add_argument("--metrics", action="store_true",
                   help="a leg per database with /metrics served and scraped")
    p.add_argument("--policy", choices=POLICIES, default="drain",
                   help="the datasets' budget policy (default %(default)s: its requests are "
                        "streamed, to learn when they start, by the pipeline and the bare "
                        "task alike)")
    p.add_argument("--scrape-s", type=float, default=1.0,
                   help="seconds between scrapes in --metrics legs (default: %(default)s)")
    args = p.parse_args(argv)
    if args.metrics and args.workers > 1:
        p.error("--metrics runs one worker process per leg (one metrics port)")
    args.samples = args.samples or (600 if args.quick else 3000)
    args.rounds = args.rounds or (2 if args.quick else 3)
    return args


def _processes(value: str) -> int:
    if value == "cores":
        return len(os.sched_getaffinity(0))
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError("at least one worker process")
    return n


BASELINE_SUFFIX = "@baseline"
METRICS_SUFFIX = "+metrics"


def one_leg(procs: Processes, sim: tuple[str, int], args: argparse.Namespace, kind: str,
            n: int = 0, on_start: Any = None) -> Leg:
    n = n or args.samples
    db = ("sqlite" if kind.startswith("bare")
          else kind.removesuffix(BASELINE_SUFFIX).removesuffix(METRICS_SUFFIX))
    fresh_redis()
    settings = bench_settings(fresh_db(db, tag=db), sim[0], args.concurrency)
    enqueue(settings, prompt_files(n), Budget(policy=args.policy), max_new_tokens=1024)
    w = args.workers
    if kind == "bare":
        return bare_celery_leg(procs, "bare celery task", settings, sim, n, workers=w,
                               on_start=on_start)
    if kind.endswith(BASELINE_SUFFIX):
        with workers_from(args.baseline):
            return pipeline_leg(procs, f"pipeline {kind}", settings, sim, n, workers=w)
    if kind.endswith(METRICS_SUFFIX):
        settings = settings.replace(metrics_port=free_port())
        with scraped(settings.metrics_port, args.scrape_s) as scrapes:
            leg = pipeline_leg(procs, f"pipeline {kind}", settings, sim, n, workers=w,
                               on_start=on_start)
        leg.extra["scrapes"] = scrapes()
        return leg
    return pipeline_leg(procs, f"pipeline {kind}", settings, sim, n, workers=w,
                        on_start=on_start)


@contextlib.contextmanager
def scraped(port: int, every_s: float) -> Iterator[Callable[[], int]]:
    """A thread that GETs /metrics on ``port`` every ``every_s`` meanwhile, as Prometheus
    would; yields a count of the scrapes answered."""
    stop, answered = threading.Event(), [0]

    def run() -> None:
        with requests.Session() as http:
            while not stop.wait(every_s):
                try:
                    http.get(f"http://127.0.0.1:{port}/metrics", timeout=5).raise_for_status()
                    answered[0] += 1
                except requests.RequestException:
                    pass  # not serving yet, or stopped

    thread = threading.Thread(target=run, daemon=True, name="scraper")
    thread.start()
    try:
        yield lambda: answered[0]
    finally:
        stop.set()
        thread.join(10)


@contextlib.contextmanager
def workers_from(tree: Path) -> Iterator[None]:
    """Pipeline legs started meanwhile run ``datagen worker`` from ``tree``'s code: its
    directory goes first on sys.path, ahead of this checkout's."""
    boot = (f"import runpy, sys; sys.path.insert(0, {str(tree.resolve())!r}); "
            "runpy.run_module('ops.cli', run_name='__main__', alter_sys=True)")

    def start(procs: Processes, settings: Settings, concurrency: int,
              tag: str = "worker") -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-c", boot, "worker", "--concurrency", str(concurrency),
                "--loglevel", "WARNING"]
        return procs.start(argv, env=settings.to_env(), log=WORKDIR / f"{tag}-baseline.log")

    default, bench_runs.start_worker = bench_runs.start_worker, start  # type: ignore[assignment]
    try:
        yield
    finally:
        bench_runs.start_worker = default


def profile_leg(procs: Processes, sim: tuple[str, int], args: argparse.Namespace,
                kind: str) -> dict[str, Any]:
    """Two legs under py-spy: one sampling the GIL's holder, one every active thread.

    One after the other, never both at once: a GIL recorder attached beside the
    all-threads one kept few samples or none (0 and 166 in two such runs, 343 and 831
    alone), so the GIL-held time a task read far too low. The all-threads recorder pauses
    some 64 threads for every sample and falls behind its rate even alone (23 s behind
    in one leg), which is the likely reason; its own shares stay usable, its count does not.
    """
    leg, gil, tasks = _profiled_leg(procs, sim, args, kind, gil=True)
    _, every, _ = _profiled_leg(procs, sim, args, kind, gil=False)
    return {"leg": leg, "tasks_profiled": tasks, "gil": gil, "all": every}


def _profiled_leg(procs: Processes, sim: tuple[str, int], args: argparse.Namespace,
                  kind: str, gil: bool) -> tuple[Leg, profiling.Profile, int]:
    """A leg with one py-spy attached once it runs; the tasks finished while it sampled."""
    raw = WORKDIR / "tmp" / f"overhead-{kind}{'-gil' if gil else ''}.raw"
    recorder: list[subprocess.Popen[bytes]] = []
    attached_at: list[float] = []

    def attach(workers: list[Any]) -> None:
        time.sleep(PROFILE_DELAY_S)
        attached_at.append(time.time())
        recorder.append(profiling.record(procs, workers[0].pid, raw, gil=gil,
                                         rate=PROFILE_RATE_HZ))

    try:
        leg = one_leg(procs, sim, args, kind, n=max(args.samples, PROFILE_SAMPLES),
                      on_start=attach)
    finally:
        for rec in recorder:
            profiling.stop(procs, rec)
    # The simulator's clock is this machine's.
    tasks = sum(1 for e in sim_requests(sim[0])
                if e.get("status") == 200 and e.get("finished_ts", 0) >= attached_at[0])
    return leg, profiling.summarize(raw), tasks


WORKER_STEPS: tuple[tuple[str, str], ...] = (
    ("Store.prompts (shared SELECT)", "Store.prompts ("),
    ("Ledger.admit_many (batched ADMIT)", "Ledger.admit_many ("),
    ("Ledger.admit (Lua)", "Ledger.admit ("),
    ("WorkerContext.dataset", "WorkerContext.dataset ("),
    ("SGLangClient.generate (HTTP + JSON)", "SGLangClient.generate ("),
    ("Ledger.charge_many (batched CHARGE)", "Ledger.charge_many ("),
    ("Ledger.charge (Lua)", "Ledger.charge ("), ("result_row", "result_row ("),
    ("Store.save_result (INSERT + UPDATE)", "Store.save_result ("),
    ("commit_rows (shared commit: INSERT + UPDATE)", "commit_rows ("),
    ("shared steps: waiting for the group", "GroupCall.__call__ ("),
    ("run_sample, other", "run_sample ("), ("Celery task tracer", "trace_task ("),
    ("thread pool", "_worker (concurrent"),
    ("consumer: Celery request from message", "task_message_handler ("),
    ("consumer: kombu unacked bookkeeping", "QoS.append ("),
    ("consumer: ack (kombu QoS.ack)", "Message.ack ("),
    ("consumer: BRPOP re-register", "_register_BRPOP ("),
    ("consumer: BRPOP read", "_brpop_read ("), ("consumer: other", "asynloop ("),
)
WORKER_DETAIL: tuple[tuple[str, str], ...] = (
    ("requests: proxy/netrc lookups (trust_env)", "merge_environment_settings ("),
    ("requests: proxy/netrc lookups (trust_env)", "get_environ_proxies ("),
    ("JSON: decode /generate answer", "Response.json ("),
    ("JSON: encode /generate body", "JSONEncoder.encode ("),
    ("SQLAlchemy: cache key", "_generate_cache_key ("),
    ("SQLAlchemy: build statement", "(sqlalchemy/sql/coercions.py"),
    ("SQLAlchemy: compile", "(sqlalchemy/sql/compiler.py"),
    ("redis-py: new client (kombu)", "Redis.__init__ ("),
    ("redis-py: connection pool", "ConnectionPool.get_connection ("),
    ("sqlite3/psycopg execute", "do_execute ("), ("commit", "do_commit ("),
)
FALLBACK: tuple[tuple[str, str], ...] = tuple(
    (f"{name} (other)", "(" + needle.lstrip("/")) for name, needle in profiling.CATEGORIES)


def show_profile(prof: dict[str, Any], label: str) -> dict[str, Any]:
    leg: Leg = prof["leg"]
    cpu_ms = leg.cpu_ms_per_task("workers")
    # Each GIL sample stands for one sampling interval with some thread holding the GIL,
    # so samples over tasks give the GIL-held time per task, and a step's share of it is
    # what the step's Python costs a task. The process's CPU per task is more: system
    # calls, waiting for the GIL and C code that runs without it are not GIL-held.
    gil = prof.get("gil")
    gil_ms = (1000.0 * gil.samples / PROFILE_RATE_HZ / prof["tasks_profiled"]
              if gil is not None and prof.get("tasks_profiled") else 0.0)
    out: dict[str, Any] = {"rate_under_profiler": leg.rate, "cpu_ms_per_task": cpu_ms,
                           "gil_held_ms_per_task": gil_ms,
                           "tasks_profiled": prof.get("tasks_profiled", 0)}
    for mode in ("gil", "all"):
        p = prof.get(mode)
        if p is None:
            continue
        if not p.samples:  # the tables below are then empty
            print(f"{label} profile ({mode}): py-spy recorded no samples")
        steps, detail = p.attribute(WORKER_STEPS), p.attribute(WORKER_DETAIL, FALLBACK)
        what = "GIL holder" if mode == "gil" else "all active threads"
        if mode == "gil":
            table(f"{label} profile ({what}, {p.samples} samples; under the profiler "
                  f"{gil_ms:.2f} ms GIL-held and {cpu_ms:.2f} ms CPU per task): share per "
                  "step", ["step", "% samples", "GIL-held ms/task"],
                  [(k, f"{v:.1f}", f"{v * gil_ms / 100:.3f}") for k, v in steps])
        else:
            table(f"{label} profile ({what}, {p.samples} samples): share per step",
                  ["step", "% samples"], [(k, f"{v:.1f}") for k, v in steps])
        table(f"{label} profile ({what}): share per activity", ["activity", "% samples"],
              [(k, f"{v:.1f}") for k, v in detail[:16]])
        if mode == "gil":
            table(f"{label} profile ({what}): top functions by self share", ["function", "%"],
                  [(k, f"{v:.1f}") for k, v in p.top("self", 12)])
        out[mode] = {"samples": p.samples, "steps": steps, "activities": detail,
                     "libraries": p.category_shares(), "self": p.top("self", 15)}
    return out


def round_order(kinds: list[str], i: int) -> list[str]:
    """The legs of round ``i``: every other round in reverse, so that no leg always has the
    same place in a round: with the same code as current and as baseline, a leg always
    run first read a tenth faster than its copy always run third."""
    return list(kinds) if i % 2 == 0 else kinds[::-1]


def run(args: argparse.Namespace) -> dict[str, Any]:
    dbs = [k for k in args.dbs.split(",") if k]
    kinds = (dbs + ([d + BASELINE_SUFFIX for d in dbs] if args.baseline else [])
             + ([d + METRICS_SUFFIX for d in dbs] if args.metrics else []) + ["bare"])
    legs: dict[str, list[Leg]] = {k: [] for k in kinds}
    prof: dict[str, Any] | None = None
    clean_workdir()
    prompt_files(args.samples)
    with Processes() as procs:
        proc_sim = start_sim(procs, slots=256, decode=0, mean_output=16)
        sim = (proc_sim[0], proc_sim[1].pid)
        for i in range(args.rounds):
            for kind in round_order(kinds, i):
                legs[kind].append(one_leg(procs, sim, args, kind))
        if args.profile:
            prof = {"profile": profile_leg(procs, sim, args, dbs[0] if dbs else "sqlite"),
                    "profile_bare": profile_leg(procs, sim, args, "bare")}
    return report(args, legs, prof)


def report(args: argparse.Namespace, legs: dict[str, list[Leg]],
           prof: dict[str, Any] | None) -> dict[str, Any]:
    bare = legs["bare"]
    rows: list[tuple[str, ...]] = []
    figures: dict[str, Any] = {}
    for kind, runs in legs.items():
        rate = Summary.of([leg.rate for leg in runs])
        ratio = _ratios(runs, bare)
        worker_ms = Summary.of([leg.cpu_ms_per_task("workers") for leg in runs])
        worker_cs = Summary.of([leg.switches_per_task("workers") for leg in runs])
        consumer_ms = Summary.of([leg.cpu_ms_per_task("consumers") for leg in runs])
        consumer_cs = Summary.of([leg.switches_per_task("consumers") for leg in runs])
        sim_ms = Summary.of([leg.cpu_ms_per_task("sim") for leg in runs])
        sim_core = Summary.of([100 * leg.cpu_s["sim"] / leg.window_s for leg in runs])
        redis_ms = Summary.of([leg.cpu_ms_per_task("redis") for leg in runs])
        database_ms = Summary.of([leg.cpu_ms_per_task(DATABASE) for leg in runs])
        machine_ms = Summary.of([leg.cpu_ms_per_task(MACHINE) for leg in runs])
        steal = Summary.of([100 * leg.cpu_s.get(STEAL, 0.0) / leg.window_s for leg in runs])
        rows.append((runs[0].label, rate.fmt(), ratio.fmt(3), worker_ms.fmt(2),
                     worker_cs.fmt(1), consumer_ms.fmt(2), sim_ms.fmt(2), sim_core.fmt(0),
                     redis_ms.fmt(2), database_ms.fmt(2), machine_ms.fmt(2), steal.fmt(0)))
        figures[kind] = {"rate": rate, "ratio_to_bare": ratio, "worker_cpu_ms_per_task":
                         worker_ms, "worker_switches_per_task": worker_cs,
                         "consumer_cpu_ms_per_task": consumer_ms,
                         "consumer_switches_per_task": consumer_cs,
                         "sim_cpu_ms_per_task": sim_ms, "sim_core_pct": sim_core,
                         "redis_cpu_ms_per_task": redis_ms,
                         "database_cpu_ms_per_task": database_ms,
                         "machine_cpu_ms_per_task": machine_ms, "steal_core_pct": steal,
                         "worker_processes": max(leg.worker_processes for leg in runs)}
    table(f"overhead at max rate: {args.samples} samples/leg, {args.rounds} rounds, "
          f"{args.workers} worker process(es) at c={args.concurrency} (median [min-max])",
          ["leg", "completions/s", "ratio to bare", "worker CPU ms/task",
           "worker switches/task", "consumer (main thread) CPU ms/task",
           "sim CPU ms/task", "sim % of a core",
           "Redis CPU ms/task", "PostgreSQL CPU ms/task", "machine CPU ms/task",
           "steal % of a core"], rows)
    checks = [(k, figures[k]["rate"].median, figures[k]["ratio_to_bare"].median)
              for k in legs if not k.startswith("bare")]
    table("targets: ratio >= 0.8 and >= 400 completions/s", ["leg", "rate", "ratio"],
          [(k, verdict(r, TARGET_RATE), verdict(q, TARGET_RATIO)) for k, r, q in checks])
    for key, p in (prof or {}).items():
        figures[key] = show_profile(p, "pipeline worker" if key == "profile" else
                                    "bare task worker")
    return figures


def _ratios(runs: list[Leg], base: list[Leg]) -> Summary:
    """Per round: each leg against the base leg of the same round."""
    return Summary.of([a.rate / b.rate for a, b in zip(runs, base, strict=True) if b.rate])


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    figures = run(args)
    emit("overhead", args, {"samples": args.samples, "rounds": args.rounds,
                            "workers": args.workers, "concurrency": args.concurrency,
                            **figures})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
