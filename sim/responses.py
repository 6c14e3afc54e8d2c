"""Building /generate answers: output dicts, JSON responses, SSE events, dropped links."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

from sim.engine import Sequence
from sim.outputs import OutputModel

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
SSE_DONE = b"data: [DONE]\n\n"
#: How long a handler whose connection we closed waits for aiohttp to cancel it.
_DROP_GRACE_S = 5.0


def dumps(obj: Any) -> bytes:
    """Compact JSON bytes (what goes on the wire)."""
    return json.dumps(obj, separators=(",", ":")).encode()


def json_response(obj: Any, status: int = 200) -> web.Response:
    """A JSON answer without aiohttp's slower json_response helpers."""
    return web.Response(body=dumps(obj), status=status, content_type="application/json")


def sse_event(obj: Any) -> bytes:
    """One server-sent event: `data: {json}\\n\\n`."""
    return b"data: " + dumps(obj) + b"\n\n"


def build_output(
    outputs: OutputModel,
    seq: Sequence,
    span: tuple[int, int],
    finish_reason: dict[str, Any] | None,
    arrived_ts: float,
) -> dict[str, Any]:
    """SGLang's `{text, output_ids, meta_info}` for output ids[start:end].

    start > 0 only for incremental streaming; meta_info counts are cumulative either way.
    e2e_latency and response_sent_to_client_ts appear on the final output only.
    """
    start, end = span
    comp = seq.completion
    text = outputs.text(comp, end)
    if start > 0:
        text = text[len(outputs.text(comp, start)) :]
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": finish_reason,
        "prompt_tokens": seq.prompt_tokens,
        "weight_version": "default",
        "num_retractions": seq.num_retractions,
        "reasoning_tokens": comp.reasoning_tokens(end),
        "completion_tokens": end,
        "cached_tokens": seq.cached_tokens,
    }
    if finish_reason is not None:
        now = time.time()
        meta["e2e_latency"] = round(now - arrived_ts, 6)
        meta["response_sent_to_client_ts"] = now
    return {"text": text, "output_ids": comp.ids[start:end], "meta_info": meta}


def rejection_output(rid: str, prompt_tokens: int, finish_reason: dict[str, Any]) -> dict[str, Any]:
    """Final stream chunk of a request the scheduler refused (queue full, too long)."""
    now = time.time()
    meta = {
        "id": rid,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": 0,
        "cached_tokens": 0,
        "e2e_latency": 0.0,
        "response_sent_to_client_ts": now,
    }
    return {"text": "", "output_ids": [], "meta_info": meta}


async def start_sse(request: web.Request) -> web.StreamResponse:
    """Send the 200 + event-stream headers."""
    resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await resp.prepare(request)
    return resp


async def sse_single(request: web.Request, payload: dict[str, Any]) -> web.StreamResponse:
    """A whole stream made of one event and `[DONE]` (errors and refusals)."""
    resp = await start_sse(request)
    await resp.write(sse_event(payload))
    await resp.write(SSE_DONE)
    await resp.write_eof()
    return resp


async def drop_connection(request: web.Request) -> web.Response:
    """Close the connection without answering, as a crashed server would.

    aiohttp then cancels this handler (handler_cancellation=True); the sleep only bounds
    the wait should that not happen.
    """
    transport = request.transport
    if transport is not None:
        transport.close()
    await asyncio.sleep(_DROP_GRACE_S)
    return web.Response(status=500)
