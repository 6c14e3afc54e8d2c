"""Upgrades of a database written by an earlier version, run once, on first use.

One so far: prompts' messages and token ids move to ``prompt_inputs`` (common/schema.py
says why). Every process that opens the database checks; the first to find the old
layout moves the columns under the database's write lock, in one transaction, and the
others, waiting on that lock, find it done. A crash halfway leaves the old layout.
"""

from __future__ import annotations

import logging
import sqlite3
from typing import Any

import sqlalchemy as sa

from common.errors import ConfigError, DatagenError
from common.schema import INPUT_COLUMNS

log = logging.getLogger("datagen.migrations")

_MOVE = ", ".join(INPUT_COLUMNS)
# WHERE true: SQLite would read ON CONFLICT as part of the SELECT's join otherwise.
_COPY = (f"INSERT INTO prompt_inputs (dataset, sample_id, {_MOVE}) "
         f"SELECT dataset, sample_id, {_MOVE} FROM prompts WHERE true ON CONFLICT DO NOTHING")
_DROPS = tuple(f"ALTER TABLE prompts DROP COLUMN {c}" for c in INPUT_COLUMNS)


def _has_old_layout(cursor: Any, dialect: str) -> bool:
    if dialect == "sqlite":
        cursor.execute("SELECT name FROM pragma_table_info('prompts')")
    else:
        cursor.execute("SELECT column_name FROM information_schema.columns "
                       "WHERE table_schema = current_schema() AND table_name = 'prompts'")
    return bool(set(INPUT_COLUMNS) & {row[0] for row in cursor.fetchall()})


def _move(cursor: Any, url: str) -> None:
    log.warning("%s: moving prompts' messages and token ids to the prompt_inputs table, "
                "once (a database written by an earlier datagen)", url)
    cursor.execute(_COPY)
    for drop in _DROPS:
        cursor.execute(drop)


def _sqlite(raw: Any, url: str) -> None:
    if sqlite3.sqlite_version_info < (3, 35):
        raise ConfigError(
            f"{url} was written by an earlier datagen and needs SQLite 3.35 or newer to be "
            f"upgraded (ALTER TABLE DROP COLUMN); this Python has {sqlite3.sqlite_version}")
    # BEGIN IMMEDIATE takes the write lock before the check, so two processes cannot both
    # find the old layout; the driver's own transaction would begin only at the INSERT.
    level, raw.isolation_level = raw.isolation_level, None
    cursor = raw.cursor()
    try:
        cursor.execute("BEGIN IMMEDIATE")
        try:
            if _has_old_layout(cursor, "sqlite"):
                _move(cursor, url)
            cursor.execute("COMMIT")
        except BaseException:
            cursor.execute("ROLLBACK")
            raise
    finally:
        cursor.close()
        raw.isolation_level = level


def _postgresql(raw: Any, url: str) -> None:
    try:
        with raw.cursor() as cursor:
            # Waits for every transaction on prompts to end, then holds off the others.
            cursor.execute("LOCK TABLE prompts IN ACCESS EXCLUSIVE MODE")
            if _has_old_layout(cursor, "postgresql"):
                _move(cursor, url)
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
    once if it is current, after one look at prompts' columns."""
    dialect = engine.dialect.name
    pooled = engine.raw_connection()
    try:
        raw: Any = pooled.driver_connection
        cursor = raw.cursor()
        try:
            old = _has_old_layout(cursor, dialect)
        finally:
            cursor.close()
        if dialect == "postgresql":
            raw.rollback()  # the look began a transaction; the lock must start its own
        if old:
            url = engine.url.render_as_string(hide_password=True)
            try:
                (_sqlite if dialect == "sqlite" else _postgresql)(raw, url)
            except raw_errors(dialect) as exc:
                raise DatagenError(f"{url}: upgrading the schema failed and nothing was "
                                   f"changed (one transaction): {exc}") from exc
    finally:
        pooled.close()
