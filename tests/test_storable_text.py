"""Whatever a model or a prompt file holds is stored, on SQLite and PostgreSQL alike: NUL
in an output (the byte-0 token) and ``\\u0000`` in a prompt's JSON, through the real
pipeline (producer, a Celery worker, the simulator over HTTP) and out again by export.
A row the database refuses all the same fails its sample once, without a retry loop."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import redis
import sqlalchemy as sa
from tokenizers import Tokenizer

from common.schema import prompt_inputs, prompts, results
from common.settings import Settings
from common.sqltext import NUL, REPLACEMENT, storable
from common.store import Store
from ops.export import add_export_parser, run_export
from producer.template import BUNDLED_TOKENIZER
from sim import SimConfig, SimServer
from tests.conftest import make_settings
from tests.helpers import enqueue_paths, running_worker, wait_settled

NUL_EVERY = 5
PROMPT_WITH_NUL = [{"role": "system", "content": "Bell \u0007, escape \u001b, delete \u007f."},
                   {"role": "user", "content": "before\u0000after, and a tab\there"}]


@pytest.fixture(scope="module")
def nul_sim() -> Iterator[str]:
    """A simulator whose every 5th output token is the bundled vocabulary's byte 0."""
    server = SimServer(SimConfig(port=0, decode_tok_per_s=0, mean_output_tokens=40,
                                 tokenizer=str(BUNDLED_TOKENIZER), nul_every=NUL_EVERY))
    yield server.start()
    server.stop()


@pytest.fixture
def nul_settings(db_url: str, nul_sim: str, redis_client: redis.Redis) -> Settings:
    return make_settings(db_url, nul_sim, concurrency=4)


def _write(folder: Path, name: str, lines: list[dict[str, object]]) -> Path:
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _export(settings: Settings, fmt: str, out: Path) -> None:
    parser = argparse.ArgumentParser()
    add_export_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["export", "--format", fmt, "--out", str(out)])
    assert run_export(args, settings) == 0


def test_nul_in_outputs_and_prompts_is_stored_and_exported_as_written(
    nul_settings: Settings, tmp_path: Path
) -> None:
    lines: list[dict[str, object]] = [{"id": "nul-prompt", "messages": PROMPT_WITH_NUL}]
    lines += [{"id": f"n{i}", "messages": [{"role": "user", "content": f"question {i}"}]}
              for i in range(5)]
    lines.append({"id": "bad\u0000id", "messages": [{"role": "user", "content": "hi"}]})
    summary, = enqueue_paths(nul_settings, [str(_write(tmp_path, "nul", lines))])
    assert (summary.enqueued, summary.bad) == (6, 1)
    assert any("NUL" in problem for problem in summary.problems)
    store = Store(nul_settings.database_url)
    with running_worker(nul_settings, concurrency=4):
        wait_settled(store, ["nul"])
    assert store.prompt_counts("nul") == {"done": 6}

    decode = Tokenizer.from_file(str(BUNDLED_TOKENIZER / "tokenizer.json")).decode
    with store.engine.connect() as conn:
        rows = {r.sample_id: r for r in conn.execute(sa.select(results))}
        messages = conn.scalar(sa.select(prompt_inputs.c.messages)
                               .where(prompt_inputs.c.sample_id == "nul-prompt"))
    assert messages == PROMPT_WITH_NUL  # read back unchanged, NUL and controls included
    originals = {}
    for sample_id, row in rows.items():
        original = decode(row.output_ids, skip_special_tokens=True)
        assert NUL in original, sample_id  # the ids hold the byte-0 token...
        assert row.output_text == storable(original)  # ...the text column U+FFFD for it
        assert NUL not in row.output_text and REPLACEMENT in row.output_text
        originals[sample_id] = original

    _export(nul_settings, "parquet", tmp_path / "pq")
    table = pq.read_table(tmp_path / "pq" / "nul.parquet").to_pylist()
    assert {r["sample_id"]: r["output_text"] for r in table} == originals

    _export(nul_settings, "specforge", tmp_path / "sf")
    exported = [json.loads(line) for line in (tmp_path / "sf" / "nul.specforge.jsonl").open()]
    assert exported, "no sample exported"
    for record in exported:
        turns = record["conversations"]
        reply = turns[-1]["reasoning_content"] + turns[-1]["content"]
        assert NUL in reply and REPLACEMENT not in reply, record["id"]
        if record["id"] == "nul-prompt":
            assert [t["content"] for t in turns[:-1]] == [m["content"] for m in PROMPT_WITH_NUL]


def _refuse_results_of(engine: sa.Engine, sample_id: str) -> None:
    """A trigger of the database's own that refuses one sample's result row."""
    with engine.begin() as conn:
        if engine.dialect.name == "sqlite":
            conn.exec_driver_sql(
                "CREATE TRIGGER refuse_one BEFORE INSERT ON results "
                f"WHEN NEW.sample_id = '{sample_id}' "
                "BEGIN SELECT RAISE(ABORT, 'refused by the test trigger'); END")
            return
        conn.exec_driver_sql(
            "CREATE OR REPLACE FUNCTION refuse_one() RETURNS trigger AS $$ BEGIN "
            f"IF NEW.sample_id = '{sample_id}' THEN RAISE EXCEPTION "
            "'refused by the test trigger' USING ERRCODE = '22000'; END IF; "
            "RETURN NEW; END $$ LANGUAGE plpgsql")
        conn.exec_driver_sql("CREATE TRIGGER refuse_one BEFORE INSERT ON results "
                             "FOR EACH ROW EXECUTE FUNCTION refuse_one()")


def test_a_result_the_database_refuses_fails_its_sample_once(
    nul_settings: Settings, tmp_path: Path
) -> None:
    lines = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}]}
             for i in range(6)]
    enqueue_paths(nul_settings, [str(_write(tmp_path, "refuse", lines))])
    store = Store(nul_settings.database_url)
    _refuse_results_of(store.engine, "r3")
    with running_worker(nul_settings, concurrency=4):
        wait_settled(store, ["refuse"])
    assert store.prompt_counts("refuse") == {"done": 5, "failed": 1}
    with store.engine.connect() as conn:
        state, attempts, error = conn.execute(
            sa.select(prompts.c.state, prompts.c.attempts, prompts.c.error)
            .where(prompts.c.sample_id == "r3")).one()
    assert (state, attempts) == ("failed", 1)
    assert "could not be stored" in error and "refused by the test trigger" in error
    assert not store.has_result("refuse", "r3")


def test_lines_no_database_can_key_or_tokenizer_encode_are_reported(tmp_path: Path) -> None:
    from producer.reader import ReadReport, read_dataset

    path = tmp_path / "odd.jsonl"
    path.write_text(
        '{"id": "ok", "messages": [{"role": "user", "content": "a \\ud83d\\ude00 pair"}]}\n'
        '{"id": "s", "messages": [{"role": "user", "content": "lone \\ud800"}]}\n'
        f'{{"id": "{"x" * 201}", "messages": [{{"role": "user", "content": "long id"}}]}}\n')
    report = ReadReport("odd")
    assert [r.sample_id for r in read_dataset("odd", [path], report)] == ["ok"]
    assert report.problems == [f"{path}:2: a string holds a lone UTF-16 surrogate (\\ud800), "
                               "which is not text",
                               f"{path}:3: 'id' is 201 characters long, over the limit of 200"]
