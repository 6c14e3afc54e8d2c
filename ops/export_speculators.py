"""speculators rows: prompt + output ids, a loss mask and metadata, one per turn or one
per conversation, as speculators' own regeneration writes them."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from common.store import DatasetRow
from common.tokenizer_files import code_class
from ops.export_ids import RowIds
from ops.export_record import LeftOut, dataset_sampling, earlier_turn, sent, string_or_none
from ops.export_rows import ExportRow
from ops.export_spans import ConversationMasks, SpanError
from producer.generations import line_id


def _prompt_decoder(ds: DatasetRow) -> tuple[Any, str]:
    """The dataset's tokenizer (the ``tokenizers`` one: fast, no transformers import), and
    what the ``text`` field holds with it."""
    path = Path(ds.tokenizer) / "tokenizer.json"
    if not path.is_file():
        code = code_class(Path(ds.tokenizer))
        why = f"; its tokenizer is Python code ({code}), not run for text" if code else ""
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
        written = string_or_none(record.get("id"))
        return None if written is None else self.ids.stored(written)

    def primary_id(self, row: ExportRow) -> str:
        """The line a row comes from, as speculators keys its conversations: the same for
        every turn of a conversation and every generation of a line."""
        unit = row.conversation or row.sample_id
        return line_id(unit) if self.ds.generations > 1 else unit
