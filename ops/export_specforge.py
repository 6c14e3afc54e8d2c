"""SpecForge rows: ``{"id", "status", "conversations"}`` as SpecForge's regeneration
writes them, one per conversation or, as its expand_reasoning_conversations.py writes
them, one per assistant turn."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from common.conversation import TOOLS_DIFFER, turn_id
from common.kept import left_out, split_reasoning
from common.store import DatasetRow
from ops.export_ids import RowIds
from ops.export_record import (
    LeftOut,
    dataset_sampling,
    earlier_turn,
    reasoning_close,
    sent,
    string_or_none,
)
from ops.export_rows import ExportRow
from ops.specforge_check import row_error

# The suffix of a turn row's id, numbered from 0 as SpecForge's expansion numbers them.
TURN_ROW = "#turn"


def _prompt_turn(message: dict[str, Any]) -> dict[str, Any]:
    """A prompt turn as SpecForge wants it, with every field the prompt was rendered with
    (tool calls, a tool reply's call id and name) after role and content.

    SpecForge's checker wants ``reasoning_content`` to be a string on every assistant
    turn, so an earlier assistant turn read without one (chat templates of reasoning models
    mostly drop the reasoning of earlier turns) gets ``""`` there rather than being left out.
    """
    turn = {"role": message.get("role"), "content": message.get("content")}
    turn.update((k, v) for k, v in message.items() if k not in turn)
    if turn["role"] == "assistant" and turn.get("reasoning_content") is None:
        turn["reasoning_content"] = ""
    return turn


class SpecForgeBuilder:
    """``{"id", "status", "conversations"}`` rows as SpecForge's regeneration writes them.

    A conversation regenerated turn by turn is one row, its last stored turn's: that
    turn's prompt holds every earlier answer as the model's own, each with its
    ``reasoning_content``, and the turn's answer ends it. ``latest``: each conversation's
    last stored turn (``common.conversation_store.latest_turns``); its earlier turns are
    left out as ``earlier_turn``.

    An answer that called tools carries them, as the server parsed them and its
    successor's prompt stores them (``tool_calls``, under the line's call ids), with
    ``content`` the text beside them; the ``tool`` messages follow it in the next prompt.
    A turn whose calls were not the line's ended its conversation with its calls
    unparsed: it is left out (``tool_calls_differ``) and its conversation's row is the
    turn before (``latest`` from ``latest_turns(..., parsed_calls=True)``).

    Reasoning is split at the marker closing the row's own prompt's reasoning block: a
    drawn template argument may have opened none (``thinking=false``), and that row's
    whole output is its answer, with an empty ``reasoning_content``."""

    answers = True

    def __init__(self, ds: DatasetRow, latest: Mapping[str, int] | None = None,
                 rows: str = "conversation", ids: RowIds | None = None) -> None:
        self.latest = latest or {}
        self.ids = ids or RowIds(ds)
        self.rows = rows
        self.ds = ds
        self.sampling = dataset_sampling(ds)
        reasoning_close(ds)  # an opener without a known closer fails before any row

    def build(self, row: ExportRow) -> dict[str, Any] | LeftOut:
        if row.messages is None:
            return LeftOut("missing_prompt", "no prompt row for this result")
        if not row.sample_id.strip():
            return LeftOut("invalid_id", f"id {row.sample_id!r} is blank")
        earlier = earlier_turn(row, self.latest) if self.rows == "conversation" else None
        if earlier is not None:
            return earlier
        if (row.next_error or "").startswith(TOOLS_DIFFER):
            return LeftOut("tool_calls_differ", row.next_error or "")
        closer = reasoning_close(self.ds, row.template_kwargs)
        # Not kept (common.kept): the samples the ``kept`` budget basis does not charge.
        reason = left_out(row.finish_reason, row.output_text, closer)
        if reason == "cut_at_budget":
            return LeftOut(reason, f"cut to the budget at {row.completion_tokens} tokens")
        if reason is not None:
            return LeftOut(reason, f"no {closer} in {row.completion_tokens} tokens "
                           f"(finish {row.finish_reason})")
        final = self.answer(row, closer)
        if not final["content"].strip() and not final.get("tool_calls"):
            return LeftOut("empty_answer", f"{row.completion_tokens} tokens, empty answer")
        turns = [_prompt_turn(m) for m in row.messages]
        turns.append(final)
        unit = row.conversation or row.sample_id
        record = {"id": self.ids.written(unit, row.sample_id), "status": "success",
                  "conversations": turns}
        if row.tools is not None:
            record["tools"] = row.tools
        record.update(sent(row, self.sampling, "sampling"))
        error = row_error(record, **self.expectations(record))
        if error is None:
            return record if self.rows == "conversation" else self.turn_row(record, row)
        reason = "think_marker" if "thinking marker" in error else "prompt_breaks_checker"
        return LeftOut(reason, error)

    def expectations(self, record: dict[str, Any]) -> dict[str, bool]:
        """The checker's reasoning flags for a row: those of its own prompt, rendered with
        the ``chat_template_kwargs`` the row carries when they were drawn."""
        drawn = record.get("chat_template_kwargs")
        closer = reasoning_close(self.ds, drawn if isinstance(drawn, dict) else None)
        return {"expect_reasoning": closer is not None, "expect_non_reasoning": closer is None}

    def answer(self, row: ExportRow, closer: str | None) -> dict[str, Any]:
        """The turn's answer as the last message: split at the reasoning marker, or, when
        it called tools, as its successor's prompt stores it, calls and all."""
        stored = row.answer or {}
        if stored.get("tool_calls"):
            return {"role": "assistant", "content": str(stored.get("content") or ""),
                    "reasoning_content": stored.get("reasoning_content") or "",
                    "tool_calls": stored["tool_calls"]}
        reasoning, answer, _cut = split_reasoning(row.output_text, closer)
        return {"role": "assistant", "content": answer, "reasoning_content": reasoning}

    def turn_row(self, record: dict[str, Any], row: ExportRow) -> dict[str, Any]:
        """The row of this one assistant turn, as SpecForge's expansion writes it: earlier
        assistant turns are history, their reasoning emptied (the expansion drops it; an
        empty string keeps SpecForge's checker satisfied), the last one is trained on."""
        turns = record["conversations"]
        history = [{**m, "reasoning_content": ""} if m["role"] == "assistant" else m
                   for m in turns[:-1]]
        index = sum(m["role"] == "assistant" for m in history)
        unit = row.conversation or row.sample_id
        source = self.ids.written(unit, unit)
        out = {"id": f"{source}{TURN_ROW}{index}", "source_id": source,
               "assistant_turn_index": index, "status": "success",
               "conversations": [*history, turns[-1]]}
        # What else the row carries (tools, the sampling sent) stays as it is.
        out.update((k, v) for k, v in record.items() if k not in out)
        return out

    def sample_id_of(self, record: dict[str, Any]) -> str | None:
        """The stored sample a row of this builder was made from."""
        if self.rows == "conversation":
            written = string_or_none(record.get("id"))
            return None if written is None else self.ids.stored(written)
        source, index = string_or_none(record.get("source_id")), record.get("assistant_turn_index")
        if source is None or not isinstance(index, int) or isinstance(index, bool):
            return None
        source = self.ids.stored(source)
        # A conversation's turn i (from 1) has the model's own i - 1 answers before it; a
        # line of a single turn is a prompt of its own, under its own id.
        return turn_id(source, index + 1) if source in self.latest else source
