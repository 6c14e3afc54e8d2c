"""Benchmark 3, producer: prompts/s of ``datagen enqueue`` over synthetic reference data.

88,088 prompts over 10 datasets (``--quick``: 8,000), read + template + tokenize + store
+ enqueue by the real ``Enqueuer`` in this process and its publishing child (tokenizer
loaded once, beforehand); CPU counts both processes.
Median of 3 runs, each on an emptied Redis DB and a new SQLite file, in the default
publishing order (shuffle); ``--orders shuffle,file`` alternates both orders run by run
and sets their rates and CPU seconds side by side; ``--mixes off,sampling,template``
does the same with no mixture, a temperature mixture (drawn by the workers: the producer
only stores it) and a chat template argument mixture (each prompt rendered with its draw)
beside a temperature one. ``--profile`` adds a
run under py-spy; the stage breakdown and the candidate fixes, each measured in
isolation, come from ``bench.producer_stages``.
Target ≥ 5,000 prompts/s.

    python -m bench.producer_rate [--quick] [--profile] [--no-stages] [--orders O,O]
                                  [--mixes M,M]
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from typing import Any

from bench import producer_stages, profiling
from bench.harness import (
    WORKDIR,
    Processes,
    bench_settings,
    clean_workdir,
    fresh_db,
    fresh_redis,
)
from bench.report import Summary, emit, table, verdict
from bench.synth import enqueue, prompt_files, templater
from common.order import OrderKind, check_order

TARGET = 5000.0
# The --mix flags of each mixture the benchmark can run.
MIXES: dict[str, tuple[str, ...]] = {
    "off": (),
    "sampling": ("temperature=0.6:1,0.8:1,1.0:1",),
    "template": ("temperature=0.6:1,0.8:1,1.0:1", "thinking=true:1,false:1"),
}
PRODUCER_RULES: tuple[tuple[str, str], ...] = (
    ("read: JSON parse + id hash", "read_dataset ("),
    ("render chat template (jinja)", "render ("),
    ("tokenize (Rust)", "_tokenize ("),
    ("store prompts (SQL)", "insert_prompts ("),
    ("publish (Celery messages, in the child process)", "publish ("),
    ("register / reconcile", "_register ("),
    ("prompt rows", "_prompt_rows ("),
    ("other Enqueuer", "Enqueuer."),
)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.producer_rate", description=__doc__)
    p.add_argument("--quick", action="store_true", help="8,000 prompts")
    p.add_argument("--prompts", type=int, help="default 88,088")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dbs", default="sqlite")
    p.add_argument("--profile", action="store_true", help="one more run under py-spy")
    p.add_argument("--no-stages", action="store_true", help="skip the stage breakdown")
    p.add_argument("--orders", default="shuffle",
                   help="publishing orders to run, alternating (default: %(default)s)")
    p.add_argument("--mixes", default="off",
                   help=f"mixtures to run, alternating, of {', '.join(MIXES)} "
                   "(default: %(default)s)")
    args = p.parse_args(argv)
    args.mixes = [m for m in args.mixes.split(",") if m]
    if set(args.mixes) - set(MIXES):
        p.error(f"--mixes takes {', '.join(MIXES)}")
    args.orders = [check_order(o) for o in args.orders.split(",") if o]
    args.prompts = args.prompts or (8000 if args.quick else 88_088)
    return args


def cpu_s() -> float:
    """CPU seconds of this process and of its children that have exited (the Enqueuer's
    publishing process exits when its run ends)."""
    own, children = (resource.getrusage(who)
                     for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def one_run(kind: str, folder: Any, order: OrderKind = "shuffle",
            mix: str = "off") -> dict[str, float]:
    fresh_redis()
    settings = bench_settings(fresh_db(kind, "producer"), "http://127.0.0.1:9")
    t0, cpu0 = time.perf_counter(), cpu_s()
    summaries = enqueue(settings, folder, max_new_tokens=16384, order=order,
                        mixes=MIXES[mix])
    wall, cpu = time.perf_counter() - t0, cpu_s() - cpu0
    read = sum(s.read for s in summaries)
    enqueued = sum(s.enqueued for s in summaries)
    return {"rate": read / wall, "wall_s": wall, "cores": cpu / wall, "cpu_s": cpu,
            "read": read, "enqueued": enqueued}


def profiled_run(kind: str, folder: Any) -> profiling.Profile:
    out = WORKDIR / "tmp" / "producer.raw"
    with Processes() as procs:
        rec = profiling.record(procs, os.getpid(), out, subprocesses=True)
        time.sleep(1.0)
        try:
            one_run(kind, folder)
        finally:
            profiling.stop(procs, rec)
    return profiling.summarize(out)


def show_profile(prof: profiling.Profile) -> dict[str, Any]:
    steps = prof.attribute(PRODUCER_RULES)
    table(f"producer profile: share of samples per step ({prof.samples} samples, all threads)",
          ["step", "% samples"], [(k, f"{v:.1f}") for k, v in steps])
    table("producer profile: top functions by self share", ["function", "%"],
          [(k, f"{v:.1f}") for k, v in prof.top("self", 12)])
    return {"samples": prof.samples, "steps": steps, "self": prof.top("self", 12)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    clean_workdir()
    folder = prompt_files(args.prompts)
    t0 = time.perf_counter()
    templater()
    load_s = time.perf_counter() - t0
    runs: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    for _ in range(args.reps):
        for kind in (k for k in args.dbs.split(",") if k):
            for order in args.orders:
                for mix in args.mixes:
                    runs.setdefault((kind, order, mix), []).append(
                        one_run(kind, folder, order, mix))
    rows: list[tuple[Any, ...]] = []
    figures: dict[str, Any] = {"tokenizer_load_s": load_s}
    for (kind, order, mix), rs in runs.items():
        rate = Summary.of([r["rate"] for r in rs])
        cores = Summary.of([r["cores"] for r in rs])
        wall = Summary.of([r["wall_s"] for r in rs])
        cpu = Summary.of([r["cpu_s"] for r in rs])
        rows.append((kind, order, mix, f"{int(rs[0]['read']):,}", f"{int(rs[0]['enqueued']):,}",
                     rate.fmt(0), wall.fmt(1), cores.fmt(2), cpu.fmt(1),
                     verdict(rate.median, TARGET)))
        key = kind if order == "shuffle" else f"{kind}_{order}"
        key = key if mix == "off" else f"{key}_mix_{mix}"
        figures[key] = {"rate": rate, "cores": cores, "wall_s": wall, "cpu_s": cpu,
                        "prompts": rs[0]["read"]}
    table(f"producer: {args.prompts:,} prompts over 10 datasets, {args.reps} runs "
          f"(median [min-max]); tokenizer load {load_s:.2f} s not included",
          ["db", "order", "mix", "read", "enqueued", "prompts/s", "wall s", "CPU cores used",
           "CPU s", f"target >= {TARGET:,.0f}/s"], rows)
    if args.profile:
        figures["profile"] = show_profile(profiled_run(args.dbs.split(",")[0], folder))
    if not args.no_stages:
        figures["stages"] = producer_stages.run(min(args.prompts, 8000), args.reps)
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    figures = run(args)
    fresh_redis()
    emit("producer", args, {"prompts": args.prompts, **figures})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
