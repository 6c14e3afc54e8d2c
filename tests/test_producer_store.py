"""Storing prompts: the producer's bulk insert stores exactly what a plain SQLAlchemy insert
of the same values would, and reads back by key."""

from __future__ import annotations

import dataclasses
from typing import Any

import sqlalchemy as sa

from common.db import insert_ignore
from common.rows import NewPrompt
from common.schema import prompt_inputs, prompts
from common.store import Store


def _rows(n: int, state: str = "queued") -> list[NewPrompt]:
    return [NewPrompt(
        dataset="st",
        sample_id=f"s{i}",
        state=state,
        messages=[{"role": "system", "content": "Sé brief ✓"},
                  {"role": "user", "content": f'question "{i}"\n\\ {{}}'}],
        input_ids=[i, 0, 4_000_000_000, 7] * (i % 5),
        prompt_tokens=4 * (i % 5),
        max_new_tokens=1000 - i,
        source=f"/tmp/st.jsonl:{i + 1}" if i % 3 else None,
        error="too long" if i % 7 == 0 else None,
    ) for i in range(n)]


def _raw(store: Store, dataset: str) -> list[list[tuple[Any, ...]]]:
    """Each table's rows of the dataset as stored (JSON as its text), less the dataset."""
    tables = []
    for table in (prompts, prompt_inputs):
        cols = [f"CAST({c.name} AS TEXT)" if c.name == "messages" else c.name
                for c in table.c if c.name not in ("dataset", "created_at", "updated_at")]
        with store.engine.connect() as conn:
            tables.append(list(conn.exec_driver_sql(
                f"SELECT {', '.join(cols)} FROM {table.name} WHERE dataset = '{dataset}' "
                "ORDER BY sample_id")))
    return tables


def test_rows_equal_sqlalchemys_byte_for_byte(db_url: str) -> None:
    store = Store(db_url)
    rows = _rows(50)
    store.insert_prompts(rows)
    with store.engine.begin() as conn:
        for table in (prompts, prompt_inputs):
            same = [{c.name: getattr(row, c.name) for c in table.c if hasattr(row, c.name)}
                    for row in rows]
            conn.execute(insert_ignore(store.engine, table),
                         [row | {"dataset": "ref"} for row in same])
    states, inputs = _raw(store, "st")
    assert [states, inputs] == _raw(store, "ref")
    assert len(states) == len(inputs) == 50
    with store.engine.connect() as conn:
        stamps = conn.execute(sa.select(prompts.c.created_at, prompts.c.updated_at)
                              .where(prompts.c.dataset == "st")).all()
    assert all(created is not None and created == updated for created, updated in stamps)


def test_prompts_read_back_and_a_second_insert_changes_nothing(db_url: str) -> None:
    store = Store(db_url)
    rows = _rows(30)
    store.insert_prompts(rows)
    store.insert_prompts(_rows(30, state="skipped"))
    store.insert_prompts([])
    assert store.prompt_counts("st") == {"queued": 30}
    for row in rows:
        got = store.prompt("st", row.sample_id)
        assert got is not None
        assert (got.input_ids, got.prompt_tokens, got.max_new_tokens, got.attempts) == (
            row.input_ids, row.prompt_tokens, row.max_new_tokens, 0)
    with store.engine.connect() as conn:
        stored = dict(conn.execute(sa.select(prompt_inputs.c.sample_id,
                                             prompt_inputs.c.messages)).all())
    assert stored == {row.sample_id: row.messages for row in rows}


def test_a_group_read_answers_each_key_in_order_across_datasets(db_url: str) -> None:
    store = Store(db_url)
    rows = _rows(12)
    other = [dataclasses.replace(r, dataset="st2", input_ids=[9] * (i + 1))
             for i, r in enumerate(rows[:3])]
    store.insert_prompts(rows + other)
    keys = [("st", "s5"), ("st2", "s1"), ("st", "missing"), ("nope", "s1"), ("st", "s0"),
            ("st2", "s2")]
    got = store.prompts(keys)
    assert [None if g is None else (g.dataset, g.sample_id) for g in got] == [
        ("st", "s5"), ("st2", "s1"), None, None, ("st", "s0"), ("st2", "s2")]
    assert got[0] is not None and got[0].input_ids == rows[5].input_ids
    assert got[1] is not None and got[1].input_ids == [9, 9]
    assert got[5] is not None and got[5].input_ids == [9, 9, 9]
    assert store.prompts([]) == []


def test_a_worker_gathers_postgresqls_statistics_once_where_there_are_none(db_url: str) -> None:
    store = Store(db_url)
    assert store.ensure_statistics() is False  # nothing to plan for yet
    store.insert_prompts(_rows(50))
    on_postgresql = store.engine.dialect.name == "postgresql"
    assert store.ensure_statistics() is on_postgresql
    assert store.ensure_statistics() is False
    if on_postgresql:
        with store.engine.connect() as conn:
            analyzed = set(conn.exec_driver_sql(
                "SELECT tablename, attname FROM pg_stats WHERE schemaname = current_schema()"))
        assert {("prompts", "sample_id"), ("prompts", "state"),
                ("prompt_inputs", "sample_id")} <= analyzed
        assert ("prompt_inputs", "messages") not in analyzed
