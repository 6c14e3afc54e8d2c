"""A tool-calling turn's own answer: the model's calls, parsed by the server's own parser.

When the line's answer to a turn called tools, the model's output for that turn is sent
to SGLang's ``POST /parse_function_call`` on the server that generated it, with the
dataset's parser name (``--tool-call-parser``, SGLang's names as they are), so every
model SGLang parses works without a parser of datagen's. The text sent is the output ids
decoded with their special tokens (tool-call markers are special tokens in many
tokenizers, and ``/generate``'s text drops them), without the stop token that ended it.

The parser is the same on every server of a fleet (one model, one ``--tool-call-parser``),
so a parse that fails on the generating server for a passing reason (unreachable, 5xx,
timeout) is asked of the others, and of all again after a short pause, before the
conversation ends on it: a server's restart must not end conversations.

If the model called the same functions as the line, in the same order and number, its
answer enters the history with its own calls and the line's tool results follow it; tools
are never run. Its calls take the ids of the line's calls, position by position: SGLang's
parser returns no ids, and the line's tool messages name the calls they answer by those
ids, so the history stays one a template can check. Otherwise the conversation ends at
that turn: ``ToolsDiffer`` carries the reason, stored with the next turn's prompt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from common.conversation import TOOLS_DIFFER, Message, own_answer
from common.errors import TransientError

log = logging.getLogger(__name__)

# (text, tools) -> (normal_text, calls), as /parse_function_call answers.
Parse = Callable[[str, list[dict[str, Any]]], tuple[str, list[dict[str, Any]]]]


# Pauses before asking the fleet again: short, as the turn's store (and the others of its
# group commit) waits for the answer.
PARSE_PAUSES_S = (0.5, 2.0)
# No attempt starts later than this after the first: a server that hangs until its read
# timeout must not hold the group for one timeout per attempt.
PARSE_DEADLINE_S = 30.0


def parse_on_fleet(parse_at: Callable[[str, str, list[dict[str, Any]]],
                                      tuple[str, list[dict[str, Any]]]],
                   first: str, servers: Sequence[str],
                   pauses_s: Sequence[float] = PARSE_PAUSES_S,
                   deadline_s: float = PARSE_DEADLINE_S) -> Parse:
    """A Parse that asks ``first``, then the other servers, then all again after each of
    ``pauses_s``, for as long as each fails for a passing reason and ``deadline_s`` has
    not passed since the first attempt; the last such error when none answered.
    ``parse_at(server, text, tools)`` is one server's parse."""
    order = [first, *(s for s in servers if s != first)]

    def parse(text: str, tools: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
        last: TransientError | None = None
        deadline = time.monotonic() + deadline_s
        for pause in (0.0, *pauses_s):
            time.sleep(pause)
            for server in order:
                if last is not None and time.monotonic() > deadline:
                    raise last
                try:
                    return parse_at(server, text, tools)
                except TransientError as exc:
                    log.warning("tool-call parse failed on %s (%s); asking another", server,
                                exc)
                    last = exc
        assert last is not None  # the first attempt always runs
        raise last
    return parse


class ToolsDiffer(Exception):
    """The model's calls are not the line's: the conversation ends; the message says how."""


def parse_text(decode_all: Callable[[list[int]], str], output_ids: Sequence[int],
               finish_detail: dict[str, Any] | None) -> str:
    """The output as the parser must see it: special tokens kept, the stop token off."""
    ids = list(output_ids)
    matched = (finish_detail or {}).get("matched")
    if (finish_detail or {}).get("type") == "stop" and isinstance(matched, int) \
            and ids and ids[-1] == matched:
        ids.pop()
    return decode_all(ids)


def tool_answer(parse: Parse, text: str, tools: list[dict[str, Any]] | None,
                originals: list[dict[str, Any]], split: Callable[[str], tuple[str, str]],
                reasoning: bool) -> Message:
    """The model's answer with its tool calls, or ToolsDiffer."""
    normal, calls = parse(text, list(tools or []))
    made = [str(call.get("name")) for call in calls]
    wanted = [str(call["function"]["name"]) for call in originals]
    if made != wanted:
        raise ToolsDiffer(f"{TOOLS_DIFFER}: the model called {_names(made)}, the line "
                          f"called {_names(wanted)}")
    answer = own_answer(normal, split, reasoning)
    answer["tool_calls"] = [_call(call, original)
                            for call, original in zip(calls, originals, strict=True)]
    return answer


def _call(call: dict[str, Any], original: dict[str, Any]) -> dict[str, Any]:
    made: dict[str, Any] = {"type": "function", "function": {
        "name": call["name"], "arguments": call.get("parameters", "{}")}}
    if "id" in original:
        made = {"id": original["id"], **made}
    return made


def _names(names: list[str]) -> str:
    return "[" + ", ".join(names) + "]" if names else "no tool"
