"""Benchmark 4b, overshoot per policy: drain, abort and exact, three datasets at once.

One worker at concurrency 64 against a simulator with 64 slots, a mean output of 4,000
tokens (lognormal, up to 16,384) and a fast decode (2,000 tok/s per sequence), each
dataset with the default budget of 10M tokens (``--quick``: 400k, 100 samples' worth,
where one long response alone is 4% of the budget). Overshoot = tokens kept − budget
(SQL); wasted = tokens of partial outputs aborted on the server (its request log);
late = requests that reached the server after the close. Targets: drain ≤ 1% of budget,
abort ≤ one response, exact 0.

Selection bias: the output lengths of the samples kept whole (all but the one `exact`
cuts) against those of the whole dataset generated without a budget, which the
simulator's seeded lengths give for every prompt without running it
(``OutputModel.natural_length`` under each prompt's cap): the Kolmogorov-Smirnov
distance between the two distributions, and the ratio of their means. A policy that
drops the requests in flight at the close (`abort`) drops the long ones, which are the
most likely to be in flight.

    python -m bench.overshoot [--quick]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import sqlalchemy as sa

from bench.harness import (
    WORKDIR,
    Processes,
    bench_settings,
    clean_workdir,
    fresh_db,
    fresh_redis,
    sim_reset,
    start_sim,
    start_worker,
    wait_until,
)
from bench.report import Summary, emit, table
from bench.synth import enqueue, write_dataset
from common.budget import Budget
from common.ledger import Ledger
from common.schema import prompt_inputs, prompts, results
from common.store import Store
from sim.outputs import OutputModel, prompt_digest
from sim.reqlog import input_sha1

POLICIES = ("drain", "abort", "exact")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.overshoot", description=__doc__)
    p.add_argument("--quick", action="store_true", help="one run, budgets of 400k")
    p.add_argument("--runs", type=int, help="default 3")
    p.add_argument("--budget", type=int, help="tokens per dataset (default 10,000,000)")
    p.add_argument("--mean-output", type=int, default=4000)
    p.add_argument("--decode", type=float, default=2000.0, help="tok/s per sequence")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--timeout", type=float, default=1500.0, help="bound of one run, s")
    args = p.parse_args(argv)
    args.runs = args.runs or (1 if args.quick else 3)
    args.budget = args.budget or (400_000 if args.quick else 10_000_000)
    return args


def prepare(args: argparse.Namespace, settings: Any, run: int) -> None:
    n = int(2.5 * args.budget / args.mean_output) + args.concurrency
    for policy in POLICIES:
        # New prompts each run: the simulator's output lengths are seeded by the prompt, so
        # the same prompts would replay the same lengths and drain the same way every run.
        rng = random.Random(f"over_{policy}-{run}")
        folder = write_dataset(WORKDIR / "tmp" / f"over-{policy}", f"over_{policy}", n, 250,
                               rng=rng)
        enqueue(settings, folder.parent, Budget(args.budget, "output", policy),  # type: ignore[arg-type]
                max_new_tokens=16384)


def finished(ledger: Ledger, sim_url: str) -> bool:
    import requests

    stats = requests.get(f"{sim_url}/sim/stats", timeout=10).json()
    states = [ledger.state(f"over_{p}") for p in POLICIES]
    return (all(s.state == "closed" and s.inflight == 0 for s in states)
            and stats["running"] + stats["waiting"] == 0)


def ks_distance(a: list[int], b: list[int]) -> float:
    """The largest gap between the two samples' empirical distribution functions."""
    a, b = sorted(a), sorted(b)
    i = j = 0
    gap = 0.0
    for x in sorted(set(a) | set(b)):
        while i < len(a) and a[i] <= x:
            i += 1
        while j < len(b) and b[j] <= x:
            j += 1
        gap = max(gap, abs(i / len(a) - j / len(b)))
    return gap


def selection_bias(store: Store, name: str, mean_output: int) -> dict[str, float]:
    """KS distance and mean ratio of the kept whole samples' lengths against the
    dataset's own, every prompt generated to its natural end or cap."""
    model = OutputModel(mean_output)
    with store.engine.connect() as conn:
        everyone = [min(model.natural_length(prompt_digest(list(ids))), int(cap))
                    for ids, cap in conn.execute(
                        sa.select(prompt_inputs.c.input_ids, prompts.c.max_new_tokens).join(
                            prompts, sa.and_(prompts.c.dataset == prompt_inputs.c.dataset,
                                             prompts.c.sample_id == prompt_inputs.c.sample_id))
                        .where(prompt_inputs.c.dataset == name, prompts.c.state != "skipped"))]
        kept = [int(n) for n in conn.scalars(
            sa.select(results.c.completion_tokens).where(
                results.c.dataset == name, results.c.finish_reason != "budget"))]
    if not kept or not everyone:
        return {"ks_distance": float("nan"), "mean_ratio": float("nan")}
    return {"ks_distance": ks_distance(kept, everyone),
            "mean_ratio": (sum(kept) / len(kept)) / (sum(everyone) / len(everyone))}


def measure(store: Store, ledger: Ledger, name: str, budget: int,
            log: list[dict[str, Any]], mean_output: int) -> dict[str, Any]:
    with store.engine.connect() as conn:
        kept, tokens, biggest = conn.execute(sa.select(
            sa.func.count(), sa.func.coalesce(sa.func.sum(results.c.completion_tokens), 0),
            sa.func.coalesce(sa.func.max(results.c.completion_tokens), 0),
        ).where(results.c.dataset == name)).one()
        ids = conn.execute(sa.select(prompt_inputs.c.input_ids)
                           .where(prompt_inputs.c.dataset == name))
        mine = {input_sha1(list(r[0])) for r in ids}
    state = ledger.state(name)
    entries = [e for e in log if e.get("input_sha1") in mine]
    aborted = [e for e in entries if e.get("finish_type") == "abort"]
    closed_at = state.closed_at or float("inf")
    return {
        "budget": budget, "kept_samples": int(kept), "kept_tokens": int(tokens),
        "overshoot": int(tokens) - budget, "overshoot_pct": 100 * (int(tokens) - budget) / budget,
        "largest_response": int(biggest), "used_at_close": state.used_at_close,
        "closed": state.state == "closed", "aborted": len(aborted),
        "wasted_tokens": sum(int(e["completion_tokens"]) for e in aborted),
        "late_requests": sum(1 for e in entries if e["arrived_ts"] > closed_at),
        "requests": len(entries),
        **selection_bias(store, name, mean_output),
    }


def one_run(procs: Processes, args: argparse.Namespace, sim_url: str,
            run: int) -> dict[str, Any]:
    import requests

    r = fresh_redis()
    settings = bench_settings(fresh_db("sqlite", "overshoot"), sim_url, args.concurrency)
    prepare(args, settings, run)
    sim_reset(sim_url)
    ledger = Ledger(r)
    worker = start_worker(procs, settings, args.concurrency)
    try:
        if not wait_until(lambda: finished(ledger, sim_url), args.timeout, 0.5):
            raise TimeoutError(f"the datasets did not all close within {args.timeout:.0f}s")
        time.sleep(1.0)  # the last stores after the last responses
    finally:
        procs.stop(worker)
    log = requests.get(f"{sim_url}/sim/requests", timeout=60).json()
    store = Store(settings.database_url)
    out = {p: measure(store, ledger, f"over_{p}", args.budget, log, args.mean_output)
           for p in POLICIES}
    store.engine.dispose()
    return out


def target(policy: str, runs: list[dict[str, Any]]) -> str:
    worst = max(r["overshoot"] for r in runs)
    if policy == "drain":
        return "met" if worst <= 0.01 * runs[0]["budget"] else "MISSED"
    if policy == "abort":
        ok = all(r["overshoot"] <= r["largest_response"] for r in runs)
        return "met" if ok else "MISSED"
    return "met" if worst <= 0 else "MISSED"


def report(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    rows: list[tuple[Any, ...]] = []
    figures: dict[str, Any] = {}
    for policy in POLICIES:
        mine = [r[policy] for r in runs]

        def s(key: str, mine: list[dict[str, Any]] = mine) -> Summary:
            return Summary.of([float(r[key]) for r in mine])

        goal = {"drain": "<= 1% of budget", "abort": "<= one response", "exact": "0"}[policy]
        rows.append((policy, s("overshoot").fmt(0), s("overshoot_pct").fmt(2),
                     s("largest_response").fmt(0), s("aborted").fmt(0),
                     s("wasted_tokens").fmt(0), s("late_requests").fmt(0),
                     s("ks_distance").fmt(3), s("mean_ratio").fmt(3),
                     f"{goal}: {target(policy, mine)}"))
        figures[policy] = {k: s(k) for k in ("overshoot", "overshoot_pct", "wasted_tokens",
                                              "aborted", "late_requests", "largest_response",
                                              "ks_distance", "mean_ratio")}
        figures[policy]["target"] = target(policy, mine)
        figures[policy]["runs"] = mine
    table(f"overshoot per policy: budget {args.budget:,} tokens each, mean output "
          f"{args.mean_output:,}, c={args.concurrency}, {args.runs} runs (median [min-max])",
          ["policy", "overshoot tokens", "% of budget", "largest response", "aborted reqs",
           "wasted tokens", "late requests", "KS distance kept/all",
           "mean length kept/all", "target"], rows)
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    clean_workdir()
    with Processes() as procs:
        sim_url, _ = start_sim(procs, slots=args.concurrency, decode=args.decode,
                               mean_output=args.mean_output)
        runs = [one_run(procs, args, sim_url, i) for i in range(args.runs)]
    figures = report(args, runs)
    emit("overshoot", args, {"budget": args.budget, "runs": args.runs,
                             **figures})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
