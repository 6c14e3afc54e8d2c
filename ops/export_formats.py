"""The three export formats: what one stored result becomes in each, and how it is written.

A builder (ops/export_specforge.py, ops/export_speculators.py, and the parquet one here)
turns an :class:`ExportRow` into the record its format writes, or into a
:class:`LeftOut` saying why the sample cannot be a training row of that format. Export
writes what builders return; validate rebuilds the same records from SQL and compares, so
the two can never disagree about what a correct export is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from common.conversation_store import latest_turns
from common.errors import ConfigError
from common.store import DatasetRow, Store
from ops.export_ids import RowIds
from ops.export_record import LeftOut
from ops.export_rows import ExportRow
from ops.export_specforge import SpecForgeBuilder
from ops.export_speculators import SpeculatorsBuilder

FORMATS = ("specforge", "speculators", "parquet")
# What a row is: a whole conversation (SpecForge's regeneration; for speculators, the last
# turn's ids with every own answer masked 1), or one assistant turn (SpecForge's
# expand_reasoning_conversations.py; a speculators turn row is that turn's request).
ROWS = ("conversation", "turn")
EXTENSIONS = {
    "specforge": "specforge.jsonl",
    "speculators": "speculators.jsonl",
    "parquet": "parquet",
}


def output_file(directory: Path, dataset: str, fmt: str) -> Path:
    return directory / f"{dataset}.{EXTENSIONS[fmt]}"


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
