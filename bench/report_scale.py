"""``python -m bench.report_scale [--sizes 200000,1000000] [--repeat 3] [--quick]``:
``datagen report`` against SQLite databases of many results.

Each database holds the reference run's ten datasets (bench/synth.py's proportions) with
results spread over a day, outputs lognormal around 1,500 tokens under a 4,096 cap (one
dataset at its cap throughout), about 8% of prompts cut by a close, 1% failed under three
errors, 1% skipped, 2% done after retries. Rows are written straight into the tables
(the pipeline would take hours to make a million); they are cached under the bench
directory. Prints, per size, the median time of the queries alone and of the whole
report (queries, figures, page, PNGs), each with the CPU time this process spent
(SQLite runs in it; steadier than the time on a shared machine), and the page's and
PNGs' sizes.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench.harness import WORKDIR
from bench.report import Summary, emit, table
from bench.synth import counts
from common.schema import datasets, metadata, prompts, results
from common.store import Store
from ops.report import write_report
from ops.report_data import build_report

START = datetime(2026, 1, 1, tzinfo=UTC)
RUN_S = 86_400
CAP = 4096
BROKEN = "B8"
ERRORS = ("HTTP 400: prompt too long", "after 5 attempts: read timed out",
          "the database refused the result")
CHUNK = 20_000


def _dataset(name: str, used: int, closed: bool) -> dict[str, Any]:
    return {"name": name, "budget_tokens": used if closed else used * 2, "sampling": {},
            "max_seq_len": 32768, "tokenizer": "/bench", "template_hash": "h",
            "stamp": name, "state": "closed" if closed else "open",
            "close_reason": "budget" if closed else None,
            "closed_at": START + timedelta(seconds=RUN_S) if closed else None,
            "used_at_close": used if closed else None, "created_at": START,
            "updated_at": START}


def _rows(name: str, n_results: int, rng: random.Random) -> Iterator[tuple[dict, dict | None]]:
    """(prompt row, result row or None) of one dataset: results first, then the rest."""
    for k in range(n_results + n_results // 10):
        prompt = {"dataset": name, "sample_id": f"{name}-{k}", "prompt_tokens": 300,
                  "max_new_tokens": CAP, "attempts": 0, "error": None, "state": "done"}
        at = START + timedelta(seconds=RUN_S * min(k, n_results) / max(1, n_results))
        prompt["created_at"] = START
        prompt["updated_at"] = at
        if k >= n_results:
            roll = rng.random()
            prompt["state"] = "failed" if roll < 0.1 else "skipped" if roll < 0.2 else "queued"
            if prompt["state"] == "failed":
                prompt["error"] = rng.choice(ERRORS)
            yield prompt, None
            continue
        if rng.random() < 0.02:
            prompt["attempts"] = rng.randint(1, 2)
        tokens = CAP if name == BROKEN else min(CAP, round(rng.lognormvariate(7.3, 0.6)))
        yield prompt, {"dataset": name, "sample_id": prompt["sample_id"], "rid": f"r{k}",
                       "prompt_tokens": 300, "completion_tokens": tokens,
                       "finish_reason": "length" if tokens == CAP else "stop",
                       "output_ids": b"\x01\x00\x00\x00", "output_text": "x",
                       "e2e_latency_s": 1.0, "server": "sim", "model": "m",
                       "created_at": at}


def _fill(engine: sa.Engine, total: int) -> None:
    rng = random.Random(total)
    metadata.create_all(engine)
    for name, n, *_ in counts(total):
        used, batch_p, batch_r = 0, [], []
        for prompt, result in _rows(name, n, rng):
            batch_p.append(prompt)
            if result:
                batch_r.append(result)
                used += result["completion_tokens"]
            if len(batch_p) >= CHUNK:
                _write(engine, batch_p, batch_r)
                batch_p, batch_r = [], []
        _write(engine, batch_p, batch_r)
        with engine.begin() as conn:
            conn.execute(datasets.insert(), [_dataset(name, used, closed=name != "B1")])


def _write(engine: sa.Engine, batch_p: list[dict], batch_r: list[dict]) -> None:
    with engine.begin() as conn:
        if batch_p:
            conn.execute(prompts.insert(), batch_p)
        if batch_r:
            conn.execute(results.insert(), batch_r)


def database(total: int) -> str:
    """A cached SQLite database of ``total`` results; its URL."""
    path = WORKDIR / f"report-{total}.db"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        WORKDIR.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(f"sqlite:///{tmp}")
        t0 = time.monotonic()
        _fill(engine, total)
        engine.dispose()
        tmp.rename(path)
        print(f"built {path} in {time.monotonic() - t0:.0f} s", flush=True)
    return f"sqlite:///{path}"


def measure(total: int, repeat: int) -> dict[str, Any]:
    store = Store(database(total))
    queries, queries_cpu, whole, cpu = [], [], [], []
    with tempfile.TemporaryDirectory() as out:
        for _ in range(repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            build_report(store.engine)
            queries.append(time.perf_counter() - t0)
            queries_cpu.append(time.process_time() - c0)
            t0, c0 = time.perf_counter(), time.process_time()
            written = write_report(store, Path(out))
            whole.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        page_kib = written.page.stat().st_size / 1024
        png_kib = sum(p.stat().st_size for p in written.pngs) / 1024
    store.engine.dispose()
    return {"results": total, "queries_s": Summary.of(queries),
            "queries_cpu_s": Summary.of(queries_cpu), "report_s": Summary.of(whole),
            "report_cpu_s": Summary.of(cpu),
            "page_kib": round(page_kib), "png_kib": round(png_kib), "pngs": len(written.pngs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="200000,1000000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="20,000 results, one run")
    args = parser.parse_args()
    sizes = [20_000] if args.quick else [int(s) for s in args.sizes.split(",")]
    repeat = 1 if args.quick else args.repeat
    rows = [measure(total, repeat) for total in sizes]
    table("datagen report on SQLite (seconds: median [min-max])",
          ("results", "queries s", "their CPU s", "whole report s", "its CPU s", "page KiB",
           "PNGs", "PNG KiB"),
          [(f"{r['results']:,}", r["queries_s"].fmt(2), r["queries_cpu_s"].fmt(2),
            r["report_s"].fmt(2), r["report_cpu_s"].fmt(2), r["page_kib"], r["pngs"],
            r["png_kib"]) for r in rows])
    emit("report_scale", args, {"sizes": rows})


if __name__ == "__main__":
    main()
