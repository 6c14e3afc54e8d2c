"""Engines for SQLite (the default) and PostgreSQL, and the one dialect-specific helper."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError

from common.errors import ServiceUnavailable
from common.schema import metadata


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # WAL lets many worker processes read while one writes; busy_timeout makes writers
    # queue instead of failing with "database is locked".
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=60000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def sqlalchemy_url(url: str) -> str:
    """The SQLAlchemy URL for a configured database URL (``postgresql://`` means psycopg 3)."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


def make_engine(url: str) -> Engine:
    """An engine whose schema exists; ServiceUnavailable if the database does not answer."""
    url = sqlalchemy_url(url)
    if url.startswith("sqlite"):
        # Every worker thread may hold a connection at once; SQLite serializes the writes.
        engine = sa.create_engine(
            url,
            connect_args={"timeout": 60, "check_same_thread": False},
            pool_size=16,
            max_overflow=240,
            pool_timeout=120,
        )
        sa.event.listen(engine, "connect", _sqlite_pragmas)
    else:
        engine = sa.create_engine(
            url, pool_pre_ping=True, pool_size=8, max_overflow=64, pool_recycle=1800,
            pool_timeout=120,
        )
    try:
        metadata.create_all(engine)
    except OperationalError as exc:
        safe = engine.url.render_as_string(hide_password=True)
        raise ServiceUnavailable(
            f"database {safe} does not answer: {exc.orig}; check DATAGEN_DATABASE_URL"
        ) from None
    return engine


def insert_ignore(engine: Engine, table: sa.Table) -> Any:
    """INSERT ... ON CONFLICT DO NOTHING for the engine's dialect."""
    dialect = postgresql if engine.dialect.name == "postgresql" else sqlite
    return dialect.insert(table).on_conflict_do_nothing()
