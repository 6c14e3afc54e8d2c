"""Concurrency auto against a sweep of fixed concurrencies, on one GPU-physics server.

One ``datagen sim --physics gpu --profile reference`` (159K KV tokens, ~930 tok/s at ~40
running with 4K-token outputs), time-scaled, per workload shape: chat (800-token
prompts, ~600-token outputs), code (1,500, ~4,000), agentic (6,000, ~8,000). Each leg
is one ``datagen worker`` over a dataset whose budget (``abort`` policy) closes in steady
state: ``--concurrency auto``, then fixed 16, 32, 64, 128, 256, 512. Auto polls the
server's load once a second of the server's clock (``--poll``), as on an unscaled server.
Figures per leg:

* output stored per second of the server's clock, over the whole leg: tokens charged by
  the budget's close, from the server's first token to the close; and the decoded tok/s
  of its start (first token to the window) and of its close (the window's end to the
  close);
* tokens decoded per second of the server's clock (idle included) in a window from 20%
  to 70% of the budget: the steady state between the start and the close (near the close
  the budget's admission holds requests back, whatever the concurrency);
* requests in flight at the server (running + waiting): the median over that window,
  and when the budget closed, against its running capacity (the most it kept running:
  the highest median running count of any leg);
* requests the server retracted in the window, and the tokens it computed again; the
  retracted requests still waiting at the window's end, and the output tokens they will
  compute again (work the window's rate has not paid), and the same just before the close;
* the window's prefill passes: their share of the server's clock, and the prompt tokens
  a pass computed (prompts are of even length, see ``prompts``, so this stays put).

``--repeats N`` runs the legs N times, every other round in reverse. A concurrency's
rate is the median of its legs, auto's included: auto and fixed 16 send in the
dataset's order, a fixed leg of more threads in the order they race for the messages, so
one such leg is one draw of request compositions (agentic 64: 313 to 348 tok/s in four
runs, when prompt lengths spread) and the best of single draws is the luckiest of them.

Targets: auto's stored rate >= 0.98 of the best fixed concurrency's (``summary`` says
why the stored rate, and not the window's); auto's in flight (the window's median, and
at the close) <= 1.25x the running capacity. The shapes' own budgets are a few
generations of requests, so that a leg takes a minute or two; on them a deep queue's
deferred recompute outlasts the window and the close. ``--budget 10M --time-scale 100``
runs a real run's budget (agentic: some 6 minutes a leg; chat at 50).

    python -m bench.concurrency [--quick] [--shapes chat,code,agentic] [--repeats N]
                                [--legs auto,64] [--longer K | --budget 10M]
                                [--time-scale X]
"""

from __future__ import annotations

import argparse
import math
import statistics
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import requests

from bench.harness import (
    MIN_POLL_S,
    SERVER_POLL_S,
    WORKDIR,
    Processes,
    bench_settings,
    clean_workdir,
    fresh_db,
    fresh_redis,
    scaled_poll_s,
    sim_requests,
    sim_reset,
    start_sim,
    start_worker,
    wait_until,
)
from bench.report import emit, table, verdict
from bench.synth import enqueue, write_dataset
from common.budget import Budget, parse_budget_tokens
from common.errors import ConfigError
from common.ledger import Ledger

SWEEP = (16, 32, 64, 128, 256, 512)
QUICK_SWEEP = (16, 64, 256)
TARGET_RATIO = 0.98
TARGET_INFLIGHT = 1.25
# The throughput window, as shares of the budget: after the start, before the close.
WINDOW = (0.2, 0.7)
LEG_TIMEOUT_S = 1200.0
# Real seconds between two readings of the server and the ledger: the close is known to
# within this times the time scale on the server's clock (3 s at agentic's own scale).
WATCH_S = 0.1
Concurrency = int | Literal["auto"]


@dataclass(frozen=True)
class Shape:
    prompt_tokens: int  # median
    output_tokens: int  # mean
    time_scale: float
    generations: int  # budget: this many turnovers of the server's running batch

    @property
    def running_estimate(self) -> int:
        """What the reference server keeps running: its cap, or what its KV pool holds."""
        return min(48, 159_000 // (self.prompt_tokens + self.output_tokens // 2))

    def budget_tokens(self, quick: bool, longer: int = 1) -> int:
        gens = max(2, self.generations // 2) if quick else self.generations * longer
        return gens * self.running_estimate * self.output_tokens


SHAPES = {
    "chat": Shape(800, 600, time_scale=5.0, generations=6),
    "code": Shape(1500, 4000, time_scale=20.0, generations=4),
    "agentic": Shape(6000, 8000, time_scale=30.0, generations=4),
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.concurrency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"sweep {QUICK_SWEEP}, half budgets")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--poll", type=float, default=SERVER_POLL_S,
                   help="auto's load poll interval in seconds of the server's clock, as on "
                        "an unscaled server (default: the worker's, %(default)s s); the "
                        "worker polls every poll / time scale real seconds, at least "
                        f"{MIN_POLL_S} s")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of the legs, every other one in reverse; each concurrency's "
                        "figure is the median of its legs (default %(default)s)")
    p.add_argument("--longer", type=int, default=1,
                   help="budgets this many times the shape's: a window that spans more "
                        "turnovers of a deep queue (default %(default)s)")
    p.add_argument("--budget", type=_budget,
                   help="every leg's budget in tokens, e.g. 10M (a real run's), in place of "
                        "the shape's few turnovers: the start and the close then weigh on "
                        "the whole leg as on a real run")
    p.add_argument("--time-scale", type=float,
                   help="every shape's time scale, in place of its own (a long budget "
                        "runs sooner at a higher one)")
    p.add_argument("--legs", help="comma-separated legs instead of auto and the sweep, e.g. "
                   "auto or 16,32 (the summary needs auto and a fixed leg)")
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    unknown = set(args.shapes) - set(SHAPES)
    if unknown:
        p.error(f"unknown shapes: {', '.join(sorted(unknown))}")
    sweep = QUICK_SWEEP if args.quick else SWEEP
    args.legs = ([x if x == "auto" else int(x) for x in args.legs.split(",")] if args.legs
                 else ["auto", *sweep])
    return args


class Watch:
    """The server's clock, tokens and batch, and the dataset's state, every ``WATCH_S``."""

    def __init__(self, url: str, ledger: Ledger, dataset: str) -> None:
        self.url, self.ledger, self.dataset = url, ledger, dataset
        self.samples: list[dict[str, Any]] = []
        self.closed_at: float | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self.closed_at is None:
            stats = requests.get(f"{self.url}/sim/stats", timeout=10).json()
            state = self.ledger.state(self.dataset)
            self.samples.append(stats | {"charged": state.used_tokens})
            if state.state == "closed":
                self.closed_at = state.closed_at or time.time()
                return
            time.sleep(WATCH_S)

    def wait(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        if self.closed_at is None:
            raise TimeoutError(f"the budget of {self.dataset} did not close")


def settle_server(url: str) -> None:
    """Nothing left running or cached from the last leg."""
    requests.post(f"{url}/abort_request", json={"abort_all": True}, timeout=10)
    wait_until(lambda: _idle(url), timeout_s=120, interval_s=0.2)
    requests.post(f"{url}/flush_cache", timeout=10)
    sim_reset(url)


def _idle(url: str) -> bool:
    stats = requests.get(f"{url}/sim/stats", timeout=10).json()
    return stats["running"] == 0 and stats["waiting"] == 0


def _budget(raw: str) -> int:
    try:
        return parse_budget_tokens(raw)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def leg_budget(shape: Shape, args: argparse.Namespace) -> int:
    return args.budget or shape.budget_tokens(args.quick, args.longer)


def leg(procs: Processes, url: str, folder: Path, name: str, shape: Shape,
        concurrency: Concurrency, args: argparse.Namespace) -> dict[str, Any]:
    settle_server(url)
    redis_client = fresh_redis()
    settings = bench_settings(fresh_db("sqlite", "concurrency"), url, concurrency)
    settings = settings.replace(load_poll_s=scaled_poll_s(shape.time_scale, args.poll),
                                max_concurrency=256)
    budget = leg_budget(shape, args)
    enqueue(settings, folder, budget=Budget(budget, policy="abort"),
            max_new_tokens=4 * shape.output_tokens, max_seq_len=65_536)
    worker = start_worker(procs, settings, concurrency, tag=f"worker-{name}-{concurrency}")
    try:
        watch = Watch(url, Ledger(redis_client), name)
        watch.wait(LEG_TIMEOUT_S)
    finally:
        procs.stop(worker)
    assert watch.closed_at is not None
    return figures(watch, sim_requests(url), budget) | {"concurrency": concurrency}


def figures(watch: Watch, log: list[dict[str, Any]], budget: int) -> dict[str, Any]:
    samples = [s for s in watch.samples if "sim_clock_s" in s]
    base = samples[0]["generated_tokens"]
    # The window ends before the budget's admission holds requests back (near the close,
    # it admits only what the budget left can take), which would cut every leg's batch.
    window = [s for s in samples
              if WINDOW[0] * budget <= s["generated_tokens"] - base <= WINDOW[1] * budget]
    start, end = window[0], window[-1]
    sim_s = end["sim_clock_s"] - start["sim_clock_s"]
    closed = watch.closed_at or 0.0
    at_close = sum(1 for e in log if e["arrived_ts"] <= closed
                   and (e.get("finished_ts") is None or e["finished_ts"] > closed))
    # The whole leg: output tokens charged (stored) by the budget's close, over the server's
    # clock from its first token to the close. It pays for a start from little in flight
    # and for partial outputs aborted at the close; retracted requests still waiting at
    # the close are aborted too, so the recompute they owed is never paid.
    first = next(s for s in samples if s["generated_tokens"] > base)
    last, before_close = samples[-1], samples[max(0, len(samples) - 2)]
    whole_s = last["sim_clock_s"] - first["sim_clock_s"]
    return {"tok_per_s": (end["generated_tokens"] - start["generated_tokens"]) / sim_s,
            "window_sim_s": sim_s,
            "whole_tok_per_s": last["charged"] / whole_s if whole_s > 0 else 0.0,
            # The whole leg's two other phases, decoded tokens over the server's clock:
            # the start (first token to the window) and the close (window to the close).
            "head_tok_per_s": _rate(first, start),
            "tail_tok_per_s": _rate(end, last),
            "mean_running": statistics.fmean(s["running"] for s in window),
            "median_running": statistics.median(s["running"] for s in window),
            "median_inflight": statistics.median(s["running"] + s["waiting"] for s in window),
            "inflight_at_close": at_close,
            # Work the server lost in the window: requests retracted, tokens computed again.
            "retracted": int(_delta(start, end, "retracted_reqs_total")),
            "recomputed_tokens": int(_delta(start, end, "recomputed_tokens_total")),
            # Prefill passes stop the whole batch's decoding: their share of the window's
            # clock, how many there were, and the prompt tokens a pass computed.
            "prefill_share": _delta(start, end, "prefill_s_total") / sim_s,
            "prefills": _delta(start, end, "prefill_steps_total"),
            "prefill_batch": (_delta(start, end, "prompt_uncached_tokens_total")
                              / max(1, _delta(start, end, "prefill_steps_total"))),
            # Retracted requests still waiting when the window ends: a deep queue puts
            # them behind itself, and the window's rate has not paid their recompute.
            "owed_at_end": end.get("waiting_retracted") or 0,
            "owed_tokens_at_end": end.get("waiting_retracted_tokens") or 0,
            # And at the close (the last reading before it: the close's aborts may be in
            # the one after), whose recompute the whole leg's rate never pays under abort.
            "owed_at_close": before_close.get("waiting_retracted") or 0,
            "owed_tokens_at_close": before_close.get("waiting_retracted_tokens") or 0}


def _delta(start: dict[str, Any], end: dict[str, Any], name: str) -> float:
    return float(end.get(name) or 0) - float(start.get(name) or 0)


def _rate(start: dict[str, Any], end: dict[str, Any]) -> float:
    sim_s = _delta(start, end, "sim_clock_s")
    return _delta(start, end, "generated_tokens") / sim_s if sim_s > 0 else 0.0


def prompts(shape_name: str, shape: Shape, n: int) -> Path:
    """The shape's prompts, all of about its prompt length. With lengths that spread
    (lognormal, as the other benchmarks draw them), which prompts a leg computes inside
    its window is a draw: chat 256 prefilled 921 tokens a request in its window where auto
    prefilled 1,049 (its stored samples averaged 963 over the whole leg, as many of the
    dataset's first prompts in auto's order 966), over 142 prefills against 143 and the
    same batch, and ran 3% faster. The window's rate then measures that draw, not how
    the server is fed."""
    folder = WORKDIR / f"concurrency-{shape_name}-{n}-even"
    if not (folder / ".complete").exists():
        write_dataset(folder, shape_name, n, shape.prompt_tokens, sigma=0.0)
        (folder / ".complete").touch()
    return folder


def run_shape(procs: Processes, name: str, shape: Shape,
              args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.time_scale:
        shape = replace(shape, time_scale=args.time_scale)
    n = math.ceil(1.5 * leg_budget(shape, args) / shape.output_tokens) + max(SWEEP)
    folder = prompts(name, shape, n)
    url, sim = start_sim(procs, slots=48, mean_output=shape.output_tokens, name=f"sim-{name}",
                         extra=("--physics", "gpu", "--profile", "reference", "--time-scale",
                                str(shape.time_scale), "--context-length", "65536"))
    try:
        legs: list[dict[str, Any]] = []
        for i in range(args.repeats):
            for concurrency in args.legs if i % 2 == 0 else args.legs[::-1]:
                legs.append(leg(procs, url, folder, name, shape, concurrency, args))
                print(f"  {name} {concurrency}: {legs[-1]}", flush=True)
        return legs
    finally:
        procs.stop(sim)


def summary(name: str, legs: list[dict[str, Any]]) -> dict[str, Any]:
    """Auto against the best fixed concurrency, on two rates: the output stored over the
    whole leg (the target's) and the tokens decoded in the window (shown beside).

    The target is the stored rate because it is what a user's GPU-hours buy. The window's
    decoded rate counts tokens a deep queue may never store: it parks retracted requests
    behind itself (their recompute put off past the window), and on a budget short
    against its queue's turnover they are still waiting at the close, which aborts them,
    partial outputs and all. Each concurrency's rate is the median of its legs
    (auto's too): a fixed leg of many threads sends in the order its threads race for the
    messages, so one leg is one draw of request compositions, and the best of a sweep of
    single draws is its luckiest."""
    whole, window = _medians(legs, "whole_tok_per_s"), _medians(legs, "tok_per_s")
    best = max((c for c in whole if c != "auto"), key=lambda c: whole[c])
    best_window = max((c for c in window if c != "auto"), key=lambda c: window[c])
    auto_legs = [g for g in legs if g["concurrency"] == "auto"]
    capacity = max(r["median_running"] for r in legs)
    inflight = max(max(g["median_inflight"], g["inflight_at_close"]) for g in auto_legs)
    return {"shape": name, "auto_tok_per_s": whole["auto"],
            "best_fixed": best, "best_fixed_tok_per_s": whole[best],
            "ratio": whole["auto"] / whole[best],
            "window_best_fixed": best_window,
            "window_ratio": window["auto"] / window[best_window],
            "running_capacity": capacity,
            "auto_inflight": max(g["median_inflight"] for g in auto_legs),
            "auto_inflight_at_close": max(g["inflight_at_close"] for g in auto_legs),
            "inflight_vs_capacity": inflight / capacity,
            "medians": {str(c): v for c, v in whole.items()},
            "window_medians": {str(c): v for c, v in window.items()}, "legs": legs}


def _medians(legs: list[dict[str, Any]], figure: str) -> dict[Concurrency, float]:
    by: dict[Concurrency, list[float]] = {}
    for g in legs:
        by.setdefault(g["concurrency"], []).append(g[figure])
    return {c: statistics.median(v) for c, v in by.items()}


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    for r in results:
        table(f"concurrency, {r['shape']}: output tok/s on the simulated clock, in flight at "
              "the budget's close", ["concurrency", "tok/s", "running: mean / median",
                                     "in flight: median", "at close", "retracted (tokens)",
                                     "retracted waiting: window end / close",
                                     "whole leg tok/s", "start / close tok/s"],
              [(str(g["concurrency"]), f"{g['tok_per_s']:.0f}",
                f"{g['mean_running']:.1f} / {g['median_running']:g}",
                f"{g['median_inflight']:g}", str(g["inflight_at_close"]),
                f"{g.get('retracted', 0)} ({g.get('recomputed_tokens', 0):,})",
                f"{g.get('owed_at_end', 0)} / {g.get('owed_at_close', 0)}",
                f"{g.get('whole_tok_per_s', 0):.0f}",
                f"{g.get('head_tok_per_s', 0):.0f} / {g.get('tail_tok_per_s', 0):.0f}")
               for g in r["legs"]])
    table("concurrency auto against the best fixed (one run; the machine is shared)",
          ["shape", "auto / best fixed: stored, whole leg", "target",
           "decoded, window (shown)", "in flight at close / capacity", "target"],
          [_verdicts(r) for r in results])
    emit("concurrency", args, {"shapes": results,
                               "worst_ratio": min(r["ratio"] for r in results),
                               "worst_inflight_vs_capacity":
                                   max(r["inflight_vs_capacity"] for r in results)})


def _verdicts(r: dict[str, Any]) -> tuple[str, ...]:
    share = r["inflight_vs_capacity"]
    return (r["shape"], f"{r['ratio']:.3f} (best: {r['best_fixed']})",
            f">= {TARGET_RATIO} {verdict(r['ratio'], TARGET_RATIO)}",
            f"{r['window_ratio']:.3f} (best: {r['window_best_fixed']})",
            f"{share:.2f} ({r['auto_inflight']:g}, at close {r['auto_inflight_at_close']} / "
            f"{r['running_capacity']:g})",
            f"<= {TARGET_INFLIGHT} {verdict(share, TARGET_INFLIGHT, higher_is_better=False)}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    clean_workdir()
    with Processes() as procs:
        legs = {name: run_shape(procs, name, SHAPES[name], args) for name in args.shapes}
    if "auto" not in args.legs or len(args.legs) < 2:
        return 0  # the legs' figures are printed as they end
    report([summary(name, runs) for name, runs in legs.items()], args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
