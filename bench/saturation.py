"""Benchmark 1, saturation: does the pipeline keep a server as busy as a bare client?

One ``datagen sim`` (48 running slots, mean output 300 tokens, 100 tok/s per sequence,
so at most 4,800 tok/s). Legs alternate A B A B ...: A = enqueue + one ``datagen worker``
(concurrency 64); B = an asyncio/aiohttp client keeping the same 64 requests in flight,
with the same prompt ids and sampling. Figure: output tokens/s over the busy window (first
to last completion, from the server's log); target A / B ≥ 0.97.

    python -m bench.saturation [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import (
    WORKDIR,
    Processes,
    bench_settings,
    clean_workdir,
    fresh_db,
    fresh_redis,
    sim_requests,
    sim_reset,
    start_sim,
)
from bench.report import Summary, emit, table, verdict
from bench.runs import Leg, busy_window, dump_payloads, pipeline_leg
from bench.synth import enqueue, prompt_files

TARGET = 0.97
MAX_NEW_TOKENS = 1024  # bounds the tail: the last request ends ≤ 10 s after the others


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.saturation", description=__doc__)
    p.add_argument("--quick", action="store_true", help="~10 s legs (160 samples)")
    p.add_argument("--samples", type=int, help="samples per leg (default 960: ~60 s)")
    p.add_argument("--pairs", type=int, default=3, help="A B pairs")
    p.add_argument("--decode", type=float, default=100.0, help="tok/s per sequence")
    p.add_argument("--slots", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=64)
    args = p.parse_args(argv)
    args.samples = args.samples or (160 if args.quick else 960)
    return args


def bodies(payload_file: str) -> list[dict[str, Any]]:
    """The pipeline's /generate bodies, datasets interleaved as the worker consumes them."""
    payloads: dict[str, Any] = json.loads(Path(payload_file).read_text(encoding="utf-8"))
    by_ds: dict[str, list[dict[str, Any]]] = {}
    for key, p in payloads.items():
        ds = key.split("/", 1)[0]
        by_ds.setdefault(ds, []).append({"rid": ds, "input_ids": p["input_ids"],
                                         "sampling_params": p["sampling"], "stream": False})
    rounds = itertools.zip_longest(*by_ds.values())
    return [b for group in rounds for b in group if b is not None]


async def drive(url: str, todo: list[dict[str, Any]], concurrency: int) -> int:
    """Keep ``concurrency`` requests in flight until ``todo`` is done; returns failures."""
    pending = list(reversed(todo))
    failures = 0
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def lane() -> None:
            nonlocal failures
            while pending:
                body = pending.pop()
                body = {**body, "rid": f"{uuid.uuid4().hex}-{body['rid']}"}
                async with session.post(f"{url}/generate", json=body) as resp:
                    await resp.read()
                    failures += resp.status != 200

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    return failures


def bare_leg(sim: tuple[str, int], todo: list[dict[str, Any]], concurrency: int) -> Leg:
    sim_reset(sim[0])
    failures = asyncio.run(drive(sim[0], todo, concurrency))
    leg = busy_window(sim_requests(sim[0]), Leg("bare asyncio client"))
    leg.extra["failures"] = failures
    return leg


def run(args: argparse.Namespace) -> dict[str, Any]:
    clean_workdir()
    folder = prompt_files(args.samples)
    legs: dict[str, list[Leg]] = {"pipeline": [], "bare": []}
    with Processes() as procs:
        url, proc = start_sim(procs, slots=args.slots, decode=args.decode, mean_output=300)
        sim = (url, proc.pid)
        fresh_redis()
        ref = bench_settings(fresh_db("sqlite", "sat-ref"), url, args.concurrency)
        enqueue(ref, folder, max_new_tokens=MAX_NEW_TOKENS)
        dump_payloads(ref, WORKDIR / "tmp" / "sat-payloads.json")
        todo = bodies(str(WORKDIR / "tmp" / "sat-payloads.json"))
        for _ in range(args.pairs):
            fresh_redis()
            settings = bench_settings(fresh_db("sqlite", "sat"), url, args.concurrency)
            enqueue(settings, folder, max_new_tokens=MAX_NEW_TOKENS)
            legs["pipeline"].append(pipeline_leg(procs, "pipeline (1 worker)", settings, sim,
                                                 args.samples))
            legs["bare"].append(bare_leg(sim, todo, args.concurrency))
    return report(args, legs)


def report(args: argparse.Namespace, legs: dict[str, list[Leg]]) -> dict[str, Any]:
    ceiling = args.slots * args.decode
    ratios = Summary.of([a.tokens_per_s / b.tokens_per_s
                         for a, b in zip(legs["pipeline"], legs["bare"], strict=True)
                         if b.tokens_per_s])
    rows: list[tuple[Any, ...]] = []
    figures: dict[str, Any] = {}
    for kind, runs in legs.items():
        tps = Summary.of([leg.tokens_per_s for leg in runs])
        window = Summary.of([leg.window_s for leg in runs])
        util = Summary.of([100 * leg.tokens_per_s / ceiling for leg in runs])
        rows.append((runs[0].label, tps.fmt(0), util.fmt(1), window.fmt(1),
                     Summary.of([leg.cpu_ms_per_task("workers") for leg in runs]).fmt(2)
                     if kind == "pipeline" else "-"))
        figures[kind] = {"tokens_per_s": tps, "utilization_pct": util, "window_s": window}
    table(f"saturation: {args.samples} samples/leg, {args.pairs} pairs A B, {args.slots} slots x "
          f"{args.decode:g} tok/s = {ceiling:,.0f} tok/s ceiling (median [min-max])",
          ["leg", "output tok/s", "% of ceiling", "busy window s", "worker CPU ms/task"], rows)
    table("ratio pipeline / bare (per pair, side by side)", ["figure", "value", "target"],
          [("tokens/s ratio", ratios.fmt(3), f">= {TARGET} {verdict(ratios.median, TARGET)}")])
    figures["ratio"] = ratios
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    figures = run(args)
    emit("saturation", args, {"samples": args.samples,
                              "pairs": args.pairs, **figures})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
