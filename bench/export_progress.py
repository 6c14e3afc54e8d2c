"""What progress costs ``datagen export``: the same export with ``--quiet``, with progress
lines (stderr a pipe) and with the bar (stderr a pseudo-terminal), side by side.

The database is a finished run of ``--rows`` prompts (bench/synth_results.py: four
datasets, about 92% of them with a result), SQLite, cached under the bench directory.
Each run is ``python -m ops.cli export`` in a process of its own; the modes take turns,
``--reps`` times each; wall time and the process's CPU are medians. One
``ProgressBar.advance()`` call, what each row pays, is timed apart in each mode, as is the
card's SQL (which every mode runs).

    python -m bench.export_progress [--quick] [--rows N] [--reps N] [--format FMT]
"""

from __future__ import annotations

import argparse
import os
import pty
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import ROOT, WORKDIR
from bench.report import Summary, emit, table
from bench.synth_results import fill
from common.store import Store

MODES = ("quiet", "lines", "bar")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.export_progress", description=__doc__)
    p.add_argument("--quick", action="store_true", help="20,000 prompts, 2 runs per mode")
    p.add_argument("--rows", type=int, help="prompts in the database (default 200,000)")
    p.add_argument("--reps", type=int, help="runs per mode (default 3)")
    p.add_argument("--format", default="speculators", choices=("specforge", "speculators",
                                                               "parquet"))
    args = p.parse_args(argv)
    args.rows = args.rows or (20_000 if args.quick else 200_000)
    args.reps = args.reps or (2 if args.quick else 3)
    return args


def database(rows: int) -> str:
    """The cached database of ``rows`` prompts, written once."""
    path = WORKDIR / f"results-{rows}.db"
    done = path.with_suffix(".complete")
    if not done.exists():
        path.unlink(missing_ok=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        store = Store(f"sqlite:///{path}")
        fill(store, rows)
        store.engine.dispose()
        done.touch()
        print(f"wrote {path} ({rows:,} prompts) in {time.monotonic() - started:.0f} s",
              flush=True)
    return f"sqlite:///{path}"


def _drain(fd: int) -> None:
    while True:
        try:
            if not os.read(fd, 65536):
                return
        except OSError:  # EIO: the child closed the terminal
            return


def run_once(url: str, fmt: str, mode: str, out: Path) -> tuple[float, float]:
    """(wall s, CPU s) of one export in ``mode``."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "DATAGEN_DATABASE_URL": url, "TERM": "xterm"}
    argv = [sys.executable, "-m", "ops.cli", "export", "--format", fmt, "--out", str(out)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    if mode == "bar":
        master, slave = pty.openpty()
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=slave)
        os.close(slave)
        _drain(master)
        os.close(master)
        code = proc.wait()
    else:
        argv += ["--quiet"] if mode == "quiet" else []
        code = subprocess.run(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, check=False).returncode
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        raise SystemExit(f"export ({mode}) exited {code}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def advance_ns(mode: str, calls: int = 1_000_000) -> float:
    """Nanoseconds one ``ProgressBar.advance()`` costs in ``mode``, the console writing
    to /dev/null (best of three)."""
    from rich.console import Console

    from common.progress_bar import ProgressBar

    best = float("inf")
    with open(os.devnull, "w") as sink:
        for _ in range(3):
            console = Console(file=sink, force_terminal=mode == "bar")
            with ProgressBar("bench", "rows", calls, quiet=mode == "quiet", every_s=5.0,
                             console=console) as bar:
                started = time.perf_counter()
                for _ in range(calls):
                    bar.advance()
                best = min(best, time.perf_counter() - started)
    return best / calls * 1e9


def card_sql_s(url: str) -> float:
    """The card's SQL on its own: the prompt states and the results' finish reasons."""
    from ops.export_card import run_facts
    from ops.export_rows import snapshot_id

    store = Store(url)
    names = store.dataset_names()
    upto = {name: snapshot_id(store, name) for name in names}
    started = time.monotonic()
    run_facts(store, names, upto)
    took = time.monotonic() - started
    store.engine.dispose()
    return took


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    url = database(args.rows)
    out = WORKDIR / "export-progress"
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    cpus: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(args.reps):
        for mode in MODES:
            wall, cpu = run_once(url, args.format, mode, out)
            walls[mode].append(wall)
            cpus[mode].append(cpu)
            print(f"run {rep + 1}/{args.reps} {mode}: {wall:.1f} s wall, {cpu:.1f} s CPU",
                  flush=True)
    shutil.rmtree(out, ignore_errors=True)
    base = Summary.of(walls["quiet"]).median
    rows = [(mode, Summary.of(walls[mode]).fmt(), Summary.of(cpus[mode]).fmt(),
             f"{Summary.of(walls[mode]).median / base:.3f}") for mode in MODES]
    table(f"datagen export --format {args.format}, {args.rows:,} prompts (SQLite), "
          f"median [range] of {args.reps}", ("progress", "wall s", "CPU s", "wall / quiet"),
          rows)
    per_call = {mode: advance_ns(mode) for mode in MODES}
    table("one ProgressBar.advance() call, best of 3 x 1M", ("progress", "ns per call"),
          [(mode, f"{ns:,.0f}") for mode, ns in per_call.items()])
    card_s = card_sql_s(url)
    print(f"the card's SQL: {card_s:.2f} s")
    emit("export_progress", args, {
        "rows": args.rows, "format": args.format, "card_sql_s": card_s,
        **{f"{mode}_advance_ns": ns for mode, ns in per_call.items()},
        **{f"{mode}_wall_s": Summary.of(walls[mode]) for mode in MODES},
        **{f"{mode}_cpu_s": Summary.of(cpus[mode]) for mode in MODES},
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
