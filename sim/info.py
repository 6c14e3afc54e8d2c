"""SGLang's non-generation endpoints (spec §4 and §6): health, info, abort, flush_cache.

Clients read /server_info to learn how streaming behaves and how big prompts may be, so
the keys they need carry the simulator's real settings; the rest mirrors 0.5.23's names.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from sim.config import SIM_VERSION
from sim.responses import json_response
from sim.state import SIM_KEY, SimState
from sim.toolcalls import PARSER_NAME


async def handle_ok(request: web.Request) -> web.Response:
    """/health, /health_generate, /ready: 200 with an empty body, as in SGLang."""
    del request
    return web.Response(status=200)


def model_info(sim: SimState) -> dict[str, Any]:
    """0.5.23's /model_info keys."""
    cfg = sim.cfg
    return {
        "model_path": cfg.model_name,
        "served_model_name": cfg.model_name,
        "tokenizer_path": cfg.tokenizer or cfg.model_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "load_format": "dummy",
        # The parsers /separate_reasoning and /parse_function_call accept (sim/parsers.py),
        # as SGLang reports its --reasoning-parser and --tool-call-parser.
        "reasoning_parser": PARSER_NAME if cfg.tokenizer else None,
        "tool_call_parser": PARSER_NAME if cfg.tokenizer else None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
    }


async def handle_model_info(request: web.Request) -> web.Response:
    """GET /model_info and its deprecated alias /get_model_info."""
    return json_response(model_info(request.app[SIM_KEY]))


def server_info(sim: SimState) -> dict[str, Any]:
    """Resolved server args + scheduler info + internal_states, as /server_info has them."""
    cfg = sim.cfg
    max_total = cfg.max_total_num_tokens
    return {
        "model_path": cfg.model_name,
        "tokenizer_path": cfg.tokenizer or cfg.model_name,
        "served_model_name": cfg.model_name,
        "host": cfg.host,
        "port": cfg.port,
        "context_length": cfg.context_length,
        "max_running_requests": cfg.max_running_requests,
        "max_queued_requests": cfg.max_queued_requests,
        "max_total_tokens": max_total,
        "chunked_prefill_size": 8192,
        "stream_interval": 1,
        "incremental_streaming_output": cfg.incremental_streaming_output,
        "skip_tokenizer_init": False,
        "enable_metrics": True,
        "launch_command": "datagen sim",
        "max_total_num_tokens": max_total,
        "max_req_input_len": cfg.max_req_input_len,
        "status": "ready",
        "startup_time": sim.started_ts,
        "internal_states": [_internal_state(sim)],
        "version": SIM_VERSION,
        "frontend": "python",
    }


def _internal_state(sim: SimState) -> dict[str, Any]:
    engine = sim.engine
    return {
        "effective_max_running_requests_per_dp": sim.cfg.max_running_requests,
        "last_gen_throughput": engine.gen_throughput(),
        "num_running_reqs": len(engine.running),
        "num_queue_reqs": len(engine.waiting),
        "memory_usage": {
            "weight": 0.0,
            "kvcache": 0.0,
            "token_capacity": sim.cfg.max_total_num_tokens,
        },
    }


async def handle_server_info(request: web.Request) -> web.Response:
    """GET /server_info and its deprecated alias /get_server_info."""
    return json_response(server_info(request.app[SIM_KEY]))


async def handle_models(request: web.Request) -> web.Response:
    """GET /v1/models: OpenAI list with SGLang's max_model_len."""
    sim = request.app[SIM_KEY]
    card = {
        "id": sim.cfg.model_name,
        "object": "model",
        "created": int(sim.started_ts),
        "owned_by": "sglang",
        "root": sim.cfg.model_name,
        "max_model_len": sim.cfg.context_length,
    }
    return json_response({"object": "list", "data": [card]})


async def handle_abort(request: web.Request) -> web.Response:
    """POST /abort_request: prefix match or abort_all; 200 with an empty body always."""
    try:
        body = json.loads(await request.read() or b"{}")
    except ValueError:
        body = {}
    sim = request.app[SIM_KEY]
    sim.abort_calls += 1
    if isinstance(body, dict):
        rid = body.get("rid")
        sim.engine.abort(rid if isinstance(rid, str) else None, body.get("abort_all") is True)
    return web.Response(status=200)


async def handle_flush_cache(request: web.Request) -> web.Response:
    """/flush_cache: empties the prefix cache (GPU mode) unless requests are in flight."""
    request.app[SIM_KEY].engine.flush_cache()
    return web.Response(
        text="Cache flushed.\nPlease check backend logs for more details. "
        "(When there are running or waiting requests, the operation will not "
        "be performed.)\n"
    )
