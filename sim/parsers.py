"""SGLang's native parsing endpoints, for the simulator's own output format.

``POST /parse_function_call`` ``{"text", "tools", "tool_call_parser"}`` →
``{"normal_text", "calls": [{"tool_index", "name", "parameters"}]}`` and
``POST /separate_reasoning`` ``{"text", "reasoning_parser"}`` → ``{"text",
"reasoning_text"}``, as sgl-project/sglang's ``entrypoints/http_server.py`` answers them.
The only parser name known is ``datagen`` (sim/toolcalls.py). SGLang builds its parser
from the name inside the handler and lets the ``ValueError`` of an unknown name escape, so
FastAPI answers a plain-text 500 ``Internal Server Error``; a body that does not fit the
request model is FastAPI's validation error, a 400 here as in SGLang.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from sim.errors import openai_error_body
from sim.responses import json_response
from sim.toolcalls import PARSER_NAME, parse_calls, separate_reasoning


class _BadBody(Exception):
    pass


async def _body(request: web.Request, fields: dict[str, type]) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise _BadBody(f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise _BadBody("the body is not a JSON object")
    for name, kind in fields.items():
        if not isinstance(body.get(name), kind):
            raise _BadBody(f"field '{name}': a {kind.__name__} is required")
    return body


def _bad(message: str) -> web.Response:
    return json_response(openai_error_body(message, "BadRequestError", 400), 400)


def _unknown_parser() -> web.Response:
    return web.Response(status=500, text="Internal Server Error", content_type="text/plain")


async def handle_parse_function_call(request: web.Request) -> web.Response:
    """POST /parse_function_call."""
    try:
        body = await _body(request, {"text": str, "tools": list, "tool_call_parser": str})
    except _BadBody as exc:
        return _bad(str(exc))
    if body["tool_call_parser"] != PARSER_NAME:
        return _unknown_parser()
    normal_text, calls = parse_calls(body["text"], body["tools"])
    return json_response({"normal_text": normal_text,
                          "calls": [call.as_json() for call in calls]})


async def handle_separate_reasoning(request: web.Request) -> web.Response:
    """POST /separate_reasoning."""
    try:
        body = await _body(request, {"text": str, "reasoning_parser": str})
    except _BadBody as exc:
        return _bad(str(exc))
    if body["reasoning_parser"] != PARSER_NAME:
        return _unknown_parser()
    reasoning, text = separate_reasoning(body["text"])
    return json_response({"text": text, "reasoning_text": reasoning})
