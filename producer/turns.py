"""``--turns all`` at the producer: each conversation read becomes its first turn.

The conversation is stored once (``conversations``) and its first turn as a prompt,
``<id>#turn1``, whose messages stop before the line's first answer; workers add each
later turn as the one before it is stored (workers/turns.py). A line with one turn (a
prompt, not a dialogue) is stored as with ``--turns last``, under its own id: that is
what lets ``all`` be the default without renaming every single-turn dataset's samples.
A conversation whose turns call tools needs SGLang's parser name (``--tool-call-parser``):
the workers parse the model's own calls with it (workers/tool_turns.py); without one it
is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

from common.conversation import (
    calls_tools,
    first_turn,
    max_conversation_id,
    turn_count,
    turn_id,
)
from common.errors import ConfigError
from common.rows import NewConversation
from producer.reader import MAX_ID_CHARS, PromptRecord, ReadReport


def first_turns(records: Iterable[PromptRecord], report: ReadReport,
                tool_call_parser: str | None) -> Iterator[PromptRecord]:
    """Each record as its conversation's first turn; one whose turn ids would be too
    long is a bad line. A record with a single turn stays a prompt of its own, its id
    unchanged: regenerating its every turn is regenerating its last one. A conversation
    calling tools without a parser name stops the enqueue: its turns after a call could
    not go on."""
    for record in records:
        if tool_call_parser is None and calls_tools(record.messages):
            raise ConfigError(
                f"{record.source}: this conversation calls tools; to regenerate its turns "
                "one by one (--turns all) pass --tool-call-parser NAME, SGLang's parser "
                "name for the model (kimi_k2, qwen25, deepseekv3, glm, ...), or regenerate "
                "its last turn only with --turns last")
        turns = turn_count(record.messages)
        if turns == 1:
            yield record
            continue
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
