"""`GET /v1/loads` (JSON or `?format=prometheus`) and `GET /metrics` (Prometheus text).

Shapes from SGLang (repo sgl-project/sglang, python/sglang/srt/): `entrypoints/v1_loads.py`
(timestamp, version, dp_rank_count, loads, aggregate; the prometheus variant's
`sglang_<key>{dp_rank="0"}` gauges) and `metrics/collector.py` (metric names, help texts,
types). Scheduler metrics carry the labels SGLang's scheduler gives them (model_name,
engine_type, tp_rank, pp_rank, moe_ep_rank), request counters the tokenizer manager's
(model_name, engine_type). Counters are exposed as `<name>_total` under `# TYPE
<name>_total counter`, as prometheus_client's text exposition does (parsers then name the family
`<name>`). Rates are per simulated second.
"""

from __future__ import annotations

from datetime import UTC, datetime

from aiohttp import web

from sim.config import SIM_VERSION
from sim.load import Load
from sim.responses import json_response
from sim.state import SIM_KEY, SimState

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def aggregate(loads: list[dict[str, object]]) -> dict[str, object]:
    """/v1/loads' `aggregate` block over the per-rank dicts (`_compute_aggregate`)."""
    n = len(loads)

    def total(key: str) -> float:
        return sum(float(str(d[key])) for d in loads)

    return {
        "total_running_reqs": int(total("num_running_reqs")),
        "total_waiting_reqs": int(total("num_waiting_reqs")),
        "total_reqs": int(total("num_running_reqs") + total("num_waiting_reqs")),
        "total_used_tokens": int(total("num_used_tokens")),
        "total_tokens": int(total("num_total_tokens")),
        "avg_token_usage": round(total("token_usage") / n, 4) if n else 0.0,
        "avg_throughput": round(total("gen_throughput") / n, 2) if n else 0.0,
        "avg_utilization": round(total("utilization") / n, 4) if n else 0.0,
    }


async def handle_loads(request: web.Request) -> web.Response:
    """GET /v1/loads[?format=prometheus][&dp_rank=0]."""
    load = request.app[SIM_KEY].engine.load()
    loads = [load.to_dict()] if request.query.get("dp_rank", "0") == "0" else []
    if request.query.get("format") == "prometheus":
        return web.Response(body=_loads_prometheus(loads).encode(), content_type="text/plain")
    body = {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": SIM_VERSION,
        "dp_rank_count": len(loads),
        "loads": loads,
        "aggregate": aggregate(loads),
    }
    return json_response(body)


def _loads_prometheus(loads: list[dict[str, object]]) -> str:
    lines = []
    for entry in loads:
        for key, value in entry.items():
            if isinstance(value, int | float) and key != "dp_rank":
                lines += [f"# TYPE sglang_{key} gauge", f'sglang_{key}{{dp_rank="0"}} {value}']
    return "\n".join(lines) + "\n"


def _labels(pairs: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in pairs.items()) + "}"


def _family(name: str, kind: str, doc: str, labels: str, value: float) -> list[str]:
    sample = f"{name}_total" if kind == "counter" else name
    return [f"# HELP {sample} {doc}", f"# TYPE {sample} {kind}", f"{sample}{labels} {float(value)}"]


def metrics_text(sim: SimState) -> str:
    """The whole /metrics body."""
    load: Load = sim.engine.load()
    model = sim.cfg.model_name
    sched = _labels(
        {
            "model_name": model,
            "engine_type": "unified",
            "tp_rank": "0",
            "pp_rank": "0",
            "moe_ep_rank": "0",
        }
    )
    tok = _labels({"model_name": model, "engine_type": "unified"})
    gauge, counter = "gauge", "counter"
    rows: list[tuple[str, str, str, str, float]] = [
        (
            "sglang:num_running_reqs",
            gauge,
            "The number of running requests.",
            sched,
            load.num_running_reqs,
        ),
        (
            "sglang:num_used_tokens",
            gauge,
            "The number of used tokens.",
            sched,
            load.num_used_tokens,
        ),
        ("sglang:token_usage", gauge, "The token usage.", sched, load.token_usage),
        (
            "sglang:gen_throughput",
            gauge,
            "The generation throughput (token/s).",
            sched,
            load.gen_throughput,
        ),
        (
            "sglang:num_queue_reqs",
            gauge,
            "The number of requests in the waiting queue.",
            sched,
            load.num_waiting_reqs,
        ),
        (
            "sglang:num_grammar_queue_reqs",
            gauge,
            "The number of requests in the grammar waiting queue.",
            sched,
            0,
        ),
        ("sglang:cache_hit_rate", gauge, "The prefix cache hit rate.", sched, load.cache_hit_rate),
        (
            "sglang:max_total_num_tokens",
            gauge,
            "Maximum total number of tokens in the KV cache pool.",
            sched,
            load.max_total_num_tokens,
        ),
        (
            "sglang:num_retracted_reqs",
            gauge,
            "The number of retracted requests.",
            sched,
            load.num_retracted_reqs,
        ),
        ("sglang:new_token_ratio", gauge, "The new token ratio.", sched, load.new_token_ratio),
        ("sglang:utilization", gauge, "The utilization.", sched, load.utilization),
        (
            "sglang:num_retracted_requests",
            counter,
            "Total number of retracted requests.",
            sched,
            load.retracted_reqs_total,
        ),
        (
            "sglang:num_retracted_input_tokens",
            counter,
            "Total number of retracted input tokens.",
            sched,
            load.retracted_input_tokens_total,
        ),
        (
            "sglang:num_retracted_output_tokens",
            counter,
            "Total number of retracted output tokens.",
            sched,
            load.retracted_output_tokens_total,
        ),
        (
            "sglang:prompt_tokens",
            counter,
            "Number of prefill tokens processed.",
            tok,
            sim.prompt_tokens,
        ),
        (
            "sglang:generation_tokens",
            counter,
            "Number of generation tokens processed.",
            tok,
            sim.output_tokens,
        ),
        ("sglang:num_requests", counter, "The number of requests.", tok, sim.arrived),
        (
            "sglang:num_aborted_requests",
            counter,
            "Number of requests aborted.",
            tok,
            sim.finish_counts["abort"],
        ),
        ("sglang:context_len", gauge, "The context length.", tok, sim.cfg.context_length),
    ]
    lines = [line for row in rows for line in _family(*row)]
    return "\n".join(lines) + "\n"


async def handle_metrics(request: web.Request) -> web.Response:
    """GET /metrics: SGLang's scheduler gauges and request counters, Prometheus text."""
    text = metrics_text(request.app[SIM_KEY])
    return web.Response(body=text.encode(), headers={"Content-Type": PROMETHEUS_TEXT})
