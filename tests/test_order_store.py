"""Ranks in SQL: a database written before them gets their columns once, its datasets
keep file order, and its prompts without a rank come first, by id. SQLite and PostgreSQL."""

from __future__ import annotations

import sqlalchemy as sa

from common.budget import Budget
from common.db import pooled_engine
from common.order import Order, OrderRequest
from common.rows import NewPrompt
from common.schema import ADDED_COLUMNS, ADDED_INDEXES, metadata
from common.store import DatasetRow, Store
from tests.helpers import all_at_once


def _prompt(sample_id: str, rank: int | None = None) -> NewPrompt:
    return NewPrompt(dataset="old", sample_id=sample_id, state="queued", prompt_tokens=1,
                     max_new_tokens=8, source=f"/d/old.jsonl:{sample_id}",
                     messages=[{"role": "user", "content": sample_id}], input_ids=[1],
                     rank=rank)


def _write_database_before_ranks(url: str) -> None:
    """Today's schema without the columns added since (ranks among them), holding a dataset
    of 3 prompts."""
    engine = pooled_engine(url)
    metadata.create_all(engine)
    with engine.begin() as conn:
        for index in ADDED_INDEXES:  # SQLite drops no column an index still names
            conn.exec_driver_sql(f"DROP INDEX {index}")
        for table, column in ADDED_COLUMNS:
            conn.exec_driver_sql(f"ALTER TABLE {table} DROP COLUMN {column}")
        conn.exec_driver_sql(
            "INSERT INTO datasets (name, budget_tokens, basis, policy, state, sampling, "
            "max_seq_len, tokenizer, template_hash, stamp, created_at, updated_at) VALUES "
            "('old', 100, 'output', 'drain', 'open', '{}', 64, 't', 'h', 'old@1', "
            "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)")
        for sid in ("s2", "s0", "s1"):
            conn.exec_driver_sql(
                "INSERT INTO prompts (dataset, sample_id, state, prompt_tokens, "
                "max_new_tokens, attempts, created_at, updated_at) VALUES "
                f"('old', '{sid}', 'queued', 1, 8, 0, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)")
    engine.dispose()


def test_a_database_before_ranks_gets_them_once_and_keeps_file_order(db_url: str) -> None:
    _write_database_before_ranks(db_url)
    store = all_at_once(lambda: Store(db_url), 4)[0]  # processes starting at once
    inspector = sa.inspect(store.engine)
    for table, column in ADDED_COLUMNS:
        assert column in {c["name"] for c in inspector.get_columns(table)}
    ds = store.dataset("old")
    assert ds.order == Order("file")
    # A re-run that asks for nothing keeps the order the dataset was published in.
    assert OrderRequest().resolve("old", ds.order, True) == Order("file")
    store.insert_prompts([_prompt("new1", 1), _prompt("new0", 0)])
    assert store.sample_ids("old", "queued") == ["s0", "s1", "s2", "new0", "new1"]


def test_sample_ids_come_in_rank_order_ties_by_id(db_url: str) -> None:
    store = Store(db_url)
    store.upsert_dataset(DatasetRow(name="old", budget=Budget(100), sampling={},
                                    max_seq_len=64, tokenizer="t", template_hash="h",
                                    order=Order("shuffle", 7)))
    store.insert_prompts([_prompt("c", 2**62), _prompt("b", 5), _prompt("a", 5),
                          _prompt("d", 0)])
    assert store.sample_ids("old", "queued") == ["d", "a", "b", "c"]
    assert store.dataset("old").order == Order("shuffle", 7)
