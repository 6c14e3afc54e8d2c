"""The simulator's tool calls and reasoning, in the remote-code test tokenizer's format.

That tokenizer's template (ops/build_remote_tokenizer.py) renders an assistant turn as
``<think>REASONING</think>CONTENT<|calls|><|call|>ID:NAME<|args|>JSON<|/call|>...<|/calls|>``
and opens ``<think>`` in its generation prompt, so a model's output reads
``REASONING</think>CONTENT<|calls|>...<|/calls|>`` then EOS. This module writes such calls
into the simulator's outputs and parses them back, as SGLang's own detectors parse theirs
for ``/parse_function_call`` and ``/separate_reasoning``; the parser name of this format is
``datagen`` for both.

When the model calls tools, deterministically from the prompt: a prompt that offers tools
(``<|tools|>`` in its ids) whose last user message holds directives ``<<call A,B>>`` calls
A and B in the first round after that message, the names of the second directive in the
second round (after the first calls' tool replies), and so on; a round past the last
directive answers without calls. A directive naming a tool the prompt does not offer is
still obeyed: the parser then drops that call, as SGLang's drops a call to an undefined
function.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

PARSER_NAME = "datagen"
TOOLS_OPEN = "<|tools|>"
CALLS_OPEN, CALLS_CLOSE = "<|calls|>", "<|/calls|>"
CALL_OPEN, ARGS, CALL_CLOSE = "<|call|>", "<|args|>", "<|/call|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_USER_OPEN, _END = "<|begin|>user<|sep|>", "<|end|>"
_DIRECTIVE = re.compile(r"<<call ([^<>]*)>>")
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(ARGS) + r"(.*?)"
                   + re.escape(CALL_CLOSE), re.DOTALL)


def call_block(names: list[str], seed: bytes) -> str:
    """The calls section for ``names``: ids ``sim<k>``, arguments derived from seed."""
    calls = "".join(
        f"{CALL_OPEN}sim{k}:{name}{ARGS}"
        f"{json.dumps({'query': seed[k % len(seed):][:4].hex()})}{CALL_CLOSE}"
        for k, name in enumerate(names))
    return f"{CALLS_OPEN}{calls}{CALLS_CLOSE}"


def planned_calls(prompt_text: str) -> list[str]:
    """The names the model calls for a prompt (decoded with its special tokens)."""
    start = prompt_text.rfind(_USER_OPEN)
    if start < 0:
        return []
    end = prompt_text.find(_END, start)
    user = prompt_text[start + len(_USER_OPEN): end if end >= 0 else None]
    rounds = [[n.strip() for n in d.split(",") if n.strip()]
              for d in _DIRECTIVE.findall(user)]
    done = prompt_text.count(CALLS_CLOSE, start)  # rounds already made after that message
    return rounds[done] if done < len(rounds) else []


@dataclass(frozen=True)
class ParsedCall:
    """One call as SGLang's ``ToolCallItem`` dumps it (``parameters``: a JSON string)."""

    tool_index: int
    name: str
    parameters: str

    def as_json(self) -> dict[str, Any]:
        return {"tool_index": self.tool_index, "name": self.name,
                "parameters": self.parameters}


def tool_names(tools: list[Any]) -> set[str]:
    """Function names of OpenAI tool schemas (``{"type", "function"}`` or bare)."""
    names = set()
    for tool in tools:
        schema = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(schema, dict) and isinstance(schema.get("name"), str):
            names.add(schema["name"])
    return names


def parse_calls(text: str, tools: list[Any]) -> tuple[str, list[ParsedCall]]:
    """(normal_text, calls): the text before the calls section and its complete calls to
    offered functions. Like SGLang's ``parse_non_stream``, a text without a call comes back
    whole with no calls."""
    start = text.find(CALLS_OPEN)
    if start < 0:
        return text, []
    offered, calls = tool_names(tools), []
    for index, match in enumerate(_CALL.finditer(text, start)):
        name = match.group(1).rpartition(":")[2]
        if name in offered:
            calls.append(ParsedCall(index, name, match.group(2)))
    if not calls:
        return text, []
    return text[:start], calls


def separate_reasoning(text: str) -> tuple[str, str]:
    """(reasoning_text, text), as SGLang's detectors for a model whose prompt opens the
    reasoning: everything up to ``</think>`` is reasoning (all of it if none closes it)."""
    body = text.replace(THINK_OPEN, "").strip()
    if THINK_CLOSE not in body:
        return body, ""
    reasoning, _, normal = body.partition(THINK_CLOSE)
    return reasoning, normal.strip()
