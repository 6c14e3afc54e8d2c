"""Benchmark 5, memory: worker RSS at concurrency 64 and 256, Redis bytes per queued task.

RSS (VmRSS from /proc) of one ``datagen worker``: idle after start, peak, and at the
end of a warm run against an instant simulator (mean output 300 tokens). Then the long
run: one worker (c=64) through 100,000 samples, enqueued in five parts as it goes, with
its RSS after each part, for what a run of days does to it; once on SQLite and once on
PostgreSQL, whose drivers keep different caches. Redis: INFO
``used_memory`` before/after the real producer enqueues 10,000 prompts, cross-checked by
``MEMORY USAGE`` of every key of the database. Targets: ≤ 250 MB at c=64 (after the warm
run and after the long one), ≤ 1.2 KB/task.

    python -m bench.memory [--quick] [--long N] [--long-parts K] [--long-dbs DBS]
"""

from __future__ import annotations

import argparse
import math
import threading
import time
from typing import Any

import redis

from bench.harness import (
    REDIS_URL,
    WORKDIR,
    Processes,
    bench_settings,
    clean_workdir,
    fresh_db,
    fresh_redis,
    rss_mb,
    start_sim,
    start_worker,
    wait_until,
)
from bench.report import Summary, emit, table, verdict
from bench.runs import pipeline_leg, settled
from bench.synth import enqueue, prompt_files
from common.store import Store

TARGET_RSS_MB, TARGET_BYTES = 250.0, 1200.0
# The databases a long run can use, and their names in tables.
LONG_DBS = {"sqlite": "SQLite", "postgresql": "PostgreSQL"}
IDLE_WAIT_S = 6.0


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__)
    p.add_argument("--quick", action="store_true", help="600 samples, 2,000 queued, 1 rep")
    p.add_argument("--samples", type=int, help="warm-run samples (default 3000)")
    p.add_argument("--concurrency", default="64,256")
    p.add_argument("--queued", type=int, help="tasks enqueued for Redis (default 10,000)")
    p.add_argument("--reps", type=int, help="default 3")
    p.add_argument("--long", type=int,
                   help="samples of the long run (default 100,000; 3,000 with --quick; 0: none)")
    p.add_argument("--long-parts", type=int, default=5,
                   help="parts the long run's samples are enqueued in (default 5)")
    p.add_argument("--long-dbs", help="databases of the long run, each a run of its own "
                   "(default sqlite,postgresql; quick: sqlite)")
    args = p.parse_args(argv)
    args.long_dbs = [d for d in (args.long_dbs or (
        "sqlite" if args.quick else "sqlite,postgresql")).split(",") if d]
    args.samples = args.samples or (600 if args.quick else 3000)
    args.queued = args.queued or (2000 if args.quick else 10_000)
    args.reps = args.reps or (1 if args.quick else 3)
    if args.long is None:
        args.long = 3000 if args.quick else 100_000
    if unknown := set(args.long_dbs) - set(LONG_DBS):
        p.error(f"--long-dbs: unknown database {', '.join(sorted(unknown))}")
    if args.long and not 1 <= args.long_parts <= args.long:
        p.error("--long-parts must be between 1 and --long")
    return args


class RssSampler:
    """Polls a process's RSS every 0.2 s: peak and last value seen alive."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.last = pid, 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                now = rss_mb(self.pid)
            except OSError:
                return
            if now <= 0:  # exiting: VmRSS is gone
                return
            self.last, self.peak = now, max(self.peak, now)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def idle_rss(procs: Processes, settings: Any, concurrency: int) -> float:
    worker = start_worker(procs, settings, concurrency, tag="idle")
    try:
        time.sleep(IDLE_WAIT_S)
        return rss_mb(worker.pid)
    finally:
        procs.stop(worker)


def worker_rss(procs: Processes, args: argparse.Namespace, sim: tuple[str, int],
               concurrency: int) -> dict[str, float]:
    fresh_redis()
    settings = bench_settings(fresh_db("sqlite", "memory"), sim[0], concurrency)
    idle = idle_rss(procs, settings, concurrency)
    enqueue(settings, prompt_files(args.samples), max_new_tokens=1024)
    samplers: list[RssSampler] = []
    leg = pipeline_leg(procs, f"c={concurrency}", settings, sim, args.samples,
                       on_start=lambda ws: samplers.append(RssSampler(ws[0].pid)))
    samplers[0].stop()
    return {"idle": idle, "peak": samplers[0].peak, "end": samplers[0].last, "rate": leg.rate}


def long_key(kind: str) -> str:
    """The figures' key of a database's long run (SQLite's kept its first name)."""
    return "long_run" if kind == "sqlite" else f"long_run_{kind}"


def long_run(procs: Processes, args: argparse.Namespace, sim_url: str,
             kind: str = "sqlite") -> dict[str, Any]:
    """One worker through ``args.long`` samples, a part enqueued each time the one before
    is settled: its RSS after each part, and how fast it grew over the second half.

    Each part is a new set of prompts (new ids), as a run's datasets bring: the results
    table grows all along, as does the ledger."""
    fresh_redis()
    settings = bench_settings(fresh_db(kind, "memory-long"), sim_url, 64)
    per_part = args.long // args.long_parts
    # Written before the worker starts, so that making them is not in its time.
    folders = [prompt_files(per_part, seed=k, id_prefix=f"part{k}-")
               for k in range(args.long_parts)]
    worker = start_worker(procs, settings, 64, tag=f"long-{kind}")
    store = Store(settings.database_url)
    points: list[dict[str, float]] = []
    try:
        time.sleep(IDLE_WAIT_S)
        points.append({"samples": 0, "rss": rss_mb(worker.pid), "seconds": 0.0})
        for k, folder in enumerate(folders):
            started = time.monotonic()
            enqueue(settings, folder, max_new_tokens=1024)
            ok = wait_until(lambda: settled(store) or worker.poll() is not None,
                            max(300.0, per_part / 20), 0.5)
            if not ok or worker.poll() is not None:
                raise RuntimeError(f"long run ({kind}): part {k + 1} not settled (worker exit "
                                   f"code {worker.poll()}); see {WORKDIR / f'long-{kind}.log'}")
            points.append({"samples": per_part * (k + 1), "rss": rss_mb(worker.pid),
                           "seconds": time.monotonic() - started})
    finally:
        store.engine.dispose()
        procs.stop(worker)
    return {"samples": per_part * args.long_parts, "points": points,
            "end": points[-1]["rss"], "growth_mb_per_10k": growth_per_10k(points)}


def growth_per_10k(points: list[dict[str, float]]) -> float:
    """MB of RSS per 10,000 samples from the point halfway through to the last one: the
    rate a long run keeps growing at, once the start-up's and the first caches' growth
    are behind it."""
    mid, last = points[math.ceil((len(points) - 1) / 2)], points[-1]
    if last["samples"] <= mid["samples"]:
        return 0.0
    return 10_000 * (last["rss"] - mid["rss"]) / (last["samples"] - mid["samples"])


def redis_bytes(args: argparse.Namespace, sim_url: str) -> dict[str, float]:
    r = fresh_redis()
    settings = bench_settings(fresh_db("sqlite", "memory-redis"), sim_url)
    folder = prompt_files(args.queued)
    before = int(r.info("memory")["used_memory"])
    enqueue(settings, folder, max_new_tokens=1024)
    after = int(r.info("memory")["used_memory"])
    keys = list(r.scan_iter(count=1000))
    usage = sum(int(r.memory_usage(k, samples=0) or 0) for k in keys)
    queued = sum(int(r.llen(k)) for k in keys if r.type(k) == b"list")
    one = next((r.lindex(k, 0) for k in keys if r.type(k) == b"list"), b"") or b""
    return {"info_delta": (after - before) / args.queued, "memory_usage": usage / args.queued,
            "queued": queued, "message_bytes": len(one), "keys": len(keys)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    clean_workdir()
    rss: dict[int, list[dict[str, float]]] = {}
    per_task: list[dict[str, float]] = []
    with Processes() as procs:
        url, proc = start_sim(procs, slots=256, decode=0, mean_output=300)
        for _ in range(args.reps):
            for c in (int(x) for x in args.concurrency.split(",") if x):
                rss.setdefault(c, []).append(worker_rss(procs, args, (url, proc.pid), c))
            per_task.append(redis_bytes(args, url))
        longs = {kind: long_run(procs, args, url, kind) for kind in args.long_dbs} \
            if args.long else {}
    redis.Redis.from_url(REDIS_URL).flushdb()
    rows, figures = [], {}
    for c, runs in rss.items():
        s = {k: Summary.of([r[k] for r in runs]) for k in ("idle", "peak", "end", "rate")}
        goal = verdict(s["end"].median, TARGET_RSS_MB, False) if c == 64 else "-"
        rows.append((f"worker RSS MB, c={c}", s["idle"].fmt(), s["peak"].fmt(), s["end"].fmt(),
                     goal, s["rate"].fmt()))
        figures[f"rss_c{c}"] = s
    table(f"worker memory (warm run: {args.samples} samples, {args.reps} reps, "
          "median [min-max])", ["figure", "idle", "peak", "after warm run",
                                f"target <= {TARGET_RSS_MB:g} MB", "completions/s"], rows)
    b = {k: Summary.of([p[k] for p in per_task]) for k in per_task[0]}
    table(f"Redis bytes per queued task ({args.queued:,} enqueued by the producer)",
          ["figure", "value", "target"],
          [("INFO used_memory delta / task", b["info_delta"].fmt(0),
            f"<= {TARGET_BYTES:g}: {verdict(b['info_delta'].median, TARGET_BYTES, False)}"),
           ("MEMORY USAGE of all keys / task", b["memory_usage"].fmt(0), ""),
           ("one message body, bytes", b["message_bytes"].fmt(0), ""),
           ("messages queued", b["queued"].fmt(0), "")])
    figures["redis_bytes_per_task"] = b
    for kind, long in longs.items():
        table(f"worker RSS over a long run ({kind}, c=64; {long['samples']:,} samples in "
              f"{len(long['points']) - 1} parts, each enqueued once the one before is settled)",
              ["samples settled", "RSS MB", "part's seconds (enqueue included)"],
              [(f"{p['samples']:,.0f}", f"{p['rss']:.1f}", f"{p['seconds']:.1f}")
               for p in long["points"]])
        print(f"RSS after the long run ({kind}): {long['end']:.1f} MB "
              f"(target <= {TARGET_RSS_MB:g}: {verdict(long['end'], TARGET_RSS_MB, False)}); "
              f"growth over its second half: {long['growth_mb_per_10k']:.2f} MB per 10,000 "
              "samples")
        figures[long_key(kind)] = long
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    figures = run(args)
    emit("memory", args, {"samples": args.samples, **figures})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
