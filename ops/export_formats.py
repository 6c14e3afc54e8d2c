"""The three export formats: what one stored result becomes in each, and how it is written.

A builder turns an :class:`ExportRow` into the record its format writes, or into a
:class:`LeftOut` saying why the sample cannot be a training row of that format. Export
writes what builders return; validate rebuilds the same records from SQL and compares, so
the two can never disagree about what a correct export is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from common.conversation import TOOLS_DIFFER, turn_id
from common.conversation_store import latest_turns
from common.errors import ConfigError
from common.kept import left_out, reasoning_closer, split_reasoning
from common.store import DatasetRow, Store
from common.tokenizer_files import code_class
from ops.export_ids import RowIds
from ops.export_rows import ExportRow
from ops.export_spans import ConversationMasks, SpanError
from ops.specforge_check import row_error
from producer.generations import line_id

FORMATS = ("specforge", "speculators", "parquet")
# What a row is: a whole conversation (SpecForge's regeneration; for speculators, the last
# turn's ids with every own answer masked 1), or one assistant turn (SpecForge's
# expand_reasoning_conversations.py; a speculators turn row is that turn's request).
ROWS = ("conversation", "turn")
# The suffix of a turn row's id, numbered from 0 as SpecForge's expansion numbers them.
TURN_ROW = "#turn"
EXTENSIONS = {
    "specforge": "specforge.jsonl",
    "speculators": "speculators.jsonl",
    "parquet": "parquet",
}
# Why a sample was left out, by the key the manifest and the summary count it under.
REASONS = {
    "missing_prompt": "its prompt row is missing from SQL",
    "invalid_id": "its id is blank, which SpecForge rejects",
    "cut_while_reasoning": "cut off while still reasoning: no closing marker, so no answer",
    "cut_at_budget": "cut to fill the budget (the exact policy): the answer ends mid-way",
    "empty_answer": "the answer after the reasoning (or the whole output) is empty",
    "think_marker": "a reasoning marker is left in the answer or the reasoning",
    "prompt_breaks_checker": "its prompt turns break SpecForge's checker",
    "empty_output": "no output tokens: nothing to train on",
    "earlier_turn": "an earlier turn of a conversation: the row of its last stored turn "
                    "carries it",
    "tool_calls_differ": "its tool calls were not the line's: they ended the conversation "
                         "unparsed, so no row can carry them as calls",
    "answers_unplaced": "its prompt's own earlier answers cannot be placed exactly in its "
                        "ids (the template or tokenizer differs from the run's)",
}


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


@dataclass(frozen=True)
class LeftOut:
    reason: str  # a key of REASONS
    detail: str


class Builder(Protocol):
    answers: bool  # reads each turn's own answer as stored (ExportRow.answer)

    def build(self, row: ExportRow) -> dict[str, Any] | LeftOut: ...


def earlier_turn(row: ExportRow, latest: Mapping[str, int]) -> LeftOut | None:
    """A turn before its conversation's last stored one, which that one's row carries."""
    if row.conversation is None or row.turn is None \
            or row.turn >= latest.get(row.conversation, row.turn):
        return None
    return LeftOut("earlier_turn", f"turn {row.turn} of {row.conversation}, carried by "
                   f"turn {latest[row.conversation]}")


def output_file(directory: Path, dataset: str, fmt: str) -> Path:
    return directory / f"{dataset}.{EXTENSIONS[fmt]}"


def reasoning_close(ds: DatasetRow) -> str | None:
    """The marker closing the dataset's reasoning block, None when it opened none."""
    try:
        return reasoning_closer(ds.reasoning_open)
    except ConfigError as exc:
        raise ConfigError(f"dataset {ds.name}: {exc}") from None


def dataset_sampling(ds: DatasetRow) -> dict[str, Any]:
    return {k: v for k, v in ds.sampling.items() if k != "max_new_tokens"}


def sent(row: ExportRow, sampling: dict[str, Any], key: str) -> dict[str, Any]:
    """``{key: the sampling_params the request sent}``, and the chat template arguments
    drawn for its prompt, if any. A result stored before requests' sampling was recorded
    was sent its dataset's (``sampling``, mixtures came later) with its prompt's cap."""
    used = row.sampling
    if used is None:
        used = {**sampling, "max_new_tokens": row.max_new_tokens}
    out: dict[str, Any] = {key: used}
    if row.template_kwargs:
        out["chat_template_kwargs"] = row.template_kwargs
    return out


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
    turn before (``latest`` from ``latest_turns(..., parsed_calls=True)``)."""

    answers = True

    def __init__(self, ds: DatasetRow, latest: Mapping[str, int] | None = None,
                 rows: str = "conversation", ids: RowIds | None = None) -> None:
        self.latest = latest or {}
        self.ids = ids or RowIds(ds)
        self.rows = rows
        self.sampling = dataset_sampling(ds)
        self.closer = reasoning_close(ds)
        self.flags = {
            "expect_reasoning": self.closer is not None,
            "expect_non_reasoning": self.closer is None,
        }

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
        # Not kept (common.kept): the samples the ``kept`` budget basis does not charge.
        reason = left_out(row.finish_reason, row.output_text, self.closer)
        if reason == "cut_at_budget":
            return LeftOut(reason, f"cut to the budget at {row.completion_tokens} tokens")
        if reason is not None:
            return LeftOut(reason, f"no {self.closer} in {row.completion_tokens} tokens "
                           f"(finish {row.finish_reason})")
        final = self.answer(row)
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
        error = row_error(record, **self.flags)
        if error is None:
            return record if self.rows == "conversation" else self.turn_row(record, row)
        reason = "think_marker" if "thinking marker" in error else "prompt_breaks_checker"
        return LeftOut(reason, error)

    def answer(self, row: ExportRow) -> dict[str, Any]:
        """The turn's answer as the last message: split at the reasoning marker, or, when
        it called tools, as its successor's prompt stores it, calls and all."""
        stored = row.answer or {}
        if stored.get("tool_calls"):
            return {"role": "assistant", "content": str(stored.get("content") or ""),
                    "reasoning_content": stored.get("reasoning_content") or "",
                    "tool_calls": stored["tool_calls"]}
        reasoning, answer, _cut = split_reasoning(row.output_text, self.closer)
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
            written = _string(record.get("id"))
            return None if written is None else self.ids.stored(written)
        source, index = _string(record.get("source_id")), record.get("assistant_turn_index")
        if source is None or not isinstance(index, int) or isinstance(index, bool):
            return None
        source = self.ids.stored(source)
        # A conversation's turn i (from 1) has the model's own i - 1 answers before it; a
        # line of a single turn is a prompt of its own, under its own id.
        return turn_id(source, index + 1) if source in self.latest else source


def _string(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _prompt_decoder(ds: DatasetRow) -> tuple[Any, str]:
    """The dataset's tokenizer (the ``tokenizers`` one: fast, no transformers import), and
    what the ``text`` field holds with it."""
    path = Path(ds.tokenizer) / "tokenizer.json"
    if not path.is_file():
        code = code_class(Path(ds.tokenizer))
        why = f"; its tokenizer is Python code ({code}), which export does not run" if code else ""
        return None, f"omitted: no {path} to decode the prompt ids with{why}"
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path)), "decoded prompt ids + stored output_text"
    except Exception as exc:  # a corrupt file must not stop the export: text is optional
        return None, f"omitted: {path} does not load ({exc})"


class SpeculatorsBuilder:
    """Token-level rows: prompt + output ids, a loss mask on the output, and metadata.

    A conversation row (``rows="conversation"``) is its last stored turn's: that turn's
    prompt ids (every earlier answer the model's own, as the template renders history)
    and output, masked 1 on the output and on each own earlier answer as it sits in the
    prompt (ops/export_spans.py); its earlier turns are left out as ``earlier_turn``.

    ``text`` is the prompt ids decoded with special tokens kept (so it shows the chat
    template the model saw) followed by the stored ``output_text`` (which the worker
    decoded without special tokens). It is for reading; ``input_ids`` and ``loss_mask``
    are the training data. Without the dataset's ``tokenizer.json`` on disk the key is
    left out rather than filled with half the text.
    """

    answers = False

    def __init__(self, ds: DatasetRow, latest: Mapping[str, int] | None = None,
                 rows: str = "turn", trust_remote_code: bool = False,
                 ids: RowIds | None = None) -> None:
        self.ds, self.latest, self.rows = ds, latest or {}, rows
        self.ids = ids or RowIds(ds)
        self.decoder, self.text_note = _prompt_decoder(ds)
        self.sampling = dataset_sampling(ds)
        self.masks = ConversationMasks(ds, trust_remote_code) if rows == "conversation" \
            else None

    def build(self, row: ExportRow) -> dict[str, Any] | LeftOut:
        if row.input_ids is None:
            return LeftOut("missing_prompt", "no prompt row: its input ids are unknown")
        earlier = earlier_turn(row, self.latest) if self.masks is not None else None
        if earlier is not None:
            return earlier
        if not row.output_ids:
            return LeftOut("empty_output", f"finish {row.finish_reason} with no tokens")
        prompt_mask = self.prompt_mask(row)
        if isinstance(prompt_mask, LeftOut):
            return prompt_mask
        unit = row.conversation or row.sample_id
        record: dict[str, Any] = {
            "id": self.ids.written(unit, row.sample_id),
            "primary_id": self.ids.written(unit, self.primary_id(row)),
            "input_ids": row.input_ids + row.output_ids,
            "loss_mask": prompt_mask + [1] * len(row.output_ids),
        }
        if self.decoder is not None:
            prompt = self.decoder.decode(row.input_ids, skip_special_tokens=False)
            record["text"] = prompt + row.output_text
        record["metadata"] = {
            "finish_reason": row.finish_reason,
            "usage": {"prompt_tokens": row.prompt_tokens,
                      "completion_tokens": row.completion_tokens,
                      "total_tokens": row.prompt_tokens + row.completion_tokens},
            "model": row.model,
            **sent(row, self.sampling, "sampling_params"),
            "dataset": row.dataset,
            "sample_id": row.sample_id,
        }
        return record

    def prompt_mask(self, row: ExportRow) -> list[int] | LeftOut:
        """0 on the prompt, but for a conversation row's own earlier answers."""
        if self.masks is None or not row.turn or row.turn == 1 or row.messages is None:
            return [0] * len(row.input_ids or ())
        try:
            return self.masks.prompt_mask(row.messages, row.tools, row.input_ids or [],
                                          row.template_kwargs)
        except SpanError as exc:
            return LeftOut("answers_unplaced", str(exc))

    def sample_id_of(self, record: dict[str, Any]) -> str | None:
        """The stored sample a row of this builder was made from."""
        written = _string(record.get("id"))
        return None if written is None else self.ids.stored(written)

    def primary_id(self, row: ExportRow) -> str:
        """The line a row comes from, as speculators keys its conversations: the same for
        every turn of a conversation and every generation of a line."""
        unit = row.conversation or row.sample_id
        return line_id(unit) if self.ds.generations > 1 else unit


class ParquetBuilder:
    """Every result column as stored, plus the prompt's ``input_ids``; nothing left out.

    ``finish_detail`` is free-form JSON, so it is kept as JSON text.
    """

    answers = False

    def build(self, row: ExportRow) -> dict[str, Any] | LeftOut:
        detail = row.finish_detail
        return {
            "id": row.id,
            "dataset": row.dataset,
            "sample_id": row.sample_id,
            "rid": row.rid,
            "prompt_tokens": row.prompt_tokens,
            "completion_tokens": row.completion_tokens,
            "cached_tokens": row.cached_tokens,
            "reasoning_tokens": row.reasoning_tokens,
            "finish_reason": row.finish_reason,
            "finish_detail": None if detail is None else json.dumps(detail, sort_keys=True),
            "output_ids": row.output_ids,
            "output_text": row.output_text,
            "e2e_latency_s": row.e2e_latency_s,
            "sampling": None if row.sampling is None else json.dumps(row.sampling, sort_keys=True),
            "server": row.server,
            "model": row.model,
            "created_at": row.created_at,
            "kept": row.kept,
            "input_ids": row.input_ids,
        }


AnyBuilder = SpecForgeBuilder | SpeculatorsBuilder | ParquetBuilder


# What a row of each format may be, its default first; a parquet row is a stored result.
_ROWS_OF = {"specforge": ROWS, "speculators": ("turn", "conversation"), "parquet": ()}


def rows_for(fmt: str, rows: str | None) -> str | None:
    """``--rows`` checked against the format (ConfigError), or the format's default."""
    allowed = _ROWS_OF.get(fmt, ())
    if rows is None:
        return allowed[0] if allowed else None
    if rows not in allowed:
        detail = f"use {' or '.join(allowed)}" if allowed else "its rows are stored results"
        raise ConfigError(f"--rows {rows} does not apply to {fmt}: {detail}")
    return rows


def builder_notes(builder: AnyBuilder) -> dict[str, str]:
    """What the manifest should say about how this dataset's records were made."""
    return {"text": builder.text_note} if isinstance(builder, SpeculatorsBuilder) else {}


def conversation_ends(store: Store, ds: DatasetRow, upto_id: int, fmt: str
                      ) -> dict[str, int] | None:
    """Each conversation's last stored turn, for a dataset regenerated turn by turn; for
    SpecForge, the last whose tool calls, if any, are stored parsed."""
    if ds.turns != "all":
        return None
    return latest_turns(store, ds.name, upto_id, parsed_calls=fmt == "specforge")


def make_builder(fmt: str, ds: DatasetRow, latest: Mapping[str, int] | None = None,
                 rows: str | None = None, trust_remote_code: bool = False,
                 shared: frozenset[str] = frozenset()) -> AnyBuilder:
    """``latest``: each conversation's last stored turn, for one row per conversation.
    ``rows``: ``--rows``, checked by ``rows_for``. ``trust_remote_code``: the dataset's
    tokenizer may be loaded by running its code (speculators conversation rows).
    ``shared``: the lines other datasets of the export hold too (ops/export_ids.py)."""
    rows = rows_for(fmt, rows)
    if fmt == "specforge":
        return SpecForgeBuilder(ds, latest, rows or "conversation", RowIds(ds, shared))
    if fmt == "speculators":
        return SpeculatorsBuilder(ds, latest, rows or "turn", trust_remote_code,
                                  RowIds(ds, shared))
    if fmt == "parquet":
        return ParquetBuilder()
    raise ConfigError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
