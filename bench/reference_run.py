"""The reference run on the reference server, time-scaled: simulated GPU-hours to finish.

The reference run: 88,088 prompts over 10 datasets, a 10M output-token budget each, on one
8-GPU SGLang server (~930 output tok/s, 159K KV tokens); its operators estimated 17-26 h
at their hand-tuned settings (../shared/BRIEF.md). Here: the same 10 datasets in the same
proportions (``bench.synth``), a ``drain`` budget each, one ``datagen sim --physics gpu
--profile reference`` whose outputs average ``--mean-output`` tokens (2,420: the reference
run's ~92M tokens over ~38K samples), ``--workers`` worker processes at each
``--concurrency`` (legs run one after another on fresh Redis and SQL).

Everything is scaled down by ``--scale`` (prompts and budgets divided by it) so that a leg
takes minutes, and the simulator runs ``--time-scale`` times faster than real time. The
figure is the simulated server's clock (``/sim/stats`` ``sim_clock_s``: its forward passes plus
its idle time, not the simulator's own Python overhead) from the first request to the
last response, times ``--scale``: GPU-hours of the full run. Scaling keeps the share of
the run that drains the last requests of each dataset constant in absolute time, so the
smaller the run, the more that tail weighs: the figure is an upper estimate. Beside it:
output tokens, samples, the mean running batch, retractions, and the worst overshoot in
tokens (absolute: the requests in flight at a close do not shrink with the budget).

    python -m bench.reference_run [--quick] [--concurrency auto,64] [--scale 10]
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Literal

import requests

from bench.harness import (
    Processes,
    bench_settings,
    clean_workdir,
    fresh_db,
    fresh_redis,
    scaled_poll_s,
    start_sim,
    start_worker,
    wait_until,
)
from bench.report import emit, table
from bench.synth import REFERENCE_TOTAL, enqueue, prompt_files
from common.budget import Budget
from common.ledger import Ledger
from common.store import Store

REFERENCE_HOURS = (17.0, 26.0)
FULL_BUDGET = 10_000_000
KV_TOKENS = 159_000


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.reference_run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="--scale 50: a leg of a minute or so")
    p.add_argument("--scale", type=int, default=10, help="prompts and budgets divided by it")
    p.add_argument("--time-scale", type=float, default=100.0)
    p.add_argument("--mean-output", type=int, default=2420)
    p.add_argument("--concurrency", default="auto,64",
                   help="comma-separated worker concurrencies (a number or auto), a leg each")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3600.0, help="bound of one leg, s")
    args = p.parse_args(argv)
    if args.quick:
        args.scale = 50
    args.concurrency = [c.strip() for c in str(args.concurrency).split(",") if c.strip()]
    return args


def sim_stats(url: str) -> dict[str, Any]:
    return dict(requests.get(f"{url}/sim/stats", timeout=10).json())


def settled(ledger: Ledger, store: Store, names: list[str], url: str) -> bool:
    """Every dataset closed with nothing in flight, or out of prompts; the server idle."""
    stats = sim_stats(url)
    if stats["running"] + stats["waiting"]:
        return False
    for name in names:
        state = ledger.state(name)
        if state.state == "closed":
            if state.inflight:
                return False
        elif store.prompt_counts(name).get("queued", 0):
            return False
    return True


def one_leg(procs: Processes, args: argparse.Namespace, url: str, folder: Any,
            concurrency: str) -> dict[str, Any]:
    r = fresh_redis()
    budget = FULL_BUDGET // args.scale
    threads: int | Literal["auto"] = "auto" if concurrency == "auto" else int(concurrency)
    settings = bench_settings(fresh_db("sqlite", "refrun"), url, threads)
    # Auto polls once a second of the server's clock, as it would an unscaled server.
    settings = settings.replace(load_poll_s=scaled_poll_s(args.time_scale))
    summaries = enqueue(settings, folder, Budget(budget, "output", "drain"),
                        max_new_tokens=16384)
    names = [s.name for s in summaries]
    store, ledger = Store(settings.database_url), Ledger(r)
    requests.post(f"{url}/sim/reset", timeout=10).raise_for_status()
    workers = [start_worker(procs, settings, threads, tag=f"worker-refrun-{i}")
               for i in range(args.workers)]
    try:
        if not wait_until(lambda: sim_stats(url)["requests"] > 0, 120, 0.05):
            raise TimeoutError("no request reached the simulator")
        started = sim_stats(url)["sim_clock_s"]
        samples: list[int] = []

        def done() -> bool:
            samples.append(int(sim_stats(url)["running"]))
            return settled(ledger, store, names, url)

        if not wait_until(done, args.timeout, 0.5):
            raise TimeoutError(f"the run did not settle within {args.timeout:.0f}s")
        end = sim_stats(url)
    finally:
        for worker in workers:
            procs.stop(worker)
    sim_s = float(end["sim_clock_s"]) - float(started)
    used = {name: ledger.state(name).used_tokens for name in names}
    store.engine.dispose()
    return {
        "concurrency": concurrency, "sim_s": sim_s,
        "full_hours": sim_s * args.scale / 3600,
        "output_tokens": int(end["output_tokens"]), "samples": int(end["completed"]),
        "tok_per_s": int(end["output_tokens"]) / sim_s if sim_s > 0 else 0.0,
        "mean_running": sum(samples) / len(samples) if samples else 0.0,
        "retracted": int(end["retracted_reqs_total"]), "budget": budget,
        "overshoot": {n: u - budget for n, u in used.items() if u >= budget},
        "unfilled": {n: u for n, u in used.items() if u < budget},
    }


def report(args: argparse.Namespace, legs: list[dict[str, Any]]) -> None:
    rows = []
    for leg in legs:
        worst = max(leg["overshoot"].values(), default=0)
        rows.append((leg["concurrency"], f"{leg['sim_s'] / 3600:.2f}",
                     f"{leg['full_hours']:.1f}", f"{leg['output_tokens'] * args.scale:,}",
                     f"{leg['samples'] * args.scale:,}", f"{leg['tok_per_s']:.0f}",
                     f"{leg['mean_running']:.1f}", f"{leg['retracted']:,}",
                     f"{worst:,}", ", ".join(sorted(leg["unfilled"]))))
    low, high = REFERENCE_HOURS
    table(f"the reference run, 1/{args.scale} scale, time-scaled x{args.time_scale:g}: "
          f"{REFERENCE_TOTAL // args.scale:,} prompts, 10 datasets of "
          f"{FULL_BUDGET // args.scale:,} tokens (drain), mean output {args.mean_output:,}; "
          f"reference estimate {low:g}-{high:g} h",
          ["concurrency", "simulated h (this scale)", "GPU-hours, full run",
           "output tokens, full run", "samples, full run", "output tok/s",
           "mean running", "retracted requests", "worst overshoot, tokens",
           "budget not filled (out of prompts)"], rows)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    clean_workdir()
    folder = prompt_files(REFERENCE_TOTAL // args.scale)
    legs = []
    with Processes() as procs:
        url, _ = start_sim(procs, slots=1024, mean_output=args.mean_output,
                           extra=["--physics", "gpu", "--profile", "reference",
                                  "--time-scale", str(args.time_scale)],
                           name="sim-refrun")
        for concurrency in args.concurrency:
            legs.append(one_leg(procs, args, url, folder, concurrency))
            time.sleep(1)
    report(args, legs)
    emit("reference_run", args, {"legs": legs, "reference_hours": REFERENCE_HOURS,
                                 "kv_tokens": KV_TOKENS})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
