"""SpecForge's own checker of regenerated conversation data, reimplemented.

SpecForge (sgl-project/SpecForge) checks regenerated JSONL with
``scripts/validate_regenerated_data.py``, whose conversation rules live in
``scripts/conversation_validation.py``; its Qwen regeneration recipe
(``examples/data_regeneration/run_qwen_sharegpt_regeneration.sh``, see
``docs/basic_usage/data_preparation.md``) runs it with ``--strict-think-markers``. The
sgl-project copy of those two scripts was not readable from here; the rules below mirror
the copies in the fork yudigege86/SpecForge at commit
eb6561e01723cbf7737b04d7b131865b179738f8 (``validate_row`` and
``validate_conversation``), taking each rule in its strictest form among the published
variants, so that a row passing here passes every one of them:

* ``id`` is a string with non-whitespace characters; ``status`` is ``"success"``;
* ``conversations`` is a non-empty list of objects;
* every message's ``content`` is a non-empty (after strip) string, assistant turns
  included (fscdc/SpecForge@5ca8fa8f7f7e114e769334de8f47e6125203cece; the eb6561e0
  variant lets an assistant content be empty);
* ``system`` messages are allowed only before the first ``user`` message; every other
  role is ``user`` or ``assistant``, alternating and starting with ``user``;
* there is a user message and an assistant message, and the last message is ``assistant``;
* an assistant's ``reasoning_content`` is a string or null; with ``expect_reasoning`` it
  must be a string, with ``expect_non_reasoning`` it must be empty;
* strict think markers: no ``<think>``, ``</think>`` (nor Gemma's ``<|channel>``,
  ``<channel|>``, ``<|think|>``, from fscdc@5ca8fa8f) in assistant content or reasoning,
  case-insensitively.

Tool conversations go further than that checker. It takes no ``tool`` message at all
(sgl-project/SpecForge at a6b6b023 too), while SpecForge's trainer reads them
(``specforge/data/parse.py``: ``tool_calls`` and ``tools`` kept, a ``tool`` message after
an assistant or another tool message, an assistant after a user or tool message). A row
holding tool calls is checked here by those rules: a ``tool`` message follows an
assistant message that called tools (``tool_calls``) or another ``tool`` message, the
assistant answers after it, and an assistant message that called tools may have empty
``content``; every other rule is the checker's. A row without tool calls or tool
messages is checked exactly as upstream checks it; upstream's own script still rejects
a row with a ``tool`` message.

The upstream file-level rules differ from datagen's on purpose: upstream rejects a file
with no rows and allows duplicate ids; ``datagen validate`` reports the first as a note
and the second as a mismatch.
"""

from __future__ import annotations

from typing import Any

THINK_MARKERS = ("<think>", "</think>", "<|channel>", "<channel|>", "<|think|>")


def has_think_marker(text: str) -> bool:
    lowered = text.lower()
    return any(marker in lowered for marker in THINK_MARKERS)


def _calls(message: dict[str, Any]) -> bool:
    return message.get("role") == "assistant" and bool(message.get("tool_calls"))


def _message_error(index: int, message: Any) -> str | None:
    if not isinstance(message, dict):
        return f"message {index} must be an object"
    content = message.get("content")
    if not isinstance(content, str) or not (content.strip() or _calls(message)):
        return f"message {index} content must be a non-empty string"
    return None


def _next_roles(message: dict[str, Any]) -> set[str]:
    """The roles that may follow ``message`` (upstream: user and assistant alternate)."""
    role = message.get("role")
    if role == "user":
        return {"assistant"}
    if role == "tool":
        return {"tool", "assistant"}
    return {"user", "tool"} if _calls(message) else {"user"}


def conversation_error(messages: Any) -> str | None:
    """The first rule ``messages`` breaks, in upstream's words, or None."""
    if not isinstance(messages, list) or not messages:
        return "conversations must be a non-empty list"
    expected, saw_user = {"user"}, False
    for index, message in enumerate(messages):
        error = _message_error(index, message)
        if error is not None:
            return error
        role = message.get("role")
        if role == "system" and not saw_user:
            continue
        if role not in {"user", "assistant", "tool"} or (role == "tool" and not saw_user):
            return f"message {index} has unsupported role {role!r}"
        if role not in expected:
            want = " or ".join(repr(r) for r in sorted(expected))
            return f"message {index} expected role {want}, got {role!r}"
        saw_user = True
        expected = _next_roles(message)
    return None if saw_user else "conversation has no user message"


def _assistant_error(
    index: int, message: dict[str, Any], expect_reasoning: bool, expect_non_reasoning: bool
) -> str | None:
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        return f"assistant message {index} reasoning_content must be a string or null"
    if expect_non_reasoning and reasoning and reasoning.strip():
        return f"assistant message {index} has non-empty reasoning_content"
    if expect_reasoning and not isinstance(reasoning, str):
        return f"assistant message {index} is missing reasoning_content"
    if has_think_marker(message["content"]):
        return f"assistant message {index} contains a thinking marker"
    if isinstance(reasoning, str) and has_think_marker(reasoning):
        return f"assistant message {index} reasoning_content contains a thinking marker"
    return None


def row_error(
    row: Any, *, expect_reasoning: bool = False, expect_non_reasoning: bool = False
) -> str | None:
    """The first upstream rule one JSONL row breaks (strict think markers on), or None."""
    if not isinstance(row, dict):
        return "expected a JSON object"
    row_id = row.get("id")
    if not isinstance(row_id, str) or not row_id.strip():
        return "id must be a non-empty string"
    if row.get("status") != "success":
        return "status must be 'success'"
    messages = row.get("conversations")
    error = conversation_error(messages)
    if error is not None or not isinstance(messages, list):
        return error
    assistants = 0
    for index, message in enumerate(messages):
        if message.get("role") == "assistant":
            assistants += 1
            error = _assistant_error(index, message, expect_reasoning, expect_non_reasoning)
            if error is not None:
                return error
    if assistants == 0:
        return "conversation has no assistant message"
    if messages[-1].get("role") != "assistant":
        return "conversation must end with an assistant message"
    return None
