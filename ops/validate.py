"""``datagen validate DIR``: check an export against the SQL it came from.

    datagen validate DIR [--dataset NAME ...]

``DIR/manifest.datagen`` (``manifest.json`` before 0.3.0) says the format, the datasets
and, per dataset, the newest result the export read and what it left out. For each dataset:

* every record is readable and keeps its format's own rules: SpecForge's checker for
  ``specforge`` (reimplemented in :mod:`ops.specforge_check`, which names the upstream
  file and commit it mirrors), a 0s-then-1s loss mask for ``speculators``, datagen's
  schema for ``parquet``;
* no id appears twice, in a file or across the export's files; the lines several
  datasets hold, found again from SQL, are those whose ids the export prefixed with
  their dataset (ops/export_ids.py), as many as the manifest's ``shared_lines``;
* every record equals the one export builds from SQL now, field by field (so
  ``input_ids``/``output_ids`` are the stored prompt and output ids exactly, and the
  mask matches the prompt length), and names a stored result;
* every stored result up to the manifest's bound is either in the file or left out for
  a reason the exporter gives, and the counts equal the manifest's;
* a file holds at least one row when its dataset has results, unless the export was made
  with ``--allow-empty``; and an export whose files hold no row at all while SQL holds
  results always fails: there is nothing in it to train on.

Memory holds the set of ids seen in one file (to find duplicates and what is missing),
the ids of every file read (to find one repeated across files), and the shared lines;
records and SQL rows are streamed. Exit 1 on any mismatch, 0 when clean.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import ConfigError, UnknownDatasetError
from common.progress_bar import ProgressBar
from common.services import safe_url
from common.settings import Settings
from common.store import Store
from ops.argtypes import add_quiet_flag
from ops.export_formats import FORMATS, conversation_ends, make_builder
from ops.export_ids import shared_lines
from ops.export_io import LEGACY_MANIFEST, MANIFEST, read_records
from ops.export_record import LeftOut
from ops.export_rows import LOOKUP_CHUNK, count_results, iter_rows, lookup_rows, snapshot_id
from ops.validate_checks import MAX_SHOWN, Findings, describe_diff, record_id, shape_error

Pending = list[tuple[str, str, dict[str, Any]]]  # (where, id, record) awaiting SQL


def add_validate_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("validate", help="check an export against SQL (ids, masks, counts)")
    p.add_argument("dir", help="a directory written by datagen export")
    p.add_argument("--dataset", action="extend", nargs="+", dest="datasets", metavar="NAME",
                   help="only these datasets of the export (default: all)")
    add_quiet_flag(p)
    return p


def load_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not path.is_file() and (directory / LEGACY_MANIFEST).is_file():
        path = directory / LEGACY_MANIFEST  # an export made before 0.3.0
    if not path.is_file():
        raise ConfigError(f"{path} not found: {directory} is not a datagen export "
                          "(run datagen export --out DIR first)")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") not in FORMATS \
            or not isinstance(doc.get("datasets"), dict):
        raise ConfigError(f"{path}: not a datagen export manifest (format or datasets missing)")
    return doc


@dataclass
class ExportFacts:
    """What the checks of one export's datasets share: its manifest's choices, and the
    id of every record read so far, with its dataset (ids are unique across files)."""

    directory: Path
    fmt: str
    rows: str | None = None
    allow_empty: bool = False
    trust_remote_code: bool = False
    shared: frozenset[str] = frozenset()  # lines whose rows' ids hold their dataset
    ids: dict[str, str] = field(default_factory=dict)


def export_facts(store: Store, directory: Path, doc: dict[str, Any],
                 trust_remote_code: bool) -> ExportFacts:
    """The facts of the export ``doc`` describes. The lines several of its datasets hold
    are found again from SQL, up to its bounds; an export written before ids were made
    unique across datasets (no ``shared_lines``) prefixed none."""
    fmt, shared = doc["format"], frozenset[str]()
    if "shared_lines" in doc and fmt != "parquet":
        upto = {name: int(entry.get("upto_result_id", 0))
                for name, entry in doc["datasets"].items()}
        shared = shared_lines(store, [store.dataset(name) for name in upto], upto)
    return ExportFacts(directory, fmt, doc.get("rows"), doc.get("allow_empty") is True,
                       trust_remote_code, shared)


class DatasetCheck:
    """One dataset's file checked against SQL; mismatches go to the shared findings."""

    def __init__(self, store: Store, export: ExportFacts, name: str, entry: dict[str, Any],
                 findings: Findings, progress: ProgressBar | None = None) -> None:
        self.store, self.fmt, self.name, self.entry = store, export.fmt, name, entry
        self.export = export
        self.progress = progress or ProgressBar("validate", "rows", None, quiet=True)
        self.allow_empty = export.allow_empty
        # Only a file name: a manifest must not point validate outside the export.
        self.path = export.directory / Path(str(entry.get("file", ""))).name
        self.upto = int(entry.get("upto_result_id", 0))
        ds = store.dataset(name)
        self.builder = make_builder(self.fmt, ds, conversation_ends(store, ds, self.upto,
                                                                    self.fmt),
                                    export.rows, export.trust_remote_code, export.shared)
        self.findings = findings
        self.seen: set[str] = set()
        self.records = 0
        self.results = 0

    def work(self) -> int:
        """Rows this check reads: the file's records (as the manifest counts them) and the
        stored results up to the export's bound (one COUNT)."""
        return int(self.entry.get("exported") or 0) + count_results(self.store, self.name,
                                                                      self.upto)

    def _where(self, where: str) -> str:
        return f"{self.path.name} {where}"

    def run(self) -> str:
        if not self.path.is_file():
            self.findings.mismatch("missing-file", f"{self.name}: {self.path} not found")
            return f"{self.name}: file missing"
        self._check_file()
        results, left_out = self._check_sql()
        self.results = results
        self._check_counts(results, left_out)
        if results and not self.seen and not self.allow_empty:
            reasons = ", ".join(f"{n:,} {r}" for r, n in sorted(left_out.items()))
            self.findings.mismatch("empty", f"{self.name}: {self.path.name} holds no row of "
                                   f"{results:,} stored results ({reasons}); export with "
                                   "--allow-empty to accept an empty file")
        if snapshot_id(self.store, self.name) > self.upto:
            self.findings.notes.append(f"{self.name}: results stored after the export (ids "
                                       f"above {self.upto}) were not checked")
        return (f"{self.name}: {self.records:,} records checked; {results:,} stored results "
                f"up to id {self.upto}, {sum(left_out.values()):,} of them left out")

    # -- the file, record by record ------------------------------------------------------

    def _check_file(self) -> None:
        pending: Pending = []
        self.progress.label(f"{self.name} file")
        for where, record in read_records(self.fmt, self.path):
            self._take(where, record, pending)
            self.progress.advance()
            if len(pending) >= LOOKUP_CHUNK:
                self._against_sql(pending)
        self._against_sql(pending)
        if self.records == 0 and self.fmt == "specforge":
            self.findings.notes.append(f"{self.path.name} has no rows: SpecForge's checker "
                                       "rejects an empty file")

    def _take(self, where: str, record: dict[str, Any] | str, pending: Pending) -> None:
        if isinstance(record, str):
            self.findings.mismatch("unreadable", f"{self._where(where)}: {record}")
            return
        self.records += 1
        shape = shape_error(self.fmt, self.builder, record)
        if shape is not None:
            self.findings.mismatch(shape[0], f"{self._where(where)}: {shape[1]}")
        self._unique_across_files(where, record.get("id"))
        sid = record_id(self.fmt, self.builder, record)
        if sid is None:
            self.findings.mismatch("no-id", f"{self._where(where)}: no string id")
        elif sid in self.seen:
            self.findings.mismatch("duplicate-id", f"{self._where(where)}: id {sid!r} appears more "
                                   "than once")
        else:
            self.seen.add(sid)
            pending.append((where, sid, record))

    def _unique_across_files(self, where: str, written: Any) -> None:
        """An id another dataset's file of the export also holds (a file's own repeats
        are found by sample id)."""
        if not isinstance(written, str) or self.fmt == "parquet":
            return
        other = self.export.ids.setdefault(written, self.name)
        if other != self.name:
            self.findings.mismatch("duplicate-id", f"{self._where(where)}: id {written!r} "
                                   f"is also an id of {other}'s file")

    def _against_sql(self, pending: Pending) -> None:
        rows = lookup_rows(self.store, self.name, [sid for _, sid, _ in pending],
                           self.builder.answers)
        for where, sid, record in pending:
            row = rows.get(sid)
            if row is None or row.id > self.upto:
                self.findings.mismatch("extra", f"{self._where(where)}: id {sid!r} is not a "
                                       "stored result of this export")
                continue
            expected = self._normalize(self.builder.build(row))
            if isinstance(expected, LeftOut):
                self.findings.mismatch("not-left-out", f"{self._where(where)}: id {sid!r} "
                                       f"should be left out ({expected.reason}: "
                                       f"{expected.detail})")
                continue
            diff = describe_diff(expected, record)
            if diff is not None:
                self.findings.mismatch("differs", f"{self._where(where)}: id {sid!r}: {diff}")
        pending.clear()

    def _normalize(self, built: dict[str, Any] | LeftOut) -> dict[str, Any] | LeftOut:
        # JSONL records are compared as JSON values, the way they were written.
        if isinstance(built, LeftOut) or self.fmt == "parquet":
            return built
        return dict(json.loads(json.dumps(built, ensure_ascii=False)))

    # -- SQL, result by result -----------------------------------------------------------

    def _check_sql(self) -> tuple[int, Counter[str]]:
        results, left_out = 0, Counter[str]()
        self.progress.label(f"{self.name} SQL")
        for row in iter_rows(self.store, self.name, self.upto, self.builder.answers):
            results += 1
            self.progress.advance()
            if row.sample_id in self.seen:
                continue
            built = self.builder.build(row)
            if isinstance(built, LeftOut):
                left_out[built.reason] += 1
            else:
                self.findings.mismatch("missing", f"{self.path.name}: stored result "
                                       f"{row.sample_id!r} is not in the file")
        return results, left_out

    def _check_counts(self, results: int, left_out: Counter[str]) -> None:
        claimed = {k: int(v) for k, v in dict(self.entry.get("left_out", {})).items()}
        if dict(left_out) != claimed:
            self.findings.mismatch("counts", f"{self.name}: SQL has left-out samples "
                                   f"{dict(sorted(left_out.items()))}, the manifest says "
                                   f"{dict(sorted(claimed.items()))}")
        if self.entry.get("exported") != len(self.seen):
            self.findings.mismatch("counts", f"{self.name}: the manifest says "
                                   f"{self.entry.get('exported')} exported, the file holds "
                                   f"{len(self.seen)} distinct ids")
        if self.entry.get("results") != results:
            self.findings.mismatch("counts", f"{self.name}: the manifest says "
                                   f"{self.entry.get('results')} results, SQL has {results}")


def _selected(doc: dict[str, Any], names: list[str] | None) -> Iterator[str]:
    known = list(doc["datasets"])
    for name in dict.fromkeys(names or known):
        if name not in doc["datasets"]:
            raise UnknownDatasetError(name, known)
        yield name


def report_lines(fmt: str, checked: list[str], findings: Findings) -> list[str]:
    lines = [f"  {line}" for line in checked]
    own_rules = {"specforge": "SpecForge's checker rules", "speculators": "loss masks",
                 "parquet": "the parquet schema"}[fmt]
    lines.append(f"checked: readable records, {own_rules}, no duplicate ids, every record "
                 "equal to what SQL gives (ids, masks, text), every stored result exported or "
                 "left out as the manifest counts")
    lines += [f"note: {note}" for note in findings.notes]
    if findings.total == 0:
        return [*lines, "validation passed: no mismatches"]
    kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(findings.counts.items()))
    lines.append(f"validation FAILED: {findings.total} mismatches ({kinds})")
    lines += [f"  {line}" for line in findings.shown]
    if findings.total > MAX_SHOWN:
        lines.append(f"  ... and {findings.total - MAX_SHOWN} more")
    return lines


def run_validate(args: argparse.Namespace, settings: Settings) -> int:
    directory = Path(args.dir)
    doc = load_manifest(directory)
    fmt = doc["format"]
    names = list(_selected(doc, args.datasets))
    store = Store(settings.database_url, settings.db_connections)
    print(f"validating {directory} ({fmt}, {len(names)} datasets) against "
          f"{safe_url(settings.database_url)}")
    if doc.get("database_url") != safe_url(settings.database_url):
        print(f"note: the export was made from {doc.get('database_url')}")
    findings = Findings()
    export = export_facts(store, directory, doc, settings.trust_remote_code)
    if "shared_lines" in doc and doc["shared_lines"] != len(export.shared):
        findings.mismatch("counts", f"the manifest says {doc['shared_lines']} lines are held "
                          f"by several datasets, SQL has {len(export.shared)}")
    progress = ProgressBar("validate", "rows", 0, quiet=args.quiet,
                           every_s=settings.progress_every_s)
    checks = [DatasetCheck(store, export, name, doc["datasets"][name], findings, progress)
              for name in names]
    for check in checks:
        progress.grow(check.work())
    with progress:
        checked = [check.run() for check in checks]
    results = sum(check.results for check in checks)
    if results and not any(check.seen for check in checks):
        findings.mismatch("empty", f"the export holds no row of {results:,} stored results")
    print("\n".join(report_lines(fmt, checked, findings)))
    return 1 if findings.total else 0
