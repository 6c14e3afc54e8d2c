"""The dataset card ``datagen export`` writes (README.md): its counts equal SQL's, counted
here with queries of its own, on SQLite and PostgreSQL; its front matter names every data
file and nothing else; and a README.md that is not a card is never overwritten."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml

from common.errors import ConfigError
from common.schema import datasets, prompts, results
from ops.export_card import CARD_COUNTS
from tests.conftest import _fresh_postgres
from tests.synth_export import RUN, export, write_run


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def run_db(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[str]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'datagen.db'}"
    else:
        url = _fresh_postgres()
    write_run(url)
    yield url


def card_parts(folder: Path) -> tuple[dict[str, Any], str]:
    text = (folder / "README.md").read_text(encoding="utf-8")
    match = re.fullmatch(r"---\n(.*?)\n---\n(.*)", text, re.S)
    assert match, "the card does not open with YAML front matter"
    return yaml.safe_load(match.group(1)), match.group(2)


def counts_table(body: str) -> dict[str, dict[str, int]]:
    """The card's counts table: per dataset, per column, the number."""
    lines = [ln for ln in body.splitlines() if ln.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["dataset", *CARD_COUNTS]
    table = {}
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0].startswith("`") and len(cells) == len(head):
            table[cells[0].strip("`")] = {h: int(c.replace(",", ""))
                                          for h, c in zip(head[1:], cells[1:], strict=True)}
    return table


def sql_counts(url: str) -> dict[str, dict[str, int]]:
    """The same figures straight from the tables."""
    engine = sa.create_engine(url)
    out: dict[str, dict[str, int]] = {}
    with engine.connect() as conn:
        for name in conn.scalars(sa.select(datasets.c.name)):
            def count(table: sa.Table, *where: Any, name: str = name) -> int:
                return int(conn.scalar(sa.select(sa.func.count()).select_from(table)
                                       .where(table.c.dataset == name, *where)) or 0)

            out[name] = {
                "prompts": count(prompts),
                "kept": count(results),
                "failed": count(prompts, prompts.c.state == "failed"),
                "skipped": count(prompts, prompts.c.state == "skipped"),
                "not generated": count(prompts, prompts.c.state == "queued"),
                "cut at max_new_tokens": count(results, results.c.finish_reason == "length"),
                "cut at budget": count(results, results.c.finish_reason == "budget"),
            }
    engine.dispose()
    return out


def file_rows(path: Path) -> int:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(path).metadata.num_rows)
    return sum(1 for line in path.open(encoding="utf-8") if line.strip())


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_the_cards_counts_equal_sql(run_db: str, tmp_path: Path, fmt: str) -> None:
    assert export(run_db, fmt, tmp_path) == 0
    _, body = card_parts(tmp_path)
    card, sql = counts_table(body), sql_counts(run_db)
    assert set(card) == set(RUN) == set(sql)
    manifest = json.loads((tmp_path / "manifest.datagen").read_text())
    for name, figures in card.items():
        rows = file_rows(tmp_path / manifest["datasets"][name]["file"])
        assert figures == {**sql[name], "rows exported": rows,
                           "left out of the export": sql[name]["kept"] - rows}, name
    # The run has something in every column, so a column stuck at zero would show.
    assert all(sum(card[n][col] for n in card) for col in CARD_COUNTS
               if col != "left out of the export")
    if fmt == "specforge":  # R1's unclosed reasoning is left out, and said why
        assert card["R1"]["left out of the export"] > 0
        assert "results left out of the file, cut_while_reasoning" in body


def test_the_front_matter_names_each_data_file_and_a_default(run_db: str, tmp_path: Path
                                                             ) -> None:
    assert export(run_db, "parquet", tmp_path) == 0
    meta, _ = card_parts(tmp_path)
    assert "license" not in meta  # the publisher's to choose
    assert meta["task_categories"] == ["text-generation"]
    assert meta["size_categories"] == ["n<1K"]
    by_name = {c["config_name"]: c for c in meta["configs"]}
    filled = ["P3", "R1", "T2"]  # E4 has no row: no config for an empty file
    assert list(by_name) == ["all", *filled]
    assert by_name["all"]["default"] is True
    assert by_name["all"]["data_files"] == [
        {"split": "train", "path": [f"{n}.parquet" for n in filled]}]
    for name in filled:
        assert by_name[name]["data_files"] == [{"split": "train", "path": [f"{name}.parquet"]}]
        assert "default" not in by_name[name]
    named = {p for c in meta["configs"] for f in c["data_files"] for p in f["path"]}
    assert "manifest.datagen" not in named and all((tmp_path / p).is_file() for p in named)


def test_files_with_different_columns_get_no_combined_default(run_db: str, tmp_path: Path
                                                              ) -> None:
    # T2's rows carry "tools", the others' do not: one table cannot hold them all.
    assert export(run_db, "specforge", tmp_path) == 0
    meta, body = card_parts(tmp_path)
    assert [c["config_name"] for c in meta["configs"]] == ["P3", "R1", "T2"]
    assert not any(c.get("default") for c in meta["configs"])
    assert "a config must be named" in body
    assert export(run_db, "specforge", tmp_path / "one", "P3") == 0
    meta, _ = card_parts(tmp_path / "one")
    assert meta["configs"] == [{"config_name": "P3", "default": True, "data_files": [
        {"split": "train", "path": ["P3.specforge.jsonl"]}]}]


def test_the_body_says_how_each_dataset_was_made(run_db: str, tmp_path: Path) -> None:
    assert export(run_db, "speculators", tmp_path) == 0
    _, body = card_parts(tmp_path)
    engine = sa.create_engine(run_db)
    with engine.connect() as conn:
        r1 = conn.execute(sa.select(datasets).where(datasets.c.name == "R1")).one()
        model = conn.scalar(sa.select(results.c.model).limit(1))
    engine.dispose()
    section = body.split("### R1", 1)[1].split("###", 1)[0]
    assert f"`{model}`" in section and f"`{r1.template_hash}`" in section
    assert f"`{r1.tokenizer}`" in section
    assert all(f"{k} {v}" in section for k, v in r1.sampling.items())
    assert f"{r1.budget_tokens:,} output tokens (basis `output`), policy `exact`" in section
    assert f"closed ({r1.close_reason})" in section and f"{r1.used_at_close:,} tokens" in section
    left = body.split("## What was left out, and why", 1)[1]
    assert "`E4`: 12 prompts failed" in left
    assert "not generated: the budget closed the dataset first" in left


def test_a_readme_that_is_not_a_card_is_never_overwritten(run_db: str, tmp_path: Path) -> None:
    mine = tmp_path / "README.md"
    mine.write_text("# my notes\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"README\.md that datagen export did not write"):
        export(run_db, "specforge", tmp_path)
    assert mine.read_text(encoding="utf-8") == "# my notes\n"
    assert not (tmp_path / "manifest.datagen").exists()
    mine.unlink()
    assert export(run_db, "specforge", tmp_path) == 0
    assert export(run_db, "parquet", tmp_path) == 0  # its own card is replaced
    meta, _ = card_parts(tmp_path)
    assert meta["configs"][0]["data_files"][0]["path"][0].endswith(".parquet")
