"""Routing across servers: load-aware against round robin, one server at half speed.

Two ``datagen sim`` servers of ``--slots`` running slots each, one decoding at ``--decode``
tok/s a sequence and the other at half that, so the fleet's capacity is
``slots * decode * 1.5`` output tokens/s. Legs alternate: one ``datagen worker`` (concurrency
``--concurrency``, above the fleet's slots as a user sizes it) with load-aware routing
(``DATAGEN_LOAD_POLL_S=1``), then the same with round robin (``DATAGEN_LOAD_POLL_S=0``).
Figure: output tokens/s of both servers together, between the completions of 10% and of
80% of the leg's requests (the start, where every slot begins at once, and the tail, where
fewer requests than slots remain, are left out), against the capacity. Target: load-aware
>= 0.95 of it. Round robin splits the requests evenly, so the slow server's queue grows
until it holds the threads: about two thirds of the capacity.

    python -m bench.routing [--quick]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.harness import (
    Processes,
    bench_settings,
    clean_workdir,
    fresh_db,
    fresh_redis,
    sim_completed,
    sim_requests,
    sim_reset,
    start_sim,
    start_worker,
    wait_until,
)
from bench.report import Summary, emit, table, verdict
from bench.runs import FINISHED
from bench.synth import enqueue, prompt_files

TARGET = 0.95
STEADY = (0.1, 0.8)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="240 samples a leg, one pair")
    p.add_argument("--samples", type=int, help="samples per leg (default 720: ~90 s)")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--decode", type=float, default=100.0, help="fast server, tok/s a sequence")
    p.add_argument("--slots", type=int, default=16, help="running slots of each server")
    p.add_argument("--mean-output", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=48)
    args = p.parse_args(argv)
    if args.quick:
        args.samples, args.pairs = args.samples or 240, 1
    args.samples = args.samples or 720
    return args


def steady_rate(urls: tuple[str, ...]) -> dict[str, Any]:
    """Output tok/s of the servers together between the STEADY shares of the completions,
    and each server's share of the requests."""
    done: list[tuple[float, int, str]] = []
    for url in urls:
        done += [(e["finished_ts"], int(e["completion_tokens"]), url) for e in sim_requests(url)
                 if e.get("status") == 200 and e.get("finish_type") in FINISHED]
    done.sort()
    cut = done[int(len(done) * STEADY[0]): max(2, int(len(done) * STEADY[1]))]
    window = cut[-1][0] - cut[0][0]
    tokens = sum(n for _, n, _ in cut[1:])
    shares = {url: sum(1 for *_, u in done if u == url) / len(done) for url in urls}
    return {"tok_per_s": tokens / window if window > 0 else 0.0, "shares": shares,
            "window_s": window}


def leg(procs: Processes, urls: tuple[str, ...], args: argparse.Namespace, folder: Any,
        poll_s: float) -> dict[str, Any]:
    for url in urls:
        sim_reset(url)
    fresh_redis()
    settings = bench_settings(fresh_db("sqlite", "routing"), urls[0], args.concurrency)
    settings = settings.replace(sglang_urls=urls, load_poll_s=poll_s)
    enqueue(settings, folder, max_new_tokens=4 * args.mean_output)
    worker = start_worker(procs, settings, args.concurrency, tag="worker-routing")
    try:
        finished = wait_until(lambda: sum(sim_completed(u) for u in urls) >= args.samples,
                              timeout_s=1800, interval_s=0.5)
        if not finished:
            raise TimeoutError(f"the leg did not finish its {args.samples} requests")
    finally:
        procs.stop(worker)
    return steady_rate(urls)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    clean_workdir()
    folder = prompt_files(args.samples)
    capacity = args.slots * args.decode * 1.5
    legs: dict[str, list[dict[str, Any]]] = {"load-aware": [], "round robin": []}
    with Processes() as procs:
        fast, _ = start_sim(procs, slots=args.slots, decode=args.decode,
                            mean_output=args.mean_output, name="sim-fast")
        slow, _ = start_sim(procs, slots=args.slots, decode=args.decode / 2,
                            mean_output=args.mean_output, name="sim-slow")
        for _ in range(args.pairs):
            legs["load-aware"].append(leg(procs, (fast, slow), args, folder, 1.0))
            legs["round robin"].append(leg(procs, (fast, slow), args, folder, 0.0))
            time.sleep(1)
    rows, figures = [], {}
    for name, runs in legs.items():
        tps = Summary.of([r["tok_per_s"] for r in runs])
        share = Summary.of([100 * r["tok_per_s"] / capacity for r in runs])
        fast_share = Summary.of([100 * r["shares"][fast] for r in runs])
        rows.append((name, tps.fmt(0), share.fmt(1), fast_share.fmt(1)))
        figures[name] = {"tokens_per_s": tps, "pct_of_capacity": share,
                         "fast_server_pct": fast_share}
    ratio = Summary.of([a["tok_per_s"] / capacity for a in legs["load-aware"]])
    table(f"routing: {args.samples} samples a leg, {args.pairs} pairs; servers of {args.slots} "
          f"slots at {args.decode:g} and {args.decode / 2:g} tok/s a sequence: capacity "
          f"{capacity:,.0f} tok/s (median [min-max])",
          ["leg", "output tok/s", "% of capacity", "% of requests to the fast server"], rows)
    table("load-aware / capacity", ["figure", "value", "target"],
          [("ratio", ratio.fmt(3), f">= {TARGET} {verdict(ratio.median, TARGET)}")])
    emit("routing", args, {"samples": args.samples, "pairs": args.pairs,
                           "capacity_tok_per_s": capacity, **figures, "ratio": ratio})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
