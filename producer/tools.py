"""The shapes of tool use in a prompt line, checked as the reader reads them.

A line may carry OpenAI function schemas in ``tools``, assistant turns calling them in
``tool_calls``, and ``tool`` turns answering the calls. They are kept exactly as read (chat
templates differ in what they take, e.g. arguments as a JSON string or as an object): this
only refuses what no template can render faithfully, each with the reason shown after
``file:line:``.
"""

from __future__ import annotations

import json
from typing import Any

Message = dict[str, Any]


class BadShape(Exception):
    """One line cannot be used; the message is the reason shown after ``file:line:``."""


def tools_list(raw: Any) -> list[dict[str, Any]] | None:
    """A line's ``tools``: a list of function schemas, or None when it has none."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise BadShape(f"'tools' is not a list of function schemas (got {type(raw).__name__})")
    for k, tool in enumerate(raw, start=1):
        if not isinstance(tool, dict):
            raise BadShape(f"tool {k} in 'tools' is not an object")
        schema = tool.get("function", tool)  # OpenAI's {"type", "function"} or a bare schema
        if not isinstance(schema, dict) or not _is_name(schema.get("name")):
            raise BadShape(f"tool {k} in 'tools' has no function name")
    return raw


def tool_calls(raw: Any, n: int) -> list[dict[str, Any]]:
    """An assistant turn's ``tool_calls``, checked call by call and kept as read."""
    if not isinstance(raw, list):
        raise BadShape(f"tool_calls of turn {n} is not a list (got {type(raw).__name__})")
    for k, call in enumerate(raw, start=1):
        _check_call(call, k, n)
    return raw


def _check_call(call: Any, k: int, n: int) -> None:
    where = f"tool call {k} of turn {n}"
    if not isinstance(call, dict):
        raise BadShape(f"{where} is not an object")
    if call.get("type", "function") != "function":
        raise BadShape(f"{where} has type {call.get('type')!r} (only 'function' is known)")
    if "id" in call and not isinstance(call["id"], str):
        raise BadShape(f"{where} has an id that is not a string")
    function = call.get("function")
    if not isinstance(function, dict) or not _is_name(function.get("name")):
        raise BadShape(f"{where} has no function name")
    if "arguments" not in function:
        raise BadShape(f"{where} has no arguments")
    arguments = function["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError) as exc:
            raise BadShape(f"arguments of {where} are not JSON: {exc}") from None
    if not isinstance(arguments, dict):
        raise BadShape(f"arguments of {where} are not a JSON object "
                       f"(got {type(arguments).__name__})")


def check_tool_replies(messages: list[Message]) -> None:
    """Every tool turn naming a call (by ``tool_call_id``, or by ``name`` alone) answers
    one an earlier assistant turn made. A tool turn naming none (ShareGPT's plain tool
    turns) is accepted as it always was."""
    calls: dict[str, str] = {}  # call id -> function name
    called: set[str] = set()
    for n, message in enumerate(messages, start=1):
        for call in message.get("tool_calls") or ():
            name = call["function"]["name"]
            called.add(name)
            if isinstance(call.get("id"), str):
                calls[call["id"]] = name
        if message["role"] == "tool":
            _check_reply(message, n, calls, called)


def _check_reply(message: Message, n: int, calls: dict[str, str], called: set[str]) -> None:
    call_id, name = message.get("tool_call_id"), message.get("name")
    if call_id is not None:
        if call_id not in calls:
            raise BadShape(f"turn {n} answers tool call {call_id!r}, which no earlier "
                           "assistant turn made")
        if name is not None and name != calls[call_id]:
            raise BadShape(f"turn {n} answers tool call {call_id!r} as {name!r}, but that "
                           f"call was to {calls[call_id]!r}")
    elif name is not None and name not in called:
        raise BadShape(f"turn {n} answers function {name!r}, which no earlier assistant "
                       "turn called")


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())
