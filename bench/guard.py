"""Benchmark 4a, guard latency: the crossing charge, and the close that follows it.

The charge that crosses a budget closes the dataset and purges its queue inside the same
Lua script, so the guard's latency is that ``Ledger.charge`` call's, measured here with
0, 1,000 and 10,000 real producer messages queued. ``after_close`` (SQL record + one
revoke broadcast; under abort also ``/abort_request`` per request in flight) is measured
separately: against one server, and against a fleet of ``FLEET`` (its requests spread
over them; each abort sent to the server its rid names, the servers side by side), beside
the same close with every rid sent to every server in turn, as it was before rids named
their server. Target: p99 < 50 ms.

    python -m bench.guard [--quick]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import redis

from bench.harness import (
    Processes,
    bench_settings,
    fresh_db,
    fresh_redis,
    start_sim,
)
from bench.report import emit, percentile, table, verdict
from common.budget import Budget
from common.celery_app import make_celery
from common.closing import after_close
from common.keys import dataset_keys, queue_name
from common.ledger import Ledger
from common.publish import Publisher
from common.rids import new_rid
from common.sglang_client import SGLangClient
from common.store import DatasetRow, Store

TARGET_MS = 50.0
BUDGET = 1000
INFLIGHT = 64
FLEET = 4
# The case closing with each rid aborted on every server in turn, as the code did before
# rids named their server: shown beside the real close, not held to the target.
REFERENCE = "every rid to every server"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.guard", description=__doc__)
    p.add_argument("--quick", action="store_true", help="50 crossings per case")
    p.add_argument("--crossings", type=int, help="crossings per case (default 200)")
    p.add_argument("--queued", default="0,1000,10000", help="messages queued at the crossing")
    p.add_argument("--dbs", default="sqlite,postgresql")
    args = p.parse_args(argv)
    args.crossings = args.crossings or (50 if args.quick else 200)
    return args


def sample_message(r: redis.Redis, settings: Any) -> bytes:
    """One real message as the producer publishes it (kombu JSON envelope, stamped)."""
    Publisher(make_celery(settings)).publish("probe", "probe@0", ["h0123456789abcdef"])
    lists = dataset_keys("probe").queue_lists
    raw = next((m for m in (r.lindex(k, 0) for k in lists) if m is not None), None)
    assert raw is not None, "the probe message did not reach Redis"
    r.delete(*lists)
    return raw if isinstance(raw, bytes) else str(raw).encode()


def fill(r: redis.Redis, name: str, message: bytes, n: int) -> None:
    pipe = r.pipeline(transaction=False)
    for start in range(0, n, 1000):
        pipe.lpush(queue_name(name), *([message] * min(1000, n - start)))
    pipe.execute()


def drop(r: redis.Redis, name: str) -> None:
    """Every key of the dataset (found by prefix: the key set changes as datagen does)."""
    prefix = dataset_keys(name).ledger.rsplit(":", 1)[0]
    r.delete(*r.keys(f"{prefix}:*"), *dataset_keys(name).queue_lists)


def charge_latencies(r: redis.Redis, ledger: Ledger, message: bytes, queued: int,
                     crossings: int) -> tuple[list[float], list[float]]:
    """(ms of an ordinary charge, ms of the crossing charge that purges ``queued``)."""
    plain, crossing = [], []
    for i in range(crossings):
        name = f"guard{queued}x{i}"
        ledger.configure(name, Budget(BUDGET, "output", "drain"))
        fill(r, name, message, queued)
        t0 = time.perf_counter()
        ledger.charge(name, "s0", "r0", 10, BUDGET // 2)
        t1 = time.perf_counter()
        res = ledger.charge(name, "s1", "r1", 10, BUDGET)
        t2 = time.perf_counter()
        if not res.crossed or res.purged != queued or r.llen(queue_name(name)):
            raise AssertionError(f"{name}: crossing did not close and purge: {res}")
        plain.append(1000 * (t1 - t0))
        crossing.append(1000 * (t2 - t1))
        drop(r, name)
    return plain, crossing


class EveryServerInTurn(SGLangClient):
    """The reference: each rid aborted on every server, one call after another."""

    def abort_many(self, rids: Sequence[str]) -> int:
        return sum(self._abort_on(server, [rid]) for rid in rids for server in self.urls)


def close_latencies(store: Store, ledger: Ledger, app: Any, client: SGLangClient | None,
                    policy: str, crossings: int, tag: str = "") -> list[float]:
    """ms of ``after_close`` right after a crossing (``INFLIGHT`` requests under abort,
    spread over the client's servers as the workers' round robin spreads them)."""
    out = []
    for i in range(crossings):
        name = f"close{policy}{tag}{i}"
        budget = Budget(BUDGET, "output", policy)  # type: ignore[arg-type]
        store.upsert_dataset(DatasetRow(name, budget, {}, 32768, "tok", "hash"))
        ledger.configure(name, budget)
        if client is not None:
            for k in range(INFLIGHT):
                ledger.admit(name, new_rid(name, client.urls[k % len(client.urls)]), 100, 100)
        ledger.charge(name, "s1", "r1", 10, BUDGET)
        t0 = time.perf_counter()
        after_close(name, store=store, ledger=ledger, app=app, client=client)
        out.append(1000 * (time.perf_counter() - t0))
        drop(ledger.redis, name)
    return out


def row(label: str, values: list[float], reference: bool) -> tuple[Any, ...]:
    p99 = percentile(values, 99)
    judged = "reference" if reference else verdict(p99, TARGET_MS, higher_is_better=False)
    return (label, len(values), f"{percentile(values, 50):.2f}", f"{p99:.2f}",
            f"{max(values):.2f}", judged)


def run(args: argparse.Namespace) -> dict[str, Any]:
    r = fresh_redis()
    ledger = Ledger(r)
    cases: dict[str, list[float]] = {}
    references: set[str] = set()  # cases shown for comparison, not held to the target
    with Processes() as procs:
        sim_url, _ = start_sim(procs, slots=64, decode=0, mean_output=16)
        fleet = (sim_url, *(start_sim(procs, slots=64, decode=0, mean_output=16,
                                      name=f"sim{k}")[0] for k in range(1, FLEET)))
        settings = bench_settings(fresh_db("sqlite", "guard"), sim_url)
        message = sample_message(r, settings)
        for n in (int(q) for q in args.queued.split(",") if q):
            plain, crossing = charge_latencies(r, ledger, message, n, args.crossings)
            cases.setdefault("charge, not crossing", []).extend(plain)
            cases[f"charge crossing + purge of {n:,} queued"] = crossing
        for kind in (k for k in args.dbs.split(",") if k):
            store = Store(fresh_db(kind, "guard"))
            app = make_celery(settings)
            client = SGLangClient((sim_url,))
            cases[f"after_close drain, {kind} (SQL + revoke)"] = close_latencies(
                store, ledger, app, None, "drain", args.crossings)
            cases[f"after_close abort, {kind}, {INFLIGHT} in flight"] = close_latencies(
                store, ledger, app, client, "abort", args.crossings)
            if kind == args.dbs.split(",")[0]:
                on = f"{INFLIGHT} in flight on {FLEET} servers"
                cases[f"after_close abort, {kind}, {on}"] = close_latencies(
                    store, ledger, app, SGLangClient(fleet), "abort", args.crossings, "fleet")
                reference = f"after_close abort, {kind}, {on}, {REFERENCE}"
                references.add(reference)
                cases[reference] = close_latencies(store, ledger, app, EveryServerInTurn(fleet),
                                                   "abort", args.crossings, "every")
            store.engine.dispose()
            app.close()
    r.flushdb()
    table(f"guard latency, ms (budget {BUDGET} tokens; target p99 < {TARGET_MS:g} ms)",
          ["case", "n", "p50", "p99", "max", "p99 target"],
          [row(k, v, k in references) for k, v in cases.items()])
    return {k: {"n": len(v), "p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99),
                "max_ms": max(v), "reference": k in references} for k, v in cases.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    figures = run(args)
    emit("guard", args, {"crossings": args.crossings, "cases": figures})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
