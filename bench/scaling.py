"""Benchmark 6, scaling: completions/s with 1, 2 and 4 worker processes (c=64 each)
against an instant simulator, CPU per process, and the per-task Redis and SQL costs
behind the 100-node projection in docs/PERFORMANCE.md.

The costs are counted twice: at full rate against the instant simulator, and at a
paced rate against one that takes seconds per answer. A fleet's worker runs at the
second kind of pace (a sample a second, not hundreds), where a freed slot takes one
message and groups hold one sample, so the projection uses the paced counts.

    python -m bench.scaling [--quick] [--no-costs] [--paced-samples N]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench import costs
from bench.harness import (
    Processes,
    bench_settings,
    clean_workdir,
    cpu_seconds,
    fresh_db,
    fresh_redis,
    sim_reset,
    start_sim,
    start_worker,
    wait_until,
)
from bench.report import Summary, emit, table
from bench.runs import Leg, pipeline_leg, settled, watch
from bench.synth import enqueue, prompt_files
from common.settings import Settings
from common.store import Store

NODE_TOK_S = 930.0  # one 8-GPU SGLang node, typical (shared/BRIEF.md)
FLEET = 100
SLOTS_PER_NODE = 48
# The paced runs' simulator: every one of a worker's 64 requests runs at once, each
# sequence decoding 4 tokens a second, so an answer of the mean 16 tokens takes 4 s and
# one worker completes a few samples a second (the long answers hold their slots).
PACED_TOK_S = 4.0
PACED_MEAN_OUTPUT = 16
IDLE_S = 3.0  # the window a worker with nothing queued is watched for
IDLE_CPU_S = 10.0  # the window a worker subprocess with nothing queued is timed for


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__)
    p.add_argument("--quick", action="store_true", help="600 samples, SQLite only, 1 rep")
    p.add_argument("--samples", type=int, help="samples per leg (default 3000)")
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--dbs", help="default sqlite,postgresql (quick: sqlite)")
    p.add_argument("--reps", type=int, help="default 2")
    p.add_argument("--cost-samples", type=int, help="samples of the counting run (500)")
    p.add_argument("--no-costs", action="store_true", help="skip the per-task counting run")
    p.add_argument("--paced-samples", type=int,
                   help="samples of each paced run (default 320, quick 160; 0 skips them)")
    args = p.parse_args(argv)
    args.samples = args.samples or (600 if args.quick else 3000)
    args.dbs = args.dbs or ("sqlite" if args.quick else "sqlite,postgresql")
    args.reps = args.reps or (1 if args.quick else 2)
    args.cost_samples = args.cost_samples or (200 if args.quick else 500)
    if args.paced_samples is None:
        args.paced_samples = 160 if args.quick else 320
    return args


def scale_leg(procs: Processes, sim: tuple[str, int], kind: str, workers: int, n: int, *,
              idle: bool = False) -> Leg:
    fresh_redis()
    settings = bench_settings(fresh_db(kind, "scaling"), sim[0], 64)
    enqueue(settings, prompt_files(n), max_new_tokens=1024)
    leg = pipeline_leg(procs, f"{kind} x{workers}", settings, sim, n, workers=workers)
    if idle:
        leg.extra["idle_worker_core_pct"] = idle_cpu(procs, settings)
    return leg


def idle_cpu(procs: Processes, settings: Settings) -> float:
    """% of one core that a worker uses with its datasets known and their queues empty."""
    proc = start_worker(procs, settings, settings.concurrency, tag="worker-idle")
    try:
        time.sleep(3.0)  # its start-up, not counted
        cpu, started = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(IDLE_CPU_S)
        return 100 * (cpu_seconds(proc.pid) - cpu) / (time.monotonic() - started)
    finally:
        procs.stop(proc)


def count_costs(sim_url: str, kind: str, n: int) -> dict[str, Any]:
    """Enqueue and run ``n`` samples in-process while counting Redis commands and SQL."""
    from celery.contrib.testing.worker import start_worker

    from workers.app import create_app

    fresh_redis()
    settings = bench_settings(fresh_db(kind, "costs"), sim_url, 64)
    out: dict[str, Any] = {}
    with costs.RedisMonitor() as mon, costs.SqlCounter().counting() as sql:
        enqueue(settings, prompt_files(n), max_new_tokens=1024)
    out["producer"] = {"redis": dict(mon.direct), "lua": dict(mon.lua),
                       "sql": dict(sql.statements), "commits": sql.commits}
    sim_reset(sim_url)
    pg0 = costs.pg_stats() if kind == "postgresql" else {}
    peak = 0
    app = create_app(settings)
    with start_worker(app, pool="threads", concurrency=64, perform_ping_check=False,
                      shutdown_timeout=30):
        with costs.RedisMonitor() as mon, costs.SqlCounter().counting() as sql:
            watch(sim_url, n, {}, 300)
            peak = costs.pg_connections() if kind == "postgresql" else 0
            time.sleep(1.0)  # the last stores; no polling of SQL inside the counted window
        # Nothing queued now: what a worker costs Redis while it waits for work.
        with costs.RedisMonitor() as idle:
            time.sleep(IDLE_S)
    store = Store(settings.database_url)
    wait_until(lambda: settled(store), 60, 0.5)
    store.engine.dispose()
    out["worker"] = {"redis": dict(mon.direct), "lua": dict(mon.lua),
                     "sql": dict(sql.statements), "commits": sql.commits}
    out["idle_redis_per_s"] = {k: v / IDLE_S for k, v in
                               (idle.direct + idle.lua).items()}
    if pg0:
        pg1 = costs.pg_stats()
        out["worker"]["pg"] = {k: pg1[k] - pg0[k] for k in pg0}
        out["worker"]["pg_connections"] = peak
    return out


def show_costs(label: str, n: int, c: dict[str, Any]) -> dict[str, float]:
    totals: dict[str, float] = {}
    rows = []
    for phase in ("producer", "worker"):
        p = c[phase]
        for what in ("redis", "lua", "sql"):
            total = sum(p[what].values()) / n
            totals[f"{phase}_{what}"] = total
            top = ", ".join(f"{k} {v / n:.2f}" for k, v in
                            sorted(p[what].items(), key=lambda kv: -kv[1])[:8])
            rows.append((f"{phase}: {what}", f"{total:.2f}", top))
        totals[f"{phase}_commits"] = p["commits"] / n
        rows.append((f"{phase}: SQL commits", f"{p['commits'] / n:.2f}", ""))
    for k, v in c["worker"].get("pg", {}).items():
        rows.append((f"worker: pg_stat_database {k}", f"{v / n:.2f}", ""))
        totals[f"pg_{k}"] = v / n
    if "pg_connections" in c["worker"]:
        rows.append(("worker: PostgreSQL connections open (c=64)",
                     str(c["worker"]["pg_connections"]), ""))
        totals["pg_connections"] = c["worker"]["pg_connections"]
    idle = c.get("idle_redis_per_s", {})
    totals["idle_redis_per_s"] = sum(idle.values())
    rows.append(("idle worker: Redis commands/s (sent and in scripts)",
                 f"{totals['idle_redis_per_s']:.1f}",
                 ", ".join(f"{k} {v:.1f}" for k, v in sorted(idle.items(), key=lambda kv: -kv[1]))))
    table(f"per-task costs, {label} ({n} samples; Redis = commands sent, lua = run inside "
          "scripts)", ["figure", "per task", "top commands per task"], rows)
    return totals


def project(totals: dict[str, float], cpu_ms: float) -> list[tuple[Any, ...]]:
    rows = []
    for mean_out in (300, 1000, 4000):
        tasks = FLEET * NODE_TOK_S / mean_out
        redis_ops = tasks * sum(totals.get(k, 0) for k in (
            "producer_redis", "worker_redis", "producer_lua", "worker_lua"))
        worker_sql = totals.get("worker_sql", 0)
        if "pg_xact_commit" in totals:
            # The worker's group statements run on the psycopg connection directly, out of
            # SQLAlchemy's sight; each is a transaction, so PostgreSQL's own count of those
            # stands in for them.
            worker_sql = max(worker_sql, totals["pg_xact_commit"]
                             + totals.get("pg_xact_rollback", 0))
        sql = tasks * (totals.get("producer_sql", 0) + worker_sql)
        rows.append((mean_out, f"{tasks:,.0f}", f"{redis_ops:,.0f}", f"{sql:,.0f}",
                     f"{tasks * cpu_ms / 1000:,.1f}", FLEET * SLOTS_PER_NODE // 64 + 1))
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    clean_workdir()
    kinds = [k for k in args.dbs.split(",") if k]
    counts = [int(w) for w in args.workers.split(",") if w]
    legs: dict[tuple[str, int], list[Leg]] = {}
    cost: dict[str, Any] = {}
    paced: dict[str, Leg] = {}
    paced_cost: dict[str, Any] = {}
    with Processes() as procs:
        url, proc = start_sim(procs, slots=256, decode=0, mean_output=16)
        for _ in range(args.reps):
            for kind in kinds:
                for w in counts:
                    legs.setdefault((kind, w), []).append(
                        scale_leg(procs, (url, proc.pid), kind, w, args.samples))
        if not args.no_costs:
            cost = {kind: count_costs(url, kind, args.cost_samples) for kind in kinds}
        if args.paced_samples:
            purl, pproc = start_sim(procs, slots=64, decode=PACED_TOK_S,
                                    mean_output=PACED_MEAN_OUTPUT, name="sim-paced")
            for kind in kinds:
                paced[kind] = scale_leg(procs, (purl, pproc.pid), kind, 1, args.paced_samples,
                                        idle=True)
                if not args.no_costs:
                    paced_cost[kind] = count_costs(purl, kind, args.paced_samples)
    return report(args, legs, cost, paced, paced_cost)


def report(args: argparse.Namespace, legs: dict[tuple[str, int], list[Leg]],
           cost: dict[str, Any], paced: dict[str, Leg],
           paced_cost: dict[str, Any]) -> dict[str, Any]:
    rows: list[tuple[Any, ...]] = []
    figures: dict[str, Any] = {}
    for (kind, w), runs in legs.items():
        rate = Summary.of([leg.rate for leg in runs])
        base = Summary.of([leg.rate for leg in legs[(kind, 1)]]).median if (kind, 1) in legs \
            else rate.median
        wcpu = Summary.of([100 * leg.cpu_s["workers"] / leg.window_s for leg in runs])
        scpu = Summary.of([100 * leg.cpu_s["sim"] / leg.window_s for leg in runs])
        ms = Summary.of([leg.cpu_ms_per_task("workers") for leg in runs])
        rows.append((kind, w, rate.fmt(), f"{rate.median / base:.2f}", wcpu.fmt(0),
                     scpu.fmt(0), ms.fmt(2)))
        figures[f"{kind}_x{w}"] = {"rate": rate, "worker_cpu_pct": wcpu, "sim_cpu_pct": scpu,
                                   "worker_cpu_ms_per_task": ms}
    table(f"scaling against an instant server: {args.samples} samples/leg, c=64 per worker, "
          f"{args.reps} reps (median [min-max])", ["db", "workers", "completions/s",
          "speedup", "workers CPU % (of one core)", "sim CPU %", "worker CPU ms/task"], rows)
    if paced:
        table(f"one worker at a paced rate: {args.paced_samples} samples, c=64, each sequence "
              f"decoding {PACED_TOK_S:g} tok/s, mean output {PACED_MEAN_OUTPUT} tokens",
              ["db", "completions/s",
              "worker CPU % (of one core)", "worker CPU ms/task",
              f"then idle for {IDLE_CPU_S:g} s: worker CPU %"],
              [(kind, f"{leg.rate:.1f}",
                f"{100 * leg.cpu_s['workers'] / leg.window_s:.1f}" if leg.window_s else "-",
                f"{leg.cpu_ms_per_task('workers'):.2f}",
                f"{leg.extra['idle_worker_core_pct']:.1f}") for kind, leg in paced.items()])
    for kind, leg in paced.items():
        figures[f"paced_{kind}"] = {"rate": leg.rate,
                                    "worker_cpu_ms_per_task": leg.cpu_ms_per_task("workers"),
                                    "idle_worker_core_pct": leg.extra["idle_worker_core_pct"]}
    totals_of: dict[str, dict[str, float]] = {}
    for kind, c in cost.items():
        totals_of[kind] = show_costs(f"{kind}, full rate", args.cost_samples, c)
        figures[f"costs_{kind}"] = {**totals_of[kind], "raw": c}
    for kind, c in paced_cost.items():
        totals_of[kind] = show_costs(f"{kind}, paced", args.paced_samples, c)
        figures[f"paced_costs_{kind}"] = {**totals_of[kind], "raw": c}
    for kind, totals in totals_of.items():
        # The projection takes the costs at the pace a fleet's worker runs at, when measured.
        at_pace = kind in paced_cost
        if at_pace:
            cpu_ms = figures[f"paced_{kind}"]["worker_cpu_ms_per_task"]
        else:
            full = figures.get(f"{kind}_x1", {}).get("worker_cpu_ms_per_task")
            cpu_ms = full.median if full else 0.0
        table(f"projection for {FLEET} SGLang nodes x {NODE_TOK_S:g} tok/s ({kind}, costs "
              f"{'paced' if at_pace else 'at full rate'})",
              ["mean output tokens", "tasks/s", "Redis commands/s", "SQL statements/s",
               "worker cores needed", "workers at c=64"], project(totals, cpu_ms))
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    figures = run(args)
    emit("scaling", args, {"samples": args.samples, **figures})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
