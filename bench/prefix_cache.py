"""Next turns ahead of new conversations against FIFO scheduling, on the prefix cache.

A set of 4-turn conversations (``--turns all``) runs through one worker against the
GPU-physics simulator (reference profile: 159K KV tokens, radix prefix cache with LRU
eviction), time-scaled. Turn i+1's prompt starts with turn i's prompt (and answer), so
it is a cache hit if turn i's KV is still in the pool when it is prefilled. Two legs,
same data, same simulator settings, one after the other:

* ``ahead``: what datagen does, a next turn is queued ahead of the new conversations
  (kombu priority 0, common/keys.py);
* ``fifo``: a next turn is queued behind them, at the new prompts' priority (the worker
  started through ``--fifo-worker``, which sets ``common.publish.AHEAD_PRIORITY`` to
  ``PROMPT_PRIORITY``: the same code path, the tail of the queue).

Figures per leg, from the stored results (SGLang's ``meta_info.cached_tokens`` of each
request): the prefix-cache hit rate of the later turns' prompts and of all, the prompt
tokens prefilled (sent minus cached; a retraction's recomputation is not in it); from the
simulator, the requests it retracted and the simulated GPU seconds the run took (what a
real server would spend); and the wall time. Printed side by side with their ratios.

    python -m bench.prefix_cache [--quick] [--conversations N] [--time-scale X]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import requests
import sqlalchemy as sa

from bench.harness import (
    WORKDIR,
    Processes,
    bench_settings,
    clean_workdir,
    fresh_db,
    fresh_redis,
    start_sim,
    wait_until,
)
from bench.synth import write_dataset
from bench.turns import enqueue_turns
from common.schema import prompt_inputs, results
from common.store import Store

TURNS = 4
# Median prompt tokens of a whole conversation as the synthetic lines hold it (each of its
# seven messages about 400): turn 1 is about 430 tokens, turn 4 about 2,800 with answers.
MEDIAN_TOKENS = 2800
MEAN_OUTPUT = 1000
CONCURRENCY = 64


def _start_worker(procs: Processes, settings: Any, fifo: bool, tag: str) -> Any:
    entry = ["-m", "bench.prefix_cache", "--fifo-worker"] if fifo else ["-m", "ops.cli", "worker"]
    argv = [sys.executable, *entry, "--concurrency", str(CONCURRENCY), "--loglevel", "WARNING"]
    return procs.start(argv, env=settings.to_env(), log=WORKDIR / f"{tag}.log")


def _hits(store: Store, dataset: str) -> dict[str, int]:
    """Prompt, cached and prefilled (computed) tokens of all results, and the prompt and
    cached tokens of the later turns'."""
    q = (sa.select(prompt_inputs.c.turn, results.c.prompt_tokens, results.c.cached_tokens)
         .join(results, sa.and_(results.c.dataset == prompt_inputs.c.dataset,
                                results.c.sample_id == prompt_inputs.c.sample_id))
         .where(prompt_inputs.c.dataset == dataset))
    out = dict.fromkeys(("requests", "prompt", "cached", "prefilled", "later_prompt",
                         "later_cached"), 0)
    with store.engine.connect() as conn:
        for turn, prompt, cached in conn.execute(q):
            out["requests"] += 1
            out["prompt"] += prompt
            out["cached"] += cached
            out["prefilled"] += prompt - cached
            if turn and turn > 1:
                out["later_prompt"] += prompt
                out["later_cached"] += cached
    return out


def _server(sim_url: str) -> dict[str, Any]:
    """The simulated GPU seconds the run took and the requests the server retracted."""
    from prometheus_client.parser import text_string_to_metric_families

    stats = requests.get(f"{sim_url}/sim/stats", timeout=10).json()
    text = requests.get(f"{sim_url}/metrics", timeout=10).text
    retracted = sum(int(sample.value) for family in text_string_to_metric_families(text)
                    if family.name == "sglang:num_retracted_requests"
                    for sample in family.samples)
    return {"gpu_s": float(stats["simulated_s"]), "retracted": retracted}


def leg(mode: str, conversations: int, time_scale: float) -> dict[str, Any]:
    """One run of the conversation set; its cache figures and wall time."""
    fresh_redis()
    name = f"pc{mode}"
    with Processes() as procs:
        sim_url, _ = start_sim(procs, slots=48, mean_output=MEAN_OUTPUT, name=f"sim-{mode}",
                               extra=["--physics", "gpu", "--profile", "reference",
                                      "--time-scale", str(time_scale)])
        settings = bench_settings(fresh_db("sqlite", f"prefix-{mode}"), sim_url, CONCURRENCY)
        # The same lines for both legs: the dataset's name seeds them, so it is shared.
        path = write_dataset(WORKDIR / "tmp" / mode, "conv", conversations, MEDIAN_TOKENS,
                             TURNS)
        path = path.rename(path.with_name(f"{name}.jsonl"))
        enqueue_turns(settings, path, "all", max_new_tokens=4096)
        store = Store(settings.database_url)
        started = time.monotonic()
        worker = _start_worker(procs, settings, mode == "fifo", f"worker-{mode}")
        wait_until(lambda: not store.prompt_counts(name).get("queued", 0), 3600, 0.5)
        wall = time.monotonic() - started
        procs.stop(worker)
        figures = {**_hits(store, name), **_server(sim_url), "wall_s": wall}
        store.engine.dispose()
    return figures


def _rate(cached: int, prompt: int) -> float:
    return cached / prompt if prompt else 0.0


def report(ahead: dict[str, Any], fifo: dict[str, Any]) -> list[str]:
    rows = [
        ("requests (turns stored)", "requests", "{:,}"),
        ("prompt tokens sent", "prompt", "{:,}"),
        ("prompt tokens prefilled (computed)", "prefilled", "{:,}"),
        ("requests retracted (KV pool outgrown)", "retracted", "{:,}"),
        ("simulated GPU time, s", "gpu_s", "{:,.0f}"),
        ("wall time, s (time-scaled)", "wall_s", "{:.1f}"),
    ]
    lines = [f"{'':40} {'ahead':>12} {'fifo':>12} {'ahead/fifo':>11}"]
    for label, key, fmt in rows:
        a, f = ahead[key], fifo[key]
        lines.append(f"{label:40} {fmt.format(a):>12} {fmt.format(f):>12} "
                     f"{(a / f if f else float('nan')):>11.3f}")
    for label, c, p in (("cache hit rate, turns 2-4", "later_cached", "later_prompt"),
                        ("cache hit rate, all turns", "cached", "prompt")):
        a, f = _rate(ahead[c], ahead[p]), _rate(fifo[c], fifo[p])
        lines.append(f"{label:40} {a:>12.3f} {f:>12.3f} "
                     f"{(a / f if f else float('nan')):>11.3f}")
    return lines


def _fifo_worker(argv: list[str]) -> int:
    """``datagen worker`` whose next turns go to the tail (the FIFO leg's baseline)."""
    import common.publish
    from common.keys import PROMPT_PRIORITY
    from ops.cli import main as cli_main

    common.publish.AHEAD_PRIORITY = PROMPT_PRIORITY  # type: ignore[misc]
    return cli_main(["worker", *argv])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--fifo-worker"]:
        return _fifo_worker(argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench.prefix_cache", description=__doc__)
    p.add_argument("--quick", action="store_true", help="120 conversations")
    p.add_argument("--conversations", type=int, default=None)
    p.add_argument("--time-scale", type=float, default=50.0)
    args = p.parse_args(argv)
    clean_workdir()
    n = args.conversations or (120 if args.quick else 240)
    ahead = leg("ahead", n, args.time_scale)
    fifo = leg("fifo", n, args.time_scale)
    print(f"{n} conversations of {TURNS} turns, GPU-physics simulator (reference profile, "
          f"time scale {args.time_scale:g}), one worker of {CONCURRENCY} threads, shared "
          "machine")
    print("\n".join(report(ahead, fifo)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
