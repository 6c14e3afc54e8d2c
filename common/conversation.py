"""A conversation regenerated turn by turn (``--turns all``): its turns and their prompts.

A conversation as read (the reader drops its trailing answer) has k assistant turns to
generate: one at each run of assistant messages after a user message, and one at its
end. Turn i is a prompt of its own, ``<conversation>#turn<i>``: the messages up to user
turn i with the model's *own* answers to turns 1..i-1 in place of the line's. Turn 1's
prompt is built by the producer; turn i+1's by the worker that stores turn i, from turn
i's prompt messages, its own answer and the line's messages between the two turns.

An own answer enters the history as the chat template renders history: its reasoning
split off at the template's closing marker and passed as ``reasoning_content``, so a
template that drops earlier reasoning drops it, as at serving time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Message = dict[str, Any]
TURN_MODES = ("last", "all")
DEFAULT_TURNS = "all"  # a new dataset's mode when none is asked for
# How the error of a turn not started begins when the model's tool calls before it were
# not the line's: the conversation ended there (workers/tool_turns.py); status counts them.
TOOLS_DIFFER = "tool calls differ"
_TURN_MARK = "#turn"


def turn_id(conversation: str, turn: int) -> str:
    """The sample id of a conversation's turn (from 1)."""
    return f"{conversation}{_TURN_MARK}{turn}"


def is_turn_id(sample_id: str) -> bool:
    """Whether the id has a turn's form (``turn_id``'s). A conversation's turns all do; a
    line of a single turn keeps its own id, which has it only if the line's id does."""
    return conversation_of(sample_id) != sample_id


def conversation_of(sample_id: str) -> str:
    """The conversation a turn's sample id names (``turn_id``'s inverse); any other id
    as it is."""
    base, mark, turn = sample_id.rpartition(_TURN_MARK)
    return base if mark and turn.isdigit() else sample_id


def max_conversation_id(max_id_chars: int, turns: int) -> int:
    """The longest conversation id whose turns' ids fit in ``max_id_chars``."""
    return max_id_chars - len(turn_id("", turns))


def turn_starts(messages: Sequence[Message]) -> list[int]:
    """Where each turn's prompt ends: the index of each run of assistant messages that
    follows a user message, and the conversation's end. Assistant messages before the
    first user message are part of every prompt, as written."""
    starts, seen_user = [], False
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "user":
            seen_user = True
        elif role == "assistant" and seen_user and messages[i - 1].get("role") != "assistant":
            starts.append(i)
    return [*starts, len(messages)]


def calls_tools(messages: Sequence[Message]) -> bool:
    """A conversation with tool calls (or tool replies): regenerated turn by turn, its
    turns after a call need the model's own calls parsed."""
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def original_calls(original: Sequence[Message], turn: int) -> list[dict[str, Any]]:
    """The tool calls of the line's own answer to turn ``turn`` (one assistant message
    or several in a row), in order."""
    end = turn_starts(original)[turn - 1]
    calls: list[dict[str, Any]] = []
    while end < len(original) and original[end].get("role") == "assistant":
        calls.extend(original[end].get("tool_calls") or ())
        end += 1
    return calls


def first_turn(messages: Sequence[Message]) -> list[Message]:
    """Turn 1's prompt messages: everything before the first answer."""
    return list(messages[: turn_starts(messages)[0]])


def own_answer(text: str, split: Callable[[str], tuple[str, str]],
               reasoning: bool) -> Message:
    """The model's answer as an assistant message of the history. ``split`` is the
    template's (``ChatTemplater.split_reasoning``); ``reasoning``: the template opens a
    reasoning block, so the answer carries ``reasoning_content`` (empty if none)."""
    if not reasoning:
        return {"role": "assistant", "content": text}
    thought, content = split(text)
    return {"role": "assistant", "content": content, "reasoning_content": thought}


def next_turn(original: Sequence[Message], prompt: Sequence[Message], turn: int,
              answer: Message) -> list[Message]:
    """Turn ``turn + 1``'s prompt messages: turn ``turn``'s prompt, its own ``answer``,
    then the line's messages after its answer to that turn, up to the next answer (the
    line's own answers are skipped, never copied)."""
    starts = turn_starts(original)
    end = starts[turn - 1]
    while end < len(original) and original[end].get("role") == "assistant":
        end += 1  # the line's answer to this turn, one message or several
    return [*prompt, answer, *original[end: starts[turn]]]


def turn_count(messages: Sequence[Message]) -> int:
    return len(turn_starts(messages))
