"""Writing and reading export files, one record at a time.

Writers hold at most one parquet row group (``BATCH_ROWS`` rows) in memory; JSONL is
written line by line. Each file is written under a temporary name and moved into place
only when complete, so an interrupted export never leaves a truncated file under the
real name.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ops.export_rows import BATCH_ROWS

# JSON, under a name that is not *.json: speculators' `--data FOLDER` loads every *.json
# and *.jsonl file in the folder as data, and would fail on it.
MANIFEST = "manifest.datagen"
# Its name before 0.3.0: removed by an export into the folder, read by validate.
LEGACY_MANIFEST = "manifest.json"

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq


@functools.cache
def parquet_schema() -> pa.Schema:
    """The export's parquet schema. pyarrow (with numpy, about 40 MB resident) is imported
    here and not at module level: every ``datagen`` command, workers included, builds the
    export's argument parser, and only parquet files need it."""
    import pyarrow as pa

    ids = pa.list_(pa.int32())
    return pa.schema([
        pa.field("id", pa.int64(), nullable=False),
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("rid", pa.string(), nullable=False),
        pa.field("prompt_tokens", pa.int32(), nullable=False),
        pa.field("completion_tokens", pa.int32(), nullable=False),
        pa.field("cached_tokens", pa.int32(), nullable=False),
        pa.field("reasoning_tokens", pa.int32(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("finish_detail", pa.string()),  # JSON text
        pa.field("output_ids", ids, nullable=False),
        pa.field("output_text", pa.string(), nullable=False),
        pa.field("e2e_latency_s", pa.float64()),
        pa.field("sampling", pa.string()),  # JSON text; null for a result stored before
        pa.field("server", pa.string(), nullable=False),
        pa.field("model", pa.string(), nullable=False),
        pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("kept", pa.bool_()),  # null on rows stored before the column
        pa.field("input_ids", ids),  # joined from prompt_inputs; null if the row is gone
    ])


def _temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


class Sink:
    """Append records to ``path``; ``commit`` moves the finished file into place."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.temp = _temp_path(path)
        self.written = 0

    def write(self, record: dict[str, Any]) -> None:
        self._write(record)
        self.written += 1

    def _write(self, record: dict[str, Any]) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError

    def commit(self) -> None:
        self._close()
        os.replace(self.temp, self.path)

    def __enter__(self) -> Sink:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is not None:
            self._close()
            self.temp.unlink(missing_ok=True)


class JsonlSink(Sink):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._fh = self.temp.open("w", encoding="utf-8")

    def _write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")

    def _close(self) -> None:
        self._fh.close()


class ParquetSink(Sink):
    """Rows buffered into row groups of ``BATCH_ROWS``; an empty file still has the schema."""

    def __init__(self, path: Path) -> None:
        import pyarrow.parquet as pq

        super().__init__(path)
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(self.temp, parquet_schema())
        self._rows: list[dict[str, Any]] = []

    def _write(self, record: dict[str, Any]) -> None:
        self._rows.append(record)
        if len(self._rows) >= BATCH_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._rows and self._writer is not None:
            import pyarrow as pa

            batch = pa.RecordBatch.from_pylist(self._rows, schema=parquet_schema())
            self._writer.write_batch(batch, row_group_size=BATCH_ROWS)
            self._rows.clear()

    def _close(self) -> None:
        if self._writer is not None:
            self._flush()
            self._writer.close()
            self._writer = None


def open_sink(fmt: str, path: Path) -> Sink:
    return ParquetSink(path) if fmt == "parquet" else JsonlSink(path)


def read_jsonl(path: Path) -> Iterator[tuple[str, dict[str, Any] | str]]:
    """(where, record) per non-blank line; ``record`` is the error text of a bad line."""
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"line {lineno}"
            try:
                obj = json.loads(line)
            except ValueError as exc:
                yield where, f"invalid JSON: {exc}"
                continue
            yield where, obj if isinstance(obj, dict) else "expected a JSON object"


def read_parquet(path: Path) -> Iterator[tuple[str, dict[str, Any] | str]]:
    """(where, row) per row, a row group at a time; a wrong schema is one error."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        yield "file", f"not a readable parquet file: {exc}"
        return
    with parquet:
        if not parquet.schema_arrow.equals(parquet_schema()):
            yield "file", f"schema differs from datagen's: {parquet.schema_arrow}"
            return
        n = 0
        for batch in parquet.iter_batches(batch_size=BATCH_ROWS):
            for row in batch.to_pylist():
                n += 1
                yield f"row {n}", row


def read_records(fmt: str, path: Path) -> Iterator[tuple[str, dict[str, Any] | str]]:
    return read_parquet(path) if fmt == "parquet" else read_jsonl(path)
