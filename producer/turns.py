"""``--turns all`` at the producer: each conversation read becomes its first turn.

The conversation is stored once (``conversations``) and its first turn as a prompt,
``<id>#turn1``, whose messages stop before the line's first answer; workers add each
later turn as the one before it is stored (workers/turns.py). A conversation that offers
or calls tools is regenerated at its last turn only, as with ``--turns last``, until
tool calls are parsed from the model's own output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

from common.conversation import (
    first_turn,
    has_tool_turns,
    max_conversation_id,
    turn_count,
    turn_id,
)
from common.rows import NewConversation
from producer.reader import MAX_ID_CHARS, PromptRecord, ReadReport

TOOLS_NOTE = ("{n} conversation(s) with tools regenerated at their last turn only: "
              "tool-calling turns are not yet regenerated turn by turn")


def first_turns(records: Iterable[PromptRecord], report: ReadReport,
                tool_lines: list[int]) -> Iterator[PromptRecord]:
    """Each record as its conversation's first turn; a tool conversation as it is (its
    count added to ``tool_lines[0]``); one whose turn ids would be too long is a bad
    line."""
    for record in records:
        if has_tool_turns(record.messages, record.tools):
            tool_lines[0] += 1
            yield record
            continue
        turns = turn_count(record.messages)
        longest = max_conversation_id(MAX_ID_CHARS, turns)
        if len(record.sample_id) > longest:
            report.bad += 1
            report.problem(f"{record.source}: id is {len(record.sample_id)} characters; with "
                           f"{turns} turns (ids '<id>#turnN') it may have {longest} at most")
            continue
        yield dataclasses.replace(record, sample_id=turn_id(record.sample_id, 1),
                                  messages=tuple(first_turn(record.messages)),
                                  conversation=record.sample_id, original=record.messages)


def turn_of(record: PromptRecord) -> dict[str, Any]:
    """The prompt row's conversation and turn fields for a record."""
    if record.conversation is None:
        return {}
    return {"conversation": record.conversation, "turn": 1}


def conversation_row(dataset: str, record: PromptRecord) -> NewConversation | None:
    if record.conversation is None or record.original is None:
        return None
    return NewConversation(dataset=dataset, conversation=record.conversation,
                           messages=list(record.original), tools=record.tools,
                           turns=turn_count(record.original), source=record.source)
