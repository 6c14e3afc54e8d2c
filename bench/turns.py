"""Conversations regenerated turn by turn (``--turns all``) beside single-turn samples.

Three figures, printed side by side:

* the producer's rate (lines/s) on a set of 10-turn conversations, ``--turns last``
  against ``--turns all`` (which renders only each conversation's first turn);
* worker CPU per request: N single-turn samples against N turns of 10-turn
  conversations (the worker renders and tokenizes each next turn in its store step);
* the time from turn i stored (``results.created_at``) to turn i+1's request at the
  server (the simulator's ``arrived_ts``), p50 and p99: with fewer conversations than
  worker slots, so it measures the path (store, publish, consume, admit, send) and not a
  queue; on a deep queue a next turn also waits behind every message ahead of it.

    python -m bench.turns [--quick] [--dbs sqlite,postgresql]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench.harness import (
    WORKDIR,
    Processes,
    bench_settings,
    clean_workdir,
    cpu_seconds,
    fresh_db,
    fresh_redis,
    sim_requests,
    start_sim,
    start_worker,
    wait_until,
)
from bench.synth import templater, write_dataset
from common.budget import Budget
from common.celery_app import make_celery
from common.ledger import Ledger
from common.schema import prompt_inputs, results
from common.settings import Settings
from common.store import Store, as_utc
from producer.enqueue import Enqueuer, Limits
from producer.plan import DEFAULT_SAMPLING, plans_from_paths
from producer.template import ChatTemplater
from sim.reqlog import input_sha1

TURNS = 10


@dataclass(frozen=True)
class WorkerLeg:
    requests: int
    cpu_ms: float  # worker CPU per request
    gaps: list[float]  # seconds from turn i stored to turn i+1 at the server


def enqueue_turns(settings: Settings, path: Path, turns: str, max_new_tokens: int = 256,
                  parser: str | None = None) -> float:
    """Enqueue one file with ``--turns`` (and ``--tool-call-parser``); returns lines per
    second."""
    import redis

    plans = plans_from_paths([str(path)], Budget(), dict(DEFAULT_SAMPLING), max_new_tokens,
                             turns, tool_call_parser=parser)
    store, app = Store(settings.database_url), make_celery(settings)
    ledger = Ledger(redis.Redis.from_url(settings.redis_url))
    chat = (templater() if not settings.trust_remote_code else
            ChatTemplater(settings.tokenizer, trust_remote_code=True))
    started = time.perf_counter()
    [summary] = Enqueuer(store, ledger, app, chat, Limits(32768)).run(plans)
    elapsed = time.perf_counter() - started
    store.engine.dispose()
    app.close()
    return summary.read / elapsed


def producer_rates(kind: str, lines: int) -> dict[str, float]:
    folder = WORKDIR / "tmp" / "producer"
    rates = {}
    for turns in ("last", "all"):
        fresh_redis()
        settings = bench_settings(fresh_db(kind, "turns"), "http://127.0.0.1:1")
        path = write_dataset(folder, f"ten_{turns}", lines, 400, TURNS)
        templater()  # loaded before the clock starts, as a producer run loads it once
        rates[turns] = enqueue_turns(settings, path, turns)
    return rates


def worker_leg(kind: str, name: str, path: Path, mode: str, concurrency: int,
               code_tokenizer: Path | None = None, parser: str | None = None) -> WorkerLeg:
    """Run one file (dataset ``name``) through one worker process; CPU per request and
    the turn gaps. ``code_tokenizer``: a tokenizer folder that is Python code, for the
    simulator, the producer and the worker (bench/tool_turns.py)."""
    fresh_redis()
    extra = [] if code_tokenizer is None else ["--tokenizer", str(code_tokenizer),
                                               "--trust-remote-code"]
    with Processes() as procs:
        # Requests of about 0.3 s: the worker is not saturated, so the gap is the path.
        sim_url, _ = start_sim(procs, slots=256, decode=200, mean_output=60, extra=extra)
        settings = bench_settings(fresh_db(kind, "turns"), sim_url, concurrency)
        if code_tokenizer is not None:
            settings = settings.replace(tokenizer=str(code_tokenizer), trust_remote_code=True)
        enqueue_turns(settings, path, mode, parser=parser)
        store = Store(settings.database_url)
        worker = start_worker(procs, settings, concurrency, tag=name)
        # The worker's start-up (imports, tokenizer) is left out: CPU counts from its
        # first result on.
        wait_until(lambda: store.prompt_counts(name).get("done", 0) > 0, 120, 0.05)
        started = cpu_seconds(worker.pid)
        first = store.prompt_counts(name).get("done", 0)
        # Until no turn is left queued: a conversation ends early on a turn without an
        # answer, so the number of turns is not known ahead.
        wait_until(lambda: not store.prompt_counts(name).get("queued", 0), 600)
        cpu = cpu_seconds(worker.pid) - started
        done = store.prompt_counts(name).get("done", 0)
        gaps = _turn_gaps(store, name, sim_requests(sim_url)) if mode == "all" else []
        procs.stop(worker)
    return WorkerLeg(done - first, 1000 * cpu / max(1, done - first), gaps)


def _turn_gaps(store: Store, dataset: str, log: list[dict[str, Any]]) -> list[float]:
    """Seconds from each turn's result stored to its successor's request arriving."""
    arrived = {r["input_sha1"]: r["arrived_ts"] for r in log if r.get("input_sha1")}
    q = (sa.select(prompt_inputs.c.conversation, prompt_inputs.c.turn,
                   prompt_inputs.c.input_ids, results.c.created_at)
         .join(results, sa.and_(results.c.dataset == prompt_inputs.c.dataset,
                                results.c.sample_id == prompt_inputs.c.sample_id))
         .where(prompt_inputs.c.dataset == dataset))
    with store.engine.connect() as conn:
        rows = {(r.conversation, r.turn): r for r in conn.execute(q)}
    gaps = []
    for (conversation, turn), row in rows.items():
        following = rows.get((conversation, turn + 1))
        if following is None:
            continue
        sent = arrived.get(input_sha1(list(following.input_ids)))
        stored = as_utc(row.created_at)
        if sent is not None and stored is not None:
            gaps.append(sent - stored.timestamp())
    return gaps


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def turn_args(prog: str, doc: str | None, argv: list[str] | None) -> argparse.Namespace:
    """The flags of the turn benchmarks, ``--quick`` and ``--dbs``; the workdir cleaned."""
    p = argparse.ArgumentParser(prog=prog, description=doc)
    p.add_argument("--quick", action="store_true", help="smaller sets")
    p.add_argument("--dbs", default="sqlite")
    args = p.parse_args(argv)
    clean_workdir()
    return args


def main(argv: list[str] | None = None) -> int:
    args = turn_args("python -m bench.turns", __doc__, argv)
    lines = 2000 if args.quick else 10000
    conversations = 24 if args.quick else 48
    for kind in args.dbs.split(","):
        rates = producer_rates(kind, lines)
        print(f"[{kind}] producer, {lines:,} lines of {TURNS}-turn conversations: "
              f"--turns last {rates['last']:,.0f} lines/s, --turns all {rates['all']:,.0f} "
              f"lines/s (ratio {rates['all'] / rates['last']:.2f})")
        folder = WORKDIR / "tmp"
        single = worker_leg(kind, "single", write_dataset(
            folder / "single", "single", conversations * TURNS, 200, 1), "last", 64)
        multi = worker_leg(kind, "multi", write_dataset(
            folder / "multi", "multi", conversations, 200, TURNS), "all", 64)
        print(f"[{kind}] worker CPU per request: single-turn {single.cpu_ms:.2f} ms "
              f"({single.requests} requests), turn of a {TURNS}-turn conversation "
              f"{multi.cpu_ms:.2f} ms ({multi.requests} requests); ratio "
              f"{multi.cpu_ms / single.cpu_ms:.2f}")
        gaps = multi.gaps
        print(f"[{kind}] turn i stored -> turn i+1 at the server ({len(gaps)} turns, "
              f"{conversations} conversations, 64 slots): p50 "
              f"{1000 * statistics.median(gaps):.1f} ms, p99 {1000 * pct(gaps, 0.99):.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
