"""``datasets.load_dataset`` reads every export format from the export folder as it is,
by the card's configs: each dataset with its row count and its format's columns, and the
default config all of them where their files share their columns.

``datasets`` is a test-only extra (``test-hf``), which ``make install`` installs; nothing
is installed here at run time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ops.export_io import parquet_schema, read_records
from tests.synth_export import export, write_run

hf = pytest.importorskip(
    "datasets", reason="the datasets package is not installed (make install adds the test-hf "
                       "extra: pip install -e '.[dev,test-hf]')")

SPECFORGE = {"id", "status", "conversations", "sampling"}
SPECULATORS = {"id", "primary_id", "input_ids", "loss_mask", "text", "metadata"}


@pytest.fixture(scope="module")
def run_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'datagen.db'}"
    write_run(url)
    yield url


def expected_columns(fmt: str, dataset: str) -> set[str]:
    if fmt == "specforge":
        return SPECFORGE | ({"tools"} if dataset == "T2" else set())
    if fmt == "speculators":
        return SPECULATORS
    return set(parquet_schema().names)


def first_record(fmt: str, path: Path) -> dict[str, Any]:
    _, record = next(read_records(fmt, path))
    assert isinstance(record, dict)
    return record


def load(folder: Path, cache: Path, config: str | None = None) -> Any:
    return hf.load_dataset(str(folder), config, split="train", cache_dir=str(cache))


@pytest.mark.parametrize("fmt", ["specforge", "speculators", "parquet"])
def test_load_dataset_reads_each_dataset_of_an_export(run_db: str, tmp_path: Path, fmt: str
                                                      ) -> None:
    out, cache = tmp_path / "export", tmp_path / "cache"
    assert export(run_db, fmt, out) == 0
    manifest = json.loads((out / "manifest.datagen").read_text())
    filled = {name: entry for name, entry in manifest["datasets"].items() if entry["exported"]}
    assert set(filled) == {"P3", "R1", "T2"}  # E4 has no row, so no config
    for name, entry in filled.items():
        ds = load(out, cache, name)
        assert ds.num_rows == entry["exported"], name
        assert set(ds.column_names) == expected_columns(fmt, name), name
        first = first_record(fmt, out / entry["file"])
        row = ds[0]
        assert row["id"] == first["id"]
        key = "conversations" if fmt == "specforge" else "input_ids"
        if fmt == "parquet":
            key = "output_ids"
        assert row[key] == first[key]


@pytest.mark.parametrize("fmt", ["speculators", "parquet"])
def test_the_default_config_is_every_dataset_where_the_columns_agree(
    run_db: str, tmp_path: Path, fmt: str
) -> None:
    out = tmp_path / "export"
    assert export(run_db, fmt, out) == 0
    manifest = json.loads((out / "manifest.datagen").read_text())
    ds = load(out, tmp_path / "cache")
    assert ds.num_rows == manifest["totals"]["exported"]
    assert set(ds.column_names) == expected_columns(fmt, "P3")
    assert sorted(ds["id"]) == sorted(
        r["id"] for e in manifest["datasets"].values() if e["exported"]
        for _, r in read_records(fmt, out / e["file"]) if isinstance(r, dict))


def test_specforge_files_whose_columns_differ_are_loaded_one_by_one(run_db: str,
                                                                    tmp_path: Path) -> None:
    out = tmp_path / "export"
    assert export(run_db, "specforge", out) == 0
    with pytest.raises(ValueError, match="Config name is missing"):
        load(out, tmp_path / "cache")
    assert export(run_db, "specforge", tmp_path / "one", "T2") == 0
    ds = load(tmp_path / "one", tmp_path / "cache")  # one dataset: its config is the default
    assert set(ds.column_names) == SPECFORGE | {"tools"}
    with_tools = [t for t in ds["tools"] if t]
    assert with_tools and all(t[0]["function"]["name"] == "lookup" for t in with_tools)


def test_every_json_file_of_a_speculators_export_is_data(run_db: str, tmp_path: Path) -> None:
    # speculators' prepare_data.py --data FOLDER loads every *.json and *.jsonl under the
    # folder with load_dataset("json"): the manifest must not be one of them.
    out = tmp_path / "export"
    assert export(run_db, "speculators", out) == 0
    manifest = json.loads((out / "manifest.datagen").read_text())
    files = sorted(str(p) for p in out.rglob("*") if p.suffix in (".json", ".jsonl"))
    named = {str(out / e["file"]) for e in manifest["datasets"].values()}
    assert set(files) == named
    ds = hf.load_dataset("json", data_files=files, split="train",
                         cache_dir=str(tmp_path / "cache"))
    assert ds.num_rows == manifest["totals"]["exported"] > 0
    assert set(ds.column_names) == SPECULATORS
