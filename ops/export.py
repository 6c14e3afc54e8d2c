"""``datagen export``: stored results as training files, one per dataset, plus a manifest.

    datagen export --format specforge|speculators|parquet --out DIR [--dataset NAME ...]
                   [--rows conversation|turn] [--allow-empty]

Writes ``DIR/<dataset>.specforge.jsonl`` (or ``.speculators.jsonl``, ``.parquet``) and
``DIR/manifest.datagen`` (JSON). Memory stays flat in the number of results: rows stream
from SQL in batches and go to the file one by one. Each dataset is read up to the newest result
present when its export starts, so workers may keep running; the manifest records that
bound and ``datagen validate`` checks against it.

A dataset that has results but whose file gets no row (every sample left out) fails the
export with exit 1, the reasons counted, unless ``--allow-empty`` says it is wanted; the
files and the manifest are written either way, and the manifest records the choice.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from common.order import Order
from common.progress_bar import ProgressBar
from common.services import safe_url
from common.settings import Settings
from common.store import DatasetRow, Store
from ops.argtypes import add_quiet_flag
from ops.export_card import check_card_free, write_card
from ops.export_formats import (
    FORMATS,
    ROWS,
    builder_notes,
    conversation_ends,
    make_builder,
    output_file,
    rows_for,
)
from ops.export_ids import shared_lines
from ops.export_io import LEGACY_MANIFEST, MANIFEST, Sink, open_sink
from ops.export_record import REASONS, Builder, LeftOut
from ops.export_rows import ExportRow, count_results, iter_rows, result_counts, snapshot_id

MANIFEST_VERSION = 1
MAX_EXAMPLES = 20


def add_export_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("export", help="write stored results as training files, per dataset")
    p.add_argument("--format", required=True, choices=FORMATS, dest="format")
    p.add_argument("--out", required=True, help="directory to write into (created if absent)")
    p.add_argument("--dataset", action="extend", nargs="+", dest="datasets", metavar="NAME",
                   help="only these datasets (default: all)")
    p.add_argument("--rows", choices=ROWS, default=None,
                   help="specforge: a row per conversation (default) or per assistant turn, "
                        "as SpecForge's expand_reasoning_conversations.py writes them; "
                        "speculators: a row per turn (default) or per conversation, every "
                        "own answer in it masked 1")
    p.add_argument("--allow-empty", action="store_true",
                   help="exit 0 even when a dataset with results gets a file with no row")
    add_quiet_flag(p)
    return p


@dataclass
class DatasetExport:
    """What one dataset's export wrote and what it left out, as the manifest records it."""

    name: str
    file: str
    results: int
    upto_result_id: int
    reasoning_open: str | None
    # The dataset's publishing order, which decided the samples its budget kept.
    order: Order = field(default_factory=Order)
    # Its sampling mixtures (common/draws.py, null for none) and samples of each prompt.
    mixtures: dict[str, list[dict[str, Any]]] | None = None
    generations: int = 1
    # The reasoning opener of each template draw (common/kept.py), null without any.
    reasoning_opens: dict[str, str | None] | None = None
    exported: int = 0
    left_out: Counter[str] = field(default_factory=Counter)
    examples: list[dict[str, str]] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)
    columns: set[str] = field(default_factory=set)  # the keys of the rows written

    def leave_out(self, sample_id: str, why: LeftOut) -> None:
        self.left_out[why.reason] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append({"sample_id": sample_id, "reason": why.reason,
                                  "detail": why.detail})

    def as_manifest(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "results": self.results,
            "exported": self.exported,
            "left_out": dict(sorted(self.left_out.items())),
            "left_out_total": sum(self.left_out.values()),
            "left_out_examples": self.examples,
            "upto_result_id": self.upto_result_id,
            "reasoning_open": self.reasoning_open,
            "reasoning_opens": self.reasoning_opens,
            "order": self.order.kind,
            "seed": self.order.seed,
            "mixtures": self.mixtures,
            "generations": self.generations,
            **self.notes,
        }


def write_rows(
    rows: Iterable[ExportRow], builder: Builder, sink: Sink, stats: DatasetExport,
    on_row: Callable[[], None] = lambda: None,
) -> None:
    """Build and write each row as it arrives: nothing here holds more than one row."""
    for row in rows:
        built = builder.build(row)
        if isinstance(built, LeftOut):
            stats.leave_out(row.sample_id, built)
        else:
            sink.write(built)
            stats.columns.update(built)
            stats.exported += 1
        on_row()


@dataclass(frozen=True)
class Choices:
    """How an export builds its rows, the same for each of its datasets."""

    fmt: str
    rows: str | None = None  # --rows
    trust_remote_code: bool = False  # the tokenizer may be loaded by running its code
    shared: frozenset[str] = frozenset()  # lines held by several datasets (export_ids)


def export_dataset(store: Store, ds: DatasetRow, choices: Choices, out: Path,
                   progress: ProgressBar, upto: int | None = None) -> DatasetExport:
    """``upto``: the newest result to read (default: the newest now)."""
    fmt = choices.fmt
    upto = snapshot_id(store, ds.name) if upto is None else upto
    path = output_file(out, ds.name, fmt)
    stats = DatasetExport(ds.name, path.name, count_results(store, ds.name, upto), upto,
                          ds.reasoning_open, ds.order, ds.mixtures.to_json(),
                          ds.generations, ds.reasoning_opens)
    builder = make_builder(fmt, ds, conversation_ends(store, ds, upto, fmt), choices.rows,
                           choices.trust_remote_code, choices.shared)
    stats.notes.update(builder_notes(builder))
    progress.label(ds.name)
    with open_sink(fmt, path) as sink:
        rows_read = iter_rows(store, ds.name, upto, builder.answers)
        write_rows(rows_read, builder, sink, stats, progress.advance)
        sink.commit()
    return stats


def prepare_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    check_card_free(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        # A stale manifest must not describe the files this export is about to replace.
        (out / MANIFEST).unlink(missing_ok=True)
        (out / LEGACY_MANIFEST).unlink(missing_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot write there ({exc.strerror or exc})") from None


def select_datasets(store: Store, names: list[str] | None) -> list[DatasetRow]:
    """All datasets, or the named ones in the order given; UnknownDatasetError otherwise."""
    if not names:
        return store.datasets()
    return [store.dataset(name) for name in dict.fromkeys(names)]


def manifest(fmt: str, database_url: str, stats: list[DatasetExport],
             allow_empty: bool = False, rows: str | None = None,
             shared: frozenset[str] = frozenset()) -> dict[str, Any]:
    used = sorted({reason for s in stats for reason in s.left_out})
    return {
        "datagen_export": MANIFEST_VERSION,
        "format": fmt,
        "rows": rows_for(fmt, rows),
        # Lines more than one dataset holds: their rows' ids are <dataset>/<id>.
        "shared_lines": len(shared),
        "allow_empty": allow_empty,
        "created_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        "database_url": safe_url(database_url),
        "datasets": {s.name: s.as_manifest() for s in stats},
        "totals": {
            "results": sum(s.results for s in stats),
            "exported": sum(s.exported for s in stats),
            "left_out": sum(sum(s.left_out.values()) for s in stats),
        },
        "reasons": {reason: REASONS[reason] for reason in used},
    }


def write_manifest(out: Path, doc: dict[str, Any]) -> Path:
    path = out / MANIFEST
    temp = out / f".{MANIFEST}.partial"
    temp.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(temp, path)
    return path


def summary_lines(fmt: str, out: Path, stats: list[DatasetExport]) -> list[str]:
    lines = [f"exported {fmt} to {out} ({MANIFEST} describes it, README.md is its dataset "
             "card)"]
    if not stats:
        lines.append("  no datasets in the database yet: nothing to export")
    for s in stats:
        left = sum(s.left_out.values())
        line = f"  {s.name}: {s.exported:,} exported, {left:,} left out"
        if s.results == 0:
            line += " (no results stored yet)"
        lines.append(line + f" -> {s.file}")
        for reason, n in sorted(s.left_out.items()):
            lines.append(f"      {n:,} {reason}: {REASONS[reason]}")
        if fmt == "specforge" and s.exported == 0:
            lines.append("      note: the file has no rows; SpecForge's checker rejects an "
                         "empty file")
        if "text" in s.notes and s.notes["text"].startswith("omitted"):
            lines.append(f"      note: text {s.notes['text']}")
    return lines


def empty_files(stats: list[DatasetExport]) -> list[str]:
    """Each dataset whose file holds no row though SQL holds results, with the reasons."""
    return [
        f"{s.name}: 0 of {s.results:,} results exported ("
        + ", ".join(f"{n:,} {reason}" for reason, n in sorted(s.left_out.items())) + ")"
        for s in stats if s.results and not s.exported
    ]


def run_export(args: argparse.Namespace, settings: Settings) -> int:
    out = Path(args.out)
    store = Store(settings.database_url, settings.db_connections)
    datasets = select_datasets(store, args.datasets)
    rows_for(args.format, args.rows)  # refused before anything is written
    prepare_out(out)
    counts = result_counts(store)
    total = sum(counts.get(ds.name, 0) for ds in datasets)
    # Every bound first: the lines shared between datasets are found among the results
    # each dataset's file is made of.
    upto = {ds.name: snapshot_id(store, ds.name) for ds in datasets}
    shared = shared_lines(store, datasets, upto) if args.format != "parquet" else frozenset()
    choices = Choices(args.format, args.rows, settings.trust_remote_code, shared)
    with ProgressBar("export", "rows", total, quiet=args.quiet,
                     every_s=settings.progress_every_s) as progress:
        stats = [export_dataset(store, ds, choices, out, progress, upto[ds.name])
                 for ds in datasets]
    doc = manifest(args.format, settings.database_url, stats, args.allow_empty, args.rows,
                   shared)
    write_manifest(out, doc)
    write_card(out, store, args.format, doc["created_at"], datasets, stats, len(shared))
    print("\n".join(summary_lines(args.format, out, stats)))
    empty = empty_files(stats)
    if empty and not args.allow_empty:
        # A file with no row trains nothing; an exit 0 would let a pipeline carry on with it.
        print("datagen export: error: an export file holds no row:\n  " + "\n  ".join(empty)
              + "\n(pass --allow-empty to accept empty files)", file=sys.stderr)
        return 1
    return 0
