"""``datagen export`` and ``datagen validate`` on results a real worker produced against the
simulator, stored in SQLite and PostgreSQL; then the export files tampered with."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
import requests
import sqlalchemy as sa

from common.budget import Budget
from common.errors import ConfigError, UnknownDatasetError
from common.schema import results
from common.settings import Settings
from common.store import DatasetRow, Store
from ops import export_rows
from ops.export import DatasetExport, add_export_parser, run_export, write_rows
from ops.export_io import ParquetSink, Sink, parquet_schema
from ops.export_rows import BATCH_ROWS, ExportRow
from ops.export_specforge import SpecForgeBuilder
from ops.export_speculators import SpeculatorsBuilder
from ops.specforge_check import row_error
from ops.validate import add_validate_parser, run_validate
from tests.conftest import REDIS_URL, _fresh_postgres, make_settings
from tests.helpers import enqueue_paths, running_worker, wait_settled, write_dataset

# Prompts whose turns SpecForge's checker rejects: the export must leave them out.
BAD_PROMPTS = {
    "alpha-tool": [{"role": "user", "content": "Look it up."},
                   {"role": "assistant", "content": "Calling the tool."},
                   {"role": "tool", "content": "42"},
                   {"role": "user", "content": "So?"}],
    "alpha-twice": [{"role": "user", "content": "First."}, {"role": "user", "content": "Second."}],
}


@dataclass(frozen=True)
class Produced:
    settings: Settings
    store: Store


def _write_prompts(folder: Path) -> tuple[Path, Path]:
    alpha, cut = folder / "alpha.jsonl", folder / "cut.jsonl"
    with alpha.open("w") as fh:
        for i in range(10):
            msgs = [{"role": "user", "content": f"alpha question {i}: explain item {i}."}]
            if i % 2:
                msgs.insert(0, {"role": "system", "content": "Be brief."})
            fh.write(json.dumps({"id": f"alpha-{i}", "messages": msgs}) + "\n")
        for sid, msgs in BAD_PROMPTS.items():
            fh.write(json.dumps({"id": sid, "messages": msgs}) + "\n")
    with cut.open("w") as fh:
        for i in range(5):
            msgs = [{"role": "user", "content": f"cut question {i}"}]
            fh.write(json.dumps({"id": f"cut-{i}", "messages": msgs}) + "\n")
    return alpha, cut


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def produced(
    request: pytest.FixtureRequest, sim_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Produced]:
    """12 alpha prompts run to completion and 5 cut prompts capped at 8 new tokens, once
    per database: the tests only read them."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'datagen.db'}"
    else:
        url = _fresh_postgres()
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    requests.post(f"{sim_server}/sim/reset", timeout=5).raise_for_status()
    settings = make_settings(url, sim_server)
    alpha, cut = _write_prompts(tmp_path_factory.mktemp("prompts"))
    enqueue_paths(settings, [str(alpha)])
    enqueue_paths(settings, [str(cut)], max_new_tokens=8)
    store = Store(url)
    with running_worker(settings):
        wait_settled(store, ["alpha", "cut"])
    client.flushdb()
    client.close()
    yield Produced(settings, store)
    store.engine.dispose()


def _args(command: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    add_export_parser(sub)
    add_validate_parser(sub)
    return parser.parse_args([command, *argv])


def export(p: Produced, fmt: str, out: Path, *names: str, allow_empty: bool = False) -> int:
    extra = ["--dataset", *names] if names else []
    extra += ["--allow-empty"] if allow_empty else []
    return run_export(_args("export", "--format", fmt, "--out", str(out), *extra), p.settings)


def validate(p: Produced, out: Path) -> int:
    return run_validate(_args("validate", str(out)), p.settings)


def stored(store: Store, dataset: str) -> dict[str, dict[str, Any]]:
    """Results straight from SQL, with their prompts, independently of the exporter."""
    out = {}
    with store.engine.connect() as conn:
        for r in conn.execute(sa.select(results).where(results.c.dataset == dataset)):
            prompt = store.prompt(dataset, r.sample_id)
            assert prompt is not None
            out[r.sample_id] = {**r._asdict(), "input_ids": prompt.input_ids}
    return out


def expected_specforge_reason(sample_id: str, text: str) -> str | None:
    if "</think>" not in text:
        return "cut_while_reasoning"
    if not text.partition("</think>")[2].strip():
        return "empty_answer"
    return "prompt_breaks_checker" if sample_id in BAD_PROMPTS else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def manifest_of(out: Path) -> dict[str, Any]:
    return dict(json.loads((out / "manifest.datagen").read_text()))


# -- each format exports and validates --------------------------------------------------


def test_specforge_export_leaves_out_cut_samples_and_validates(
    produced: Produced, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every cut sample is left out, so cut's file is empty: asked for here.
    assert export(produced, "specforge", tmp_path, allow_empty=True) == 0
    doc = manifest_of(tmp_path)
    assert doc["format"] == "specforge" and set(doc["datasets"]) == {"alpha", "cut"}
    cut = stored(produced.store, "cut")
    assert len(cut) == 5 and all("</think>" not in r["output_text"] for r in cut.values())
    assert doc["datasets"]["cut"]["exported"] == 0
    assert doc["datasets"]["cut"]["left_out"] == {"cut_while_reasoning": 5}
    assert read_jsonl(tmp_path / "cut.specforge.jsonl") == []
    alpha = stored(produced.store, "alpha")
    reasons = {sid: expected_specforge_reason(sid, r["output_text"]) for sid, r in alpha.items()}
    kept = {sid for sid, reason in reasons.items() if reason is None}
    assert doc["datasets"]["alpha"]["left_out"]["prompt_breaks_checker"] == 2
    assert doc["datasets"]["alpha"]["exported"] == len(kept) >= 8
    rows = read_jsonl(tmp_path / "alpha.specforge.jsonl")
    assert {r["id"] for r in rows} == kept
    for row in rows:
        assert row_error(row, expect_reasoning=True) is None
        reasoning, _, answer = alpha[row["id"]]["output_text"].partition("</think>")
        assert row["conversations"][-1] == {"role": "assistant", "content": answer.strip(),
                                            "reasoning_content": reasoning.strip()}
    out = capsys.readouterr().out
    assert "cut: 0 exported, 5 left out" in out and "5 cut_while_reasoning" in out
    assert validate(produced, tmp_path) == 0
    assert "validation passed" in capsys.readouterr().out


def test_speculators_ids_masks_and_metadata(produced: Produced, tmp_path: Path) -> None:
    assert export(produced, "speculators", tmp_path) == 0
    sql = stored(produced.store, "alpha")
    rows = read_jsonl(tmp_path / "alpha.speculators.jsonl")
    assert len(rows) == len(sql) == 12
    for row in rows:
        r = sql[row["id"]]
        assert row["input_ids"] == r["input_ids"] + r["output_ids"]
        assert row["loss_mask"] == [0] * len(r["input_ids"]) + [1] * len(r["output_ids"])
        assert row["text"].startswith("<|im_start|>") and row["text"].endswith(r["output_text"])
        assert row["primary_id"] == row["id"]  # a line of one turn, one generation
        assert row["metadata"] == {
            "finish_reason": r["finish_reason"],
            "usage": {"prompt_tokens": r["prompt_tokens"],
                      "completion_tokens": r["completion_tokens"],
                      "total_tokens": r["prompt_tokens"] + r["completion_tokens"]},
            "model": r["model"],
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 512},
            "dataset": "alpha", "sample_id": row["id"],
        }
    cut = read_jsonl(tmp_path / "cut.speculators.jsonl")
    assert len(cut) == 5
    assert all(r["metadata"]["sampling_params"]["max_new_tokens"] == 8 for r in cut)
    assert validate(produced, tmp_path) == 0


def test_an_export_made_before_the_manifest_was_renamed_still_validates(
    produced: Produced, tmp_path: Path
) -> None:
    assert export(produced, "speculators", tmp_path) == 0
    (tmp_path / "manifest.datagen").rename(tmp_path / "manifest.json")  # 0.2.0's name
    assert validate(produced, tmp_path) == 0
    # An export into that folder leaves one manifest, under today's name.
    assert export(produced, "speculators", tmp_path) == 0
    assert not (tmp_path / "manifest.json").exists()
    assert manifest_of(tmp_path)["format"] == "speculators"


def test_parquet_has_every_column_typed(produced: Produced, tmp_path: Path) -> None:
    assert export(produced, "parquet", tmp_path) == 0
    table = pq.read_table(tmp_path / "alpha.parquet")
    assert table.schema.field("output_ids").type == pa.list_(pa.int32())
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())
    assert table.schema.field("created_at").type == pa.timestamp("us", tz="UTC")
    assert set(table.column_names) == {c.name for c in results.columns} | {"input_ids"}
    sql = stored(produced.store, "alpha")
    for row in table.to_pylist():
        r = sql[row["sample_id"]]
        assert (row["output_ids"], row["input_ids"]) == (r["output_ids"], r["input_ids"])
        assert row["id"] == r["id"] and row["output_text"] == r["output_text"]
    assert manifest_of(tmp_path)["totals"] == {"results": 17, "exported": 17, "left_out": 0}
    assert validate(produced, tmp_path) == 0


def test_named_dataset_only_and_unknown_name(produced: Produced, tmp_path: Path) -> None:
    assert export(produced, "speculators", tmp_path, "cut") == 0
    assert list(manifest_of(tmp_path)["datasets"]) == ["cut"]
    assert not (tmp_path / "alpha.speculators.jsonl").exists()
    with pytest.raises(UnknownDatasetError) as err:
        export(produced, "speculators", tmp_path / "x", "cut", "unknown")
    assert err.value.known == ["alpha", "cut"]
    with pytest.raises(UnknownDatasetError):
        run_validate(_args("validate", str(tmp_path), "--dataset", "alpha"), produced.settings)


def test_results_stored_after_the_export_are_noted_not_flagged(
    produced: Produced, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert export(produced, "parquet", tmp_path, "cut") == 0
    bound = manifest_of(tmp_path)["datasets"]["cut"]["upto_result_id"]
    late = {"id": bound + 10_000, "dataset": "cut", "sample_id": "cut-late", "rid": "r",
            "prompt_tokens": 1, "completion_tokens": 1, "finish_reason": "stop",
            "output_ids": [5], "output_text": "x", "server": "s", "model": "m"}
    with produced.store.engine.begin() as conn:
        conn.execute(results.insert().values(**late))
    try:
        assert validate(produced, tmp_path) == 0
        assert "results stored after the export" in capsys.readouterr().out
    finally:
        with produced.store.engine.begin() as conn:
            conn.execute(results.delete().where(results.c.sample_id == "cut-late"))


def test_an_export_with_no_row_of_its_results_fails_unless_allowed(
    produced: Produced, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert export(produced, "specforge", tmp_path / "a", "cut") == 1
    captured = capsys.readouterr()
    assert "cut: 0 exported, 5 left out" in captured.out  # written and summed up all the same
    assert "cut: 0 of 5 results exported (5 cut_while_reasoning)" in captured.err
    assert "--allow-empty" in captured.err
    assert manifest_of(tmp_path / "a")["allow_empty"] is False
    assert validate(produced, tmp_path / "a") == 1
    out = capsys.readouterr().out
    assert "validation FAILED" in out and "[empty]" in out
    assert "cut.specforge.jsonl holds no row of 5 stored results (5 cut_while_reasoning)" in out
    assert "the export holds no row of 5 stored results" in out
    # Asked for: the export exits 0, but an export with no row at all still fails validation.
    assert export(produced, "specforge", tmp_path / "b", "cut", allow_empty=True) == 0
    assert manifest_of(tmp_path / "b")["allow_empty"] is True
    capsys.readouterr()
    assert validate(produced, tmp_path / "b") == 1
    out = capsys.readouterr().out
    assert "the export holds no row of 5 stored results" in out
    assert "holds no row of 5 stored results (" not in out  # the one empty file is allowed
    # Another format keeps every cut sample: not empty, nothing to allow.
    assert export(produced, "speculators", tmp_path / "c", "cut") == 0


def test_an_empty_file_of_one_dataset_fails_validation_unless_allowed(
    produced: Produced, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert export(produced, "specforge", tmp_path) == 1  # alpha has rows, cut has none
    capsys.readouterr()
    assert validate(produced, tmp_path) == 1
    out = capsys.readouterr().out
    assert "cut.specforge.jsonl holds no row" in out and "alpha.specforge.jsonl" not in out
    assert "the export holds no row" not in out  # alpha's rows are there


def test_simulator_without_a_tokenizer_gives_a_reasoning_export_rows(
    sqlite_url: str, redis_client: redis.Redis, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`datagen sim` as the README starts it (no --tokenizer), prompts templated with the
    bundled tokenizer, which opens a reasoning block: each output closes it."""
    from sim import SimConfig, SimServer

    server = SimServer(SimConfig(port=0, decode_tok_per_s=0, mean_output_tokens=40))
    settings = make_settings(sqlite_url, server.start())
    try:
        enqueue_paths(settings, [str(write_dataset(tmp_path, "plain", 8))])
        assert Store(sqlite_url).dataset("plain").reasoning_open == "<think>"
        with running_worker(settings, concurrency=4):
            wait_settled(Store(sqlite_url), ["plain"])
    finally:
        server.stop()
    p = Produced(settings, Store(sqlite_url))
    assert export(p, "specforge", tmp_path / "out") == 0
    doc = manifest_of(tmp_path / "out")["datasets"]["plain"]
    rows = read_jsonl(tmp_path / "out" / "plain.specforge.jsonl")
    assert doc["results"] == 8 and doc["exported"] == len(rows) > 0
    for row in rows:
        answer = row["conversations"][-1]
        assert answer["reasoning_content"] and answer["content"]
        assert "</think>" not in answer["reasoning_content"] + answer["content"]
    assert validate(p, tmp_path / "out") == 0
    assert "validation passed" in capsys.readouterr().out


# -- tampering ---------------------------------------------------------------------------


def _rewrite(path: Path, edit: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]) -> None:
    rows = edit(read_jsonl(path))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _bump_input_id(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows[1]["input_ids"][3] += 1
    return rows


def _flip_mask(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows[2]["loss_mask"][0] = 1
    return rows


def _empty_content(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows[0]["conversations"][-1]["content"] = ""
    return rows


def _bump_parquet_output(path: Path) -> None:
    rows = pq.read_table(path).to_pylist()
    rows[0]["output_ids"][0] += 1
    pq.write_table(pa.Table.from_pylist(rows, schema=parquet_schema()), path)


TAMPERS: dict[str, tuple[str, Callable[[Path], None], list[str]]] = {
    "change one input id": ("speculators", lambda p: _rewrite(p, _bump_input_id),
                            ["[differs]", "input_ids differs at [3]"]),
    "flip a mask bit": ("speculators", lambda p: _rewrite(p, _flip_mask),
                        ["[loss-mask]", "loss_mask differs at [0]"]),
    "drop a line": ("specforge", lambda p: _rewrite(p, lambda rows: rows[1:]),
                    ["[missing]", "is not in the file", "[counts]"]),
    "duplicate a line": ("specforge", lambda p: _rewrite(p, lambda rows: [*rows, rows[0]]),
                         ["[duplicate-id]", "appears more than once"]),
    "empty a content": ("specforge", lambda p: _rewrite(p, _empty_content),
                        ["[specforge-checker]", "content must be a non-empty string"]),
    "change one output id": ("parquet", _bump_parquet_output,
                             ["[differs]", "output_ids differs at [0]"]),
}


@pytest.mark.parametrize("tamper", list(TAMPERS))
def test_tampered_export_fails_validation(
    produced: Produced, tmp_path: Path, capsys: pytest.CaptureFixture[str], tamper: str
) -> None:
    fmt, edit, expected = TAMPERS[tamper]
    assert export(produced, fmt, tmp_path, allow_empty=True) == 0  # specforge: cut is empty
    assert validate(produced, tmp_path) == 0
    capsys.readouterr()
    ext = "parquet" if fmt == "parquet" else f"{fmt}.jsonl"
    edit(tmp_path / f"alpha.{ext}")
    assert validate(produced, tmp_path) == 1
    out = capsys.readouterr().out
    assert "validation FAILED" in out
    for words in expected:
        assert words in out, out


# -- errors and edge cases on one SQLite database ----------------------------------------


def _settings(sqlite_url: str) -> Settings:
    return Settings(database_url=sqlite_url)


def test_empty_database_and_dataset_without_results(
    sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = _settings(sqlite_url)
    args = _args("export", "--format", "specforge", "--out", str(tmp_path / "a"))
    assert run_export(args, settings) == 0
    assert "nothing to export" in capsys.readouterr().out
    assert manifest_of(tmp_path / "a")["datasets"] == {}
    Store(sqlite_url).upsert_dataset(DatasetRow("fresh", Budget(), {}, 4096, "/nowhere", "h"))
    args = _args("export", "--format", "speculators", "--out", str(tmp_path / "b"))
    assert run_export(args, settings) == 0
    assert "fresh: 0 exported, 0 left out (no results stored yet)" in capsys.readouterr().out
    assert (tmp_path / "b" / "fresh.speculators.jsonl").read_text() == ""
    assert run_validate(_args("validate", str(tmp_path / "b")), settings) == 0


def test_out_is_a_file_and_missing_manifest(sqlite_url: str, tmp_path: Path) -> None:
    settings = _settings(sqlite_url)
    target = tmp_path / "taken"
    target.write_text("not a directory")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        run_export(_args("export", "--format", "parquet", "--out", str(target)), settings)
    with pytest.raises(ConfigError, match=r"manifest\.datagen not found"):
        run_validate(_args("validate", str(tmp_path)), settings)


def test_a_specforge_turn_row_names_the_turn_it_was_made_from() -> None:
    # Under --turns all a conversation's turn k is stored as <id>#turn<k> (from 1), while a
    # line of a single turn keeps its own id: its row (#turn0) maps back to that id.
    ds = DatasetRow("d", Budget(), {"temperature": 0.6}, 4096, "/no/such/tokenizer", "h",
                    turns="all")
    builder = SpecForgeBuilder(ds, latest={"chat": 3}, rows="turn")
    assert builder.sample_id_of({"source_id": "chat", "assistant_turn_index": 0}) == "chat#turn1"
    assert builder.sample_id_of({"source_id": "chat", "assistant_turn_index": 2}) == "chat#turn3"
    assert builder.sample_id_of({"source_id": "solo", "assistant_turn_index": 0}) == "solo"
    assert builder.sample_id_of({"source_id": "chat", "assistant_turn_index": True}) is None
    whole = SpecForgeBuilder(ds, latest={"chat": 3})
    assert whole.sample_id_of({"id": "chat#turn3"}) == "chat#turn3"


def test_speculators_text_omitted_without_tokenizer_files() -> None:
    ds = DatasetRow("d", Budget(), {"temperature": 0.6}, 4096, "/no/such/tokenizer", "h")
    builder = SpeculatorsBuilder(ds)
    row = ExportRow(1, "d", "s1", "rid", 2, 1, 0, 0, "stop", None, [7], "x", None, "srv", "m",
                    datetime.now(UTC), [{"role": "user", "content": "q"}], [1, 2], 16)
    record = builder.build(row)
    assert isinstance(record, dict) and "text" not in record
    assert record["loss_mask"] == [0, 0, 1]
    assert builder.text_note.startswith("omitted")


# -- memory: bounded batches, row-by-row writes -----------------------------------------


def test_rows_stream_from_sql_with_a_bounded_batch(produced: Produced) -> None:
    seen: list[dict[str, Any]] = []

    def spy(conn: Any, clause: Any, multi: Any, params: Any, options: Any) -> None:
        if isinstance(clause, sa.Select):
            seen.append(dict(options))

    sa.event.listen(produced.store.engine, "before_execute", spy)
    try:
        rows = list(export_rows.iter_rows(produced.store, "alpha", 10**9))
    finally:
        sa.event.remove(produced.store.engine, "before_execute", spy)
    assert len(rows) == 12
    assert [o.get("yield_per") for o in seen] == [BATCH_ROWS]


class _RecordingSink(Sink):
    def __init__(self, pulled: Callable[[], int]) -> None:
        super().__init__(Path("/dev/null"))
        self.pulled = pulled
        self.lag: list[int] = []

    def _write(self, record: dict[str, Any]) -> None:
        self.lag.append(self.pulled() - self.written)  # rows read but not yet written

    def _close(self) -> None:
        pass


def test_writer_is_fed_row_by_row(produced: Produced) -> None:
    pulled = 0

    def source() -> Iterator[ExportRow]:
        nonlocal pulled
        for row in export_rows.iter_rows(produced.store, "cut", 10**9):
            pulled += 1
            yield row

    sink = _RecordingSink(lambda: pulled)
    stats = DatasetExport("cut", "cut.x", 5, 10**9, "<think>")
    write_rows(source(), SpeculatorsBuilder(produced.store.dataset("cut")), sink, stats)
    assert stats.exported == 5 and sink.lag == [1] * 5


def test_parquet_written_in_row_groups_of_a_batch(tmp_path: Path) -> None:
    path = tmp_path / "big.parquet"
    row: dict[str, Any] = {f.name: None for f in parquet_schema()}
    row |= {"id": 1, "dataset": "d", "sample_id": "s", "rid": "r", "prompt_tokens": 1,
            "completion_tokens": 1, "cached_tokens": 0, "reasoning_tokens": 0,
            "finish_reason": "stop", "output_ids": [1], "output_text": "x", "server": "s",
            "model": "m", "created_at": pa.scalar(0, pa.timestamp("us", tz="UTC")).as_py()}
    with ParquetSink(path) as sink:
        for i in range(2 * BATCH_ROWS + 500):
            sink.write({**row, "id": i, "sample_id": f"s{i}"})
        sink.commit()
    meta = pq.ParquetFile(path).metadata
    assert meta.num_rows == 2500
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [1000, 1000, 500]


# -- SpecForge's checker rules, as mirrored -----------------------------------------------


def _conv(*turns: tuple[str, str]) -> dict[str, Any]:
    msgs = [{"role": r, "content": c} for r, c in turns]
    return {"id": "x", "status": "success", "conversations": msgs}


_CALL = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]


def _calling(*turns: tuple[str, str]) -> dict[str, Any]:
    """A row whose first assistant message called a tool."""
    row = _conv(*turns)
    next(m for m in row["conversations"] if m["role"] == "assistant")["tool_calls"] = _CALL
    return row


@pytest.mark.parametrize(("row", "error"), [
    (_conv(("system", "s"), ("user", "u"), ("assistant", "a")), None),
    (_conv(("user", "u"), ("assistant", "a"), ("user", "u2"), ("assistant", "b")), None),
    (_conv(("user", "u"), ("system", "s"), ("assistant", "a")), "unsupported role 'system'"),
    (_conv(("user", "u"), ("tool", "t"), ("assistant", "a")), "expected role 'assistant'"),
    (_conv(("system", "s"), ("tool", "t"), ("user", "u")), "unsupported role 'tool'"),
    (_conv(("user", "u"), ("assistant", "a"), ("tool", "t")), "expected role 'user'"),
    # SpecForge's trainer reads tool turns: after an answer that called tools, as SQL has it.
    (_calling(("user", "u"), ("assistant", ""), ("tool", "t"), ("tool", "t2"),
              ("assistant", "a")), None),
    (_calling(("user", "u"), ("assistant", "a"), ("user", "u2"), ("assistant", "b")), None),
    (_calling(("user", "u"), ("assistant", ""), ("tool", " "), ("assistant", "a")),
     "message 2 content must be a non-empty string"),
    (_calling(("user", "u"), ("assistant", "a"), ("tool", "t"), ("user", "u2")),
     "expected role 'assistant' or 'tool'"),
    (_conv(("user", "u"), ("user", "v"), ("assistant", "a")), "expected role 'assistant'"),
    (_conv(("assistant", "a"),), "expected role 'user'"),
    (_conv(("user", "u"), ("assistant", " ")), "content must be a non-empty string"),
    (_conv(("user", "u")), "no assistant message"),
    (_conv(("user", "u"), ("assistant", "a </think> b")), "contains a thinking marker"),
    ({**_conv(("user", "u"), ("assistant", "a")), "status": "error"}, "status must be"),
    ({**_conv(("user", "u"), ("assistant", "a")), "id": 7}, "id must be a non-empty string"),
])
def test_specforge_checker_rules(row: dict[str, Any], error: str | None) -> None:
    found = row_error(row)
    assert (found is None) if error is None else (found is not None and error in found)


def test_multi_turn_prompts_pass_the_checker_with_empty_earlier_reasoning() -> None:
    from ops.export_specforge import _prompt_turn
    from ops.specforge_check import row_error

    prompt = [{"role": "user", "content": "fix the bug"},
              {"role": "assistant", "content": "ran the tests"},
              {"role": "user", "content": "now the edge case"}]
    turns = [_prompt_turn(m) for m in prompt]
    turns.append({"role": "assistant", "content": "done", "reasoning_content": "think"})
    record = {"id": "t1", "status": "success", "conversations": turns}
    assert turns[1]["reasoning_content"] == ""
    assert row_error(record, expect_reasoning=True, expect_non_reasoning=False) is None


def test_the_sample_cut_to_the_budget_is_no_specforge_answer() -> None:
    """The exact policy's crossing sample (finish reason budget) ends mid-answer: SpecForge
    gets no row of it; speculators keeps its tokens with the finish reason."""
    from datetime import UTC, datetime

    from common.budget import Budget
    from common.store import DatasetRow
    from ops.export_formats import make_builder
    from ops.export_record import LeftOut
    from ops.export_rows import ExportRow

    ds = DatasetRow("d", Budget(100, policy="exact"), {}, 4096, "", "h", reasoning_open="<think>")
    row = ExportRow(1, "d", "s", "rid", 3, 4, 0, 2, "budget", None, [5, 6, 7, 8],
                    "hmm</think> The answ", 0.1, "sim", "m", datetime.now(UTC),
                    [{"role": "user", "content": "q"}], [1, 2, 3], 64)
    left = make_builder("specforge", ds).build(row)
    assert isinstance(left, LeftOut) and left.reason == "cut_at_budget"
    whole = make_builder("specforge", ds).build(dataclasses.replace(row, finish_reason="stop"))
    assert not isinstance(whole, LeftOut)
    kept = make_builder("speculators", ds).build(row)
    assert not isinstance(kept, LeftOut) and kept["metadata"]["finish_reason"] == "budget"
