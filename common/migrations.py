"""Upgrades of a database written by an earlier version, run once, on first use.

Two kinds so far: prompts' messages and token ids move to ``prompt_inputs``
(common/schema.py says why), and tables get the columns added since (``ADDED_COLUMNS``:
nullable, or with a default, which rows written before then hold), with the indexes on
them (``ADDED_INDEXES``). Every process that opens the database
checks; the first to find an old layout upgrades it under the database's write lock, in
one transaction, and the others, waiting on that lock, find it done. A crash halfway
leaves the old layout.
"""

from __future__ import annotations

import logging
import sqlite3
from typing import Any

import sqlalchemy as sa

from common.errors import ConfigError, DatagenError
from common.schema import ADDED_COLUMNS, ADDED_INDEXES, INPUT_COLUMNS, metadata

log = logging.getLogger("datagen.migrations")

_MOVE = ", ".join(INPUT_COLUMNS)
# WHERE true: SQLite would read ON CONFLICT as part of the SELECT's join otherwise.
_COPY = (f"INSERT INTO prompt_inputs (dataset, sample_id, {_MOVE}) "
         f"SELECT dataset, sample_id, {_MOVE} FROM prompts WHERE true ON CONFLICT DO NOTHING")
_DROPS = tuple(f"ALTER TABLE prompts DROP COLUMN {c}" for c in INPUT_COLUMNS)


def _columns(cursor: Any, dialect: str, table: str) -> set[str]:
    if dialect == "sqlite":
        cursor.execute(f"SELECT name FROM pragma_table_info('{table}')")
    else:
        cursor.execute("SELECT column_name FROM information_schema.columns "
                       "WHERE table_schema = current_schema() AND table_name = %s", (table,))
    return {row[0] for row in cursor.fetchall()}


def _has_old_layout(cursor: Any, dialect: str) -> bool:
    return bool(set(INPUT_COLUMNS) & _columns(cursor, dialect, "prompts"))


def _missing_columns(cursor: Any, dialect: str) -> list[tuple[str, str]]:
    """(table, column) of the columns added since the tables were created that they lack."""
    have = {table: _columns(cursor, dialect, table) for table, _ in ADDED_COLUMNS}
    return [(table, c) for table, c in ADDED_COLUMNS if c not in have[table]]


def _needs_upgrade(cursor: Any, dialect: str) -> bool:
    return _has_old_layout(cursor, dialect) or bool(_missing_columns(cursor, dialect))


def _move(cursor: Any, url: str) -> None:
    log.warning("%s: moving prompts' messages and token ids to the prompt_inputs table, "
                "once (a database written by an earlier datagen)", url)
    cursor.execute(_COPY)
    for drop in _DROPS:
        cursor.execute(drop)


def _apply(cursor: Any, dialect: Any, url: str) -> None:
    """Every upgrade the database lacks, on a cursor holding its write lock."""
    if _has_old_layout(cursor, dialect.name):
        if dialect.name == "sqlite" and sqlite3.sqlite_version_info < (3, 35):
            raise ConfigError(
                f"{url} was written by an earlier datagen and needs SQLite 3.35 or newer to "
                f"be upgraded (ALTER TABLE DROP COLUMN); this Python has "
                f"{sqlite3.sqlite_version}")
        _move(cursor, url)
    missing = _missing_columns(cursor, dialect.name)
    for table, name in missing:
        log.warning("%s: adding column %s to the %s table, once (a database written by an "
                    "earlier datagen)", url, name, table)
        # CREATE's own column clause: it keeps a NOT NULL column's default.
        column = sa.schema.CreateColumn(metadata.tables[table].c[name]).compile(dialect=dialect)
        cursor.execute(f"ALTER TABLE {table} ADD COLUMN {column}")
    if missing:
        for table_ in metadata.tables.values():
            for index in table_.indexes:
                if index.name in ADDED_INDEXES:
                    cols = ", ".join(c.name for c in index.columns)
                    cursor.execute(f"CREATE INDEX IF NOT EXISTS {index.name} ON "
                                   f"{table_.name} ({cols})")


def _sqlite(raw: Any, url: str, dialect: Any) -> None:
    # BEGIN IMMEDIATE takes the write lock before the check, so two processes cannot both
    # find the old layout; the driver's own transaction would begin only at the INSERT.
    level, raw.isolation_level = raw.isolation_level, None
    cursor = raw.cursor()
    try:
        cursor.execute("BEGIN IMMEDIATE")
        try:
            _apply(cursor, dialect, url)
            cursor.execute("COMMIT")
        except BaseException:
            cursor.execute("ROLLBACK")
            raise
    finally:
        cursor.close()
        raw.isolation_level = level


def _postgresql(raw: Any, url: str, dialect: Any) -> None:
    try:
        with raw.cursor() as cursor:
            # Waits for every transaction on prompts to end, then holds off the others.
            cursor.execute("LOCK TABLE prompts IN ACCESS EXCLUSIVE MODE")
            _apply(cursor, dialect, url)
        raw.commit()
    except BaseException:
        raw.rollback()
        raise


def raw_errors(dialect: str) -> type[Exception]:
    """The driver's own errors: the upgrade runs on the raw connection."""
    if dialect == "sqlite":
        return sqlite3.Error
    import psycopg

    return psycopg.Error


def upgrade(engine: sa.Engine) -> None:
    """Bring a database written by an earlier version to the current schema; returns at
    once if it is current, after one look at the tables' columns."""
    dialect = engine.dialect.name
    pooled = engine.raw_connection()
    try:
        raw: Any = pooled.driver_connection
        cursor = raw.cursor()
        try:
            old = _needs_upgrade(cursor, dialect)
        finally:
            cursor.close()
        if dialect == "postgresql":
            raw.rollback()  # the look began a transaction; the lock must start its own
        if old:
            url = engine.url.render_as_string(hide_password=True)
            try:
                (_sqlite if dialect == "sqlite" else _postgresql)(raw, url, engine.dialect)
            except raw_errors(dialect) as exc:
                raise DatagenError(f"{url}: upgrading the schema failed and nothing was "
                                   f"changed (one transaction): {exc}") from exc
    finally:
        pooled.close()
