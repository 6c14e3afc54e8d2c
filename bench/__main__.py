"""``python -m bench [--quick] [--only a,b] [--no-profile]``: every benchmark in turn.

Each runs as its own process (a failure stops only that one), its output streamed
through; the ``bench-result`` lines are collected into one JSON file and a summary of
the headline figures against their targets is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import ROOT, WORKDIR, machine, stop_on_signals
from bench.report import RESULT_PREFIX, table
from bench.summary import headline

# name, module, flags always, flags at full scale (profiling where it is part of the report)
BENCHES: tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("memory", "bench.memory", (), ()),
    ("guard", "bench.guard", (), ()),
    ("overshoot", "bench.overshoot", (), ()),
    ("saturation", "bench.saturation", (), ()),
    ("overhead", "bench.overhead", (), ("--profile",)),
    # The same with a worker process per core, every leg alike: one process's Python runs
    # on one core at a time (the GIL), whatever the machine has.
    ("overhead-per-core", "bench.overhead", ("--workers", "cores"), ()),
    ("scaling", "bench.scaling", (), ()),
    ("producer", "bench.producer_rate", (), ("--profile",)),
    ("hotpath", "bench.hotpath", (), ()),
    ("routing", "bench.routing", (), ()),
    ("reference-run", "bench.reference_run", (), ()),
    ("concurrency", "bench.concurrency", (), ()),
)
BENCH_TIMEOUT_S = 3600


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="short runs of every benchmark")
    p.add_argument("--only", default="", help="comma-separated: " +
                   ",".join(b[0] for b in BENCHES))
    p.add_argument("--no-profile", action="store_true", help="skip the py-spy runs")
    p.add_argument("--out", type=Path, help="JSON of every result (default in the bench dir)")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    return p.parse_args(argv)


def commands(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    only = {x for x in args.only.split(",") if x}
    unknown = only - {b[0] for b in BENCHES}
    if unknown:
        raise SystemExit(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    out = []
    for name, module, always, full in BENCHES:
        if only and name not in only:
            continue
        flags = [*always, "--quick"] if args.quick else list(always)
        if not args.quick and not args.no_profile:
            flags += list(full)
        out.append((name, [sys.executable, "-m", module, *flags]))
    return out


def run_one(argv: list[str]) -> tuple[int, list[dict[str, Any]]]:
    """Run a benchmark, echoing its output; returns (exit code, its result lines)."""
    results = []
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    deadline = time.monotonic() + BENCH_TIMEOUT_S
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(RESULT_PREFIX):
                results.append(json.loads(line[len(RESULT_PREFIX):]))
            else:
                sys.stdout.write(line)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{argv} ran over {BENCH_TIMEOUT_S} s")
        return proc.wait(), results
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    stop_on_signals()  # a stop reaches the running benchmark, which stops its processes
    todo = commands(args)
    if args.dry_run:
        for name, cmd in todo:
            print(f"{name}: {' '.join(cmd)}")
        return 0
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    collected: dict[str, Any] = {"started": started, "machine": machine(), "results": {}}
    failed = []
    for name, cmd in todo:
        print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.monotonic()
        code, results = run_one(cmd)
        collected["results"][name] = results[-1] if results else None
        print(f"=== {name}: exit {code} in {time.monotonic() - t0:.0f} s", flush=True)
        if code != 0 or not results:
            failed.append(name)
    out = args.out or WORKDIR / f"results-{started.replace(':', '')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(collected, indent=1))
    table(f"datagen benchmarks, {started} ({'quick' if args.quick else 'full'}); "
          f"all results in {out}", ["benchmark", "figure", "value", "target", "verdict"],
          headline(collected["results"]))
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
