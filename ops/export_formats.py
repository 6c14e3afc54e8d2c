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

from common.conversation_store import latest_turns
from common.errors import ConfigError
from common.kept import left_out, reasoning_closer, split_reasoning
from common.store import DatasetRow, Store
from common.tokenizer_files import code_class
from ops.export_rows import ExportRow
from ops.specforge_check import row_error

FORMATS = ("specforge", "speculators", "parquet")
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
    def build(self, row: ExportRow) -> dict[str, Any] | LeftOut: ...


def output_file(directory: Path, dataset: str, fmt: str) -> Path:
    return directory / f"{dataset}.{EXTENSIONS[fmt]}"


def reasoning_close(ds: DatasetRow) -> str | None:
    """The marker closing the dataset's reasoning block, None when it opened none."""
    try:
        return reasoning_closer(ds.reasoning_open)
    except ConfigError as exc:
        raise ConfigError(f"dataset {ds.name}: {exc}") from None


class SpecForgeBuilder:
    """``{"id", "status", "conversations"}`` rows as SpecForge's regeneration writes them.

    A conversation regenerated turn by turn is one row, its last stored turn's: that
    turn's prompt holds every earlier answer as the model's own, each with its
    ``reasoning_content``, and the turn's answer ends it. ``latest``: each conversation's
    last stored turn (``common.conversation_store.latest_turns``); its earlier turns are
    left out as ``earlier_turn``."""

    def __init__(self, ds: DatasetRow, latest: Mapping[str, int] | None = None) -> None:
        self.latest = latest or {}
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
        if row.conversation is not None and row.turn is not None \
                and row.turn < self.latest.get(row.conversation, row.turn):
            return LeftOut("earlier_turn", f"turn {row.turn} of {row.conversation}, "
                           f"carried by turn {self.latest[row.conversation]}")
        # Not kept (common.kept): the samples the ``kept`` budget basis does not charge.
        reason = left_out(row.finish_reason, row.output_text, self.closer)
        if reason == "cut_at_budget":
            return LeftOut(reason, f"cut to the budget at {row.completion_tokens} tokens")
        if reason is not None:
            return LeftOut(reason, f"no {self.closer} in {row.completion_tokens} tokens "
                           f"(finish {row.finish_reason})")
        reasoning, answer, _cut = split_reasoning(row.output_text, self.closer)
        if not answer.strip():
            return LeftOut("empty_answer", f"{row.completion_tokens} tokens, empty answer")
        turns = [_prompt_turn(m) for m in row.messages]
        turns.append({"role": "assistant", "content": answer, "reasoning_content": reasoning})
        record = {"id": row.sample_id, "status": "success", "conversations": turns}
        if row.tools is not None:
            record["tools"] = row.tools
        error = row_error(record, **self.flags)
        if error is None:
            return record
        reason = "think_marker" if "thinking marker" in error else "prompt_breaks_checker"
        return LeftOut(reason, error)


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

    ``text`` is the prompt ids decoded with special tokens kept (so it shows the chat
    template the model saw) followed by the stored ``output_text`` (which the worker
    decoded without special tokens). It is for reading; ``input_ids`` and ``loss_mask``
    are the training data. Without the dataset's ``tokenizer.json`` on disk the key is
    left out rather than filled with half the text.
    """

    def __init__(self, ds: DatasetRow) -> None:
        self.ds = ds
        self.decoder, self.text_note = _prompt_decoder(ds)
        self.sampling = {k: v for k, v in ds.sampling.items() if k != "max_new_tokens"}

    def build(self, row: ExportRow) -> dict[str, Any] | LeftOut:
        if row.input_ids is None:
            return LeftOut("missing_prompt", "no prompt row: its input ids are unknown")
        if not row.output_ids:
            return LeftOut("empty_output", f"finish {row.finish_reason} with no tokens")
        record: dict[str, Any] = {
            "id": row.sample_id,
            "input_ids": row.input_ids + row.output_ids,
            "loss_mask": [0] * len(row.input_ids) + [1] * len(row.output_ids),
        }
        if self.decoder is not None:
            prompt = self.decoder.decode(row.input_ids, skip_special_tokens=False)
            record["text"] = prompt + row.output_text
        record["metadata"] = {
            "finish_reason": row.finish_reason,
            "prompt_tokens": row.prompt_tokens,
            "completion_tokens": row.completion_tokens,
            "model": row.model,
            # What the worker sent: the dataset's sampling with the prompt's own cap.
            "sampling": {**self.sampling, "max_new_tokens": row.max_new_tokens},
            "dataset": row.dataset,
            "sample_id": row.sample_id,
        }
        return record


class ParquetBuilder:
    """Every result column as stored, plus the prompt's ``input_ids``; nothing left out.

    ``finish_detail`` is free-form JSON, so it is kept as JSON text.
    """

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
            "server": row.server,
            "model": row.model,
            "created_at": row.created_at,
            "kept": row.kept,
            "input_ids": row.input_ids,
        }


AnyBuilder = SpecForgeBuilder | SpeculatorsBuilder | ParquetBuilder


def builder_notes(builder: AnyBuilder) -> dict[str, str]:
    """What the manifest should say about how this dataset's records were made."""
    return {"text": builder.text_note} if isinstance(builder, SpeculatorsBuilder) else {}


def conversation_ends(store: Store, ds: DatasetRow, upto_id: int) -> dict[str, int] | None:
    """Each conversation's last stored turn, for a dataset regenerated turn by turn."""
    return latest_turns(store, ds.name, upto_id) if ds.turns == "all" else None


def make_builder(fmt: str, ds: DatasetRow, latest: Mapping[str, int] | None = None
                 ) -> AnyBuilder:
    """``latest``: each conversation's last stored turn, for SpecForge's one row per
    conversation."""
    if fmt == "specforge":
        return SpecForgeBuilder(ds, latest)
    if fmt == "speculators":
        return SpeculatorsBuilder(ds)
    if fmt == "parquet":
        return ParquetBuilder()
    raise ConfigError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
