"""A database written before prompt_inputs existed: every process upgrades it on first
use, once, keeping every prompt, on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

import common.migrations
from common.conversation_store import conversation_counts
from common.db import pooled_engine
from common.errors import DatagenError
from common.rows import NewConversation, NewPrompt, ResultRow
from common.schema import (
    ADDED_COLUMNS,
    datasets,
    meta,
    prompt_inputs,
    prompts,
    results,
    utcnow,
)
from common.store import Store
from common.tokenids import TokenIds
from ops.export_rows import _select
from tests.helpers import all_at_once

# prompts as earlier versions created it: the messages and token ids in the row.
_OLD = sa.MetaData()
_OLD_PROMPTS = sa.Table(
    "prompts", _OLD,
    sa.Column("dataset", sa.String(100), primary_key=True),
    sa.Column("sample_id", sa.String(200), primary_key=True),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("messages", sa.JSON, nullable=False),
    sa.Column("input_ids", TokenIds, nullable=False),
    sa.Column("prompt_tokens", sa.Integer, nullable=False),
    sa.Column("max_new_tokens", sa.Integer, nullable=False),
    sa.Column("source", sa.String(600)),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("error", sa.Text),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, default=utcnow),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, default=utcnow),
    sa.Index("ix_prompts_dataset_state", "dataset", "state"),
)
for _table in (meta, datasets, results):
    _table.to_metadata(_OLD)

N = 40


def _old_rows() -> list[dict[str, Any]]:
    return [{"dataset": "old", "sample_id": f"s{i}", "state": "done" if i % 4 == 0 else "queued",
             "messages": [{"role": "user", "content": f"question {i} ✓"}],
             "input_ids": [i, 7, 4_000_000_000][: 1 + i % 3], "prompt_tokens": 1 + i % 3,
             "max_new_tokens": 100 + i, "source": f"/data/old.jsonl:{i + 1}",
             "attempts": i % 2, "error": "timed out" if i % 2 else None} for i in range(N)]


def _write_old_database(url: str) -> None:
    engine = pooled_engine(url)
    _OLD.create_all(engine)
    with engine.begin() as conn:
        conn.execute(_OLD_PROMPTS.insert(), _old_rows())
        conn.execute(results.insert(), [{
            "dataset": "old", "sample_id": "s0", "rid": "r0", "prompt_tokens": 1,
            "completion_tokens": 2, "finish_reason": "stop", "output_ids": [5, 6],
            "output_text": "ok", "server": "http://sglang", "model": "m"}])
    engine.dispose()


def _columns(store: Store, table: str) -> set[str]:
    return {c["name"] for c in sa.inspect(store.engine).get_columns(table)}


def test_an_old_database_is_upgraded_on_first_use_and_keeps_every_prompt(db_url: str) -> None:
    _write_old_database(db_url)
    store = Store(db_url)
    assert _columns(store, "prompts") == {c.name for c in prompts.c}
    assert {"messages", "input_ids"} <= _columns(store, "prompt_inputs")
    got = store.prompts([("old", f"s{i}") for i in range(N)])
    for row, prompt in zip(_old_rows(), got, strict=True):
        assert prompt is not None
        assert (prompt.state, prompt.input_ids, prompt.prompt_tokens, prompt.max_new_tokens,
                prompt.attempts) == (row["state"], row["input_ids"], row["prompt_tokens"],
                                     row["max_new_tokens"], row["attempts"])
    with store.engine.connect() as conn:
        errors = dict(conn.execute(sa.select(prompts.c.sample_id, prompts.c.error)).all())
        exported = conn.execute(_select()).one()
    assert errors == {row["sample_id"]: row["error"] for row in _old_rows()}
    assert (exported.sample_id, exported.messages, exported.input_ids) == (
        "s0", _old_rows()[0]["messages"], [0])
    # The upgraded database takes new prompts and settles them like any other.
    old = _old_rows()[1]
    store.insert_prompts([NewPrompt(
        dataset=old["dataset"], sample_id="new", state="queued",
        prompt_tokens=old["prompt_tokens"], max_new_tokens=old["max_new_tokens"],
        source=old["source"], messages=old["messages"], input_ids=old["input_ids"])])
    assert store.save_results([_result("new")]) == {("old", "new")}
    assert store.prompt_counts("old") == {"done": 11, "queued": 30}
    # A second process finds nothing to do.
    again = Store(db_url)
    assert again.prompt("old", "s5") == store.prompt("old", "s5")


def _result(sample_id: str) -> ResultRow:
    return ResultRow(dataset="old", sample_id=sample_id, rid=f"r-{sample_id}",
                     prompt_tokens=2, completion_tokens=3, finish_reason="stop",
                     output_ids=[1, 2, 3], output_text="abc", server="http://sglang",
                     model="m")


def test_processes_starting_at_once_upgrade_it_once(db_url: str) -> None:
    _write_old_database(db_url)
    stores = all_at_once(lambda: Store(db_url), 6)
    with stores[0].engine.connect() as conn:
        moved = conn.execute(sa.text("SELECT COUNT(*) FROM prompt_inputs")).scalar()
    assert moved == N
    assert all(s.prompt("old", "s3") is not None for s in stores)


def test_an_upgrade_that_fails_leaves_the_old_layout_whole(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_old_database(db_url)
    # The second column's drop fails after the copy and the first drop have run.
    monkeypatch.setattr(common.migrations, "_DROPS",
                        (common.migrations._DROPS[0], "ALTER TABLE prompts DROP COLUMN nowhere"))
    with pytest.raises(DatagenError, match="nothing was changed"):
        Store(db_url)
    engine = pooled_engine(db_url)
    try:
        names = {c["name"] for c in sa.inspect(engine).get_columns("prompts")}
        with engine.connect() as conn:
            copied = conn.execute(sa.text("SELECT COUNT(*) FROM prompt_inputs")).scalar()
            kept = conn.execute(sa.text("SELECT COUNT(*) FROM prompts")).scalar()
    finally:
        engine.dispose()
    assert {"messages", "input_ids"} <= names
    assert (copied, kept) == (0, N)
    monkeypatch.undo()
    assert Store(db_url).prompt("old", "s2") is not None


# prompt_inputs as 0.2.0 created it: no tools column.
_V020 = sa.MetaData()
_V020_INPUTS = sa.Table(
    "prompt_inputs", _V020,
    sa.Column("dataset", sa.String(100), primary_key=True),
    sa.Column("sample_id", sa.String(200), primary_key=True),
    sa.Column("messages", sa.JSON, nullable=False),
    sa.Column("input_ids", TokenIds, nullable=False),
)
for _table in (meta, datasets, prompts, results):
    _table.to_metadata(_V020)

_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def _write_v020_database(url: str) -> None:
    engine = pooled_engine(url)
    _V020.create_all(engine)
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(prompts.insert(), [{
            "dataset": "old", "sample_id": f"s{i}", "state": "done" if i == 0 else "queued",
            "prompt_tokens": 2, "max_new_tokens": 10, "source": f"/d/old.jsonl:{i + 1}",
            "created_at": now, "updated_at": now} for i in range(3)])
        conn.execute(_V020_INPUTS.insert(), [{
            "dataset": "old", "sample_id": f"s{i}", "input_ids": [i, 9],
            "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)])
        conn.execute(results.insert(), [{
            "dataset": "old", "sample_id": "s0", "rid": "r0", "prompt_tokens": 2,
            "completion_tokens": 2, "finish_reason": "stop", "output_ids": [5, 6],
            "output_text": "ok", "server": "http://sglang", "model": "m"}])
    engine.dispose()


def test_a_v020_database_gets_the_tools_column_once_and_keeps_its_prompts(db_url: str) -> None:
    _write_v020_database(db_url)
    stores = all_at_once(lambda: Store(db_url), 4)  # processes starting at once: added once
    store = stores[0]
    assert "tools" in _columns(store, "prompt_inputs")
    assert [p.input_ids if p else None for p in store.prompts(
        [("old", f"s{i}") for i in range(3)])] == [[0, 9], [1, 9], [2, 9]]
    with store.engine.connect() as conn:
        exported = conn.execute(_select()).one()
    assert (exported.sample_id, exported.messages, exported.tools) == (
        "s0", [{"role": "user", "content": "q0"}], None)
    store.insert_prompts([NewPrompt(
        dataset="old", sample_id="new", state="queued", prompt_tokens=2, max_new_tokens=10,
        source="/d/old.jsonl:9", messages=[{"role": "user", "content": "w"}],
        input_ids=[4, 2], tools=_TOOLS)])
    assert store.save_results([_result("new")]) == {("old", "new")}
    with store.engine.connect() as conn:
        rows = {r.sample_id: r.tools for r in conn.execute(_select())}
        nulls = conn.execute(sa.text(
            "SELECT COUNT(*) FROM prompt_inputs WHERE tools IS NULL")).scalar()
    assert rows == {"s0": None, "new": _TOOLS}
    assert nulls == 3  # SQL NULL, not JSON null, for a prompt without tools
    assert Store(db_url).prompt("old", "new") is not None  # a later process finds it current


# The tables before every column added since (turn by turn, the publishing order, tools),
# and no conversations table.
_V030 = sa.MetaData()
for _table in (datasets, prompt_inputs, prompts, results, meta):
    sa.Table(_table.name, _V030, *(
        sa.Column(c.name, c.type, primary_key=c.primary_key, nullable=c.nullable,
                  server_default=c.server_default)
        for c in _table.columns if (_table.name, c.name) not in ADDED_COLUMNS))


def test_a_v030_database_gets_the_turn_columns_and_conversations(db_url: str) -> None:
    engine = pooled_engine(db_url)
    _V030.create_all(engine)
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(_V030.tables["datasets"].insert(), [{
            "name": "old", "budget_tokens": 100, "sampling": {}, "max_seq_len": 64,
            "tokenizer": "t", "template_hash": "h", "stamp": "old@1", "created_at": now,
            "updated_at": now}])
    engine.dispose()
    store = all_at_once(lambda: Store(db_url), 4)[0]  # processes starting at once
    assert {"conversation", "turn"} <= _columns(store, "prompt_inputs")
    assert {c for t, c in ADDED_COLUMNS if t == "datasets"} <= _columns(store, "datasets")
    assert "rank" in _columns(store, "prompts")
    indexes = {i["name"] for i in sa.inspect(store.engine).get_indexes("prompt_inputs")}
    assert "ix_prompt_inputs_conversation" in indexes
    assert (store.dataset("old").turns, store.dataset("old").template_kwargs) == ("last", None)
    assert store.dataset("old").reasoning_opens is None  # the dataset's one opener
    messages = [{"role": "user", "content": "q"}]
    store.insert_prompts(
        [NewPrompt(dataset="old", sample_id="c#turn1", state="queued", prompt_tokens=2,
                   max_new_tokens=10, source="/d/old.jsonl:1", messages=messages,
                   input_ids=[4, 2], conversation="c", turn=1)],
        [NewConversation(dataset="old", conversation="c", messages=messages, tools=None,
                         turns=1, source="/d/old.jsonl:1")])
    assert store.save_results([_result("c#turn1")]) == {("old", "c#turn1")}
    counts = conversation_counts(store, "old", closed=False)
    assert (counts.total, counts.complete) == (1, 1)
    assert Store(db_url).dataset("old").turns == "last"  # a later process finds it current
