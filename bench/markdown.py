"""``python -m bench.markdown RESULTS.json``: the figures of a run as Markdown tables.

RESULTS.json is what ``python -m bench`` writes; docs/PERFORMANCE.md quotes these
tables, so its numbers come from one file rather than from copying by hand.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.memory import LONG_DBS, long_key
from bench.summary import headline


def md(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def s(v: Any, digits: int = 1) -> str:
    """A Summary dict as ``median [min-max]``."""
    if not isinstance(v, dict) or "median" not in v:
        return "-" if v is None else (f"{v:,.{digits}f}" if isinstance(v, float) else str(v))
    if v.get("n", 1) <= 1 or v["min"] == v["max"]:
        return f"{v['median']:,.{digits}f}"
    return f"{v['median']:,.{digits}f} [{v['min']:,.{digits}f}-{v['max']:,.{digits}f}]"


def _saturation(r: dict[str, Any]) -> str:
    return md(["leg", "output tok/s", "% of ceiling", "busy window s"],
              [(k, s(r[k]["tokens_per_s"], 0), s(r[k]["utilization_pct"]), s(r[k]["window_s"]))
               for k in ("pipeline", "bare")]) + f"\nratio pipeline / bare: {s(r['ratio'], 3)}\n"


def _overhead(r: dict[str, Any]) -> str:
    out = md(["leg", "completions/s", "ratio to bare", "worker CPU ms/task",
              "worker switches/task", "consumer CPU ms/task", "consumer switches/task",
              "sim CPU ms/task", "sim % of a core"],
             [(k, s(v["rate"]), s(v["ratio_to_bare"], 3), s(v["worker_cpu_ms_per_task"], 2),
               s(v.get("worker_switches_per_task"), 1),
               s(v.get("consumer_cpu_ms_per_task"), 2),
               s(v.get("consumer_switches_per_task"), 1), s(v["sim_cpu_ms_per_task"], 2),
               s(v["sim_core_pct"], 0))
              for k, v in r.items() if isinstance(v, dict) and "rate" in v])
    prof = r.get("profile", {}).get("gil")
    if prof:
        out += f"\nworker profile, GIL holder ({prof['samples']} samples):\n\n"
        out += md(["pipeline step", "% samples"], [(k, f"{v:.1f}") for k, v in prof["steps"]])
        out += "\n" + md(["activity", "% samples"],
                         [(k, f"{v:.1f}") for k, v in prof["activities"][:14]])
    return out


def _producer(r: dict[str, Any]) -> str:
    out = md(["db", "prompts", "prompts/s", "wall s", "CPU cores used"],
             [(k, f"{int(v['prompts']):,}", s(v["rate"], 0), s(v["wall_s"]), s(v["cores"], 2))
              for k, v in r.items() if isinstance(v, dict) and "rate" in v])
    out += f"\ntokenizer load (excluded): {r.get('tokenizer_load_s', 0):.2f} s\n"
    if "profile" in r:
        out += "\n" + md(["step (py-spy, all threads)", "% samples"],
                         [(k, f"{v:.1f}") for k, v in r["profile"]["steps"]])
    st = r.get("stages", {})
    if st:
        out += "\n" + md(["stage in isolation", "µs/prompt"],
                         [(k, f"{v:.0f}") for k, v in st["stages_us"].items()])
        out += "\n" + md(["loop variant", "prompts/s"],
                         [(k, s(v, 0)) for k, v in st["variants"].items()])
    return out


def _guard(r: dict[str, Any]) -> str:
    return md(["case", "n", "p50 ms", "p99 ms", "max ms"],
              [(k, v["n"], f"{v['p50_ms']:.2f}", f"{v['p99_ms']:.2f}", f"{v['max_ms']:.2f}")
               for k, v in r["cases"].items()])


def _overshoot(r: dict[str, Any]) -> str:
    return f"budget per dataset: {r['budget']:,} tokens\n\n" + md(
        ["policy", "overshoot tokens", "% of budget", "aborted requests", "wasted tokens",
         "late requests", "target"],
        [(p, s(r[p]["overshoot"], 0), s(r[p]["overshoot_pct"], 2), s(r[p]["aborted"], 0),
          s(r[p]["wasted_tokens"], 0), s(r[p]["late_requests"], 0), r[p]["target"])
         for p in ("drain", "abort", "exact")])


def _memory(r: dict[str, Any]) -> str:
    rows = [(k, s(v["idle"]), s(v["peak"]), s(v["end"]), s(v["rate"]))
            for k, v in r.items() if k.startswith("rss_")]
    b = r["redis_bytes_per_task"]
    out = md(["worker", "idle MB", "peak MB", "after warm run MB", "completions/s"], rows) + \
        "\n" + md(["Redis, per queued task", "bytes"],
                  [("INFO used_memory delta", s(b["info_delta"], 0)),
                   ("MEMORY USAGE of all keys", s(b["memory_usage"], 0)),
                   ("one message body", s(b["message_bytes"], 0))])
    for kind, label in LONG_DBS.items():
        long = r.get(long_key(kind))
        if long:
            out += "\n" + md([f"long run, {label}: samples settled", "worker RSS MB"],
                             [(f"{p['samples']:,.0f}", f"{p['rss']:.1f}")
                              for p in long["points"]])
            out += (f"\nGrowth over the {label} long run's second half: "
                    f"{long['growth_mb_per_10k']:.2f} MB per 10,000 samples.\n")
    return out


def _scaling(r: dict[str, Any]) -> str:
    out = md(["db x workers", "completions/s", "workers CPU % of a core", "sim CPU %",
              "worker CPU ms/task"],
             [(k, s(v["rate"]), s(v["worker_cpu_pct"], 0), s(v["sim_cpu_pct"], 0),
               s(v["worker_cpu_ms_per_task"], 2))
              for k, v in r.items() if "_x" in k and not k.startswith("costs")])
    paced = [(k.removeprefix("paced_"), f"{v['rate']:.1f}", f"{v['worker_cpu_ms_per_task']:.2f}",
              s(v.get("idle_worker_core_pct"), 1))
             for k, v in r.items() if k.startswith("paced_") and "costs" not in k]
    if paced:
        out += "\none worker at a paced rate:\n\n" + md(
            ["db", "completions/s", "worker CPU ms/task", "then idle: worker CPU % of a core"],
            paced)
    for k, v in r.items():
        if k.startswith(("costs_", "paced_costs_")):
            label = (f"{k.removeprefix('paced_costs_')}, paced" if k.startswith("paced_")
                     else f"{k.removeprefix('costs_')}, full rate")
            out += f"\nper-task costs, {label}:\n\n" + md(
                ["figure", "per task"],
                [(n, f"{x:.2f}") for n, x in v.items() if isinstance(x, int | float)])
    return out


def _hotpath(r: dict[str, Any]) -> str:
    cpu = r.get("cpu_us_per_call", {})
    return md(["case", "wall µs/call", "CPU µs/call"],
              [(k, s(v, 0), s(cpu.get(k), 0)) for k, v in r["us_per_call"].items()]) + "\n" + \
        md(["Store.prompt from 64 threads", "calls/s"],
           [(k, s(v, 0)) for k, v in r["pool_calls_per_s"].items()])


SECTIONS: dict[str, Callable[[dict[str, Any]], str]] = {
    "saturation": _saturation, "overhead": _overhead, "overhead-per-core": _overhead,
    "producer": _producer, "guard": _guard, "overshoot": _overshoot, "memory": _memory,
    "scaling": _scaling, "hotpath": _hotpath,
}


def render(collected: dict[str, Any]) -> str:
    results = collected.get("results", collected)
    out = [md(["benchmark", "figure", "value", "target", "verdict"], headline(results))]
    for name, fn in SECTIONS.items():
        r = results.get(name)
        if r:
            out.append(f"### {name} ({r.get('date', '?')})\n\n{fn(r)}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m bench.markdown RESULTS.json", file=sys.stderr)
        return 2
    print(render(json.loads(Path(args[0]).read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
