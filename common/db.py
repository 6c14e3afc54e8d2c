"""Engines for SQLite (the default) and PostgreSQL, and the one dialect-specific helper."""

from __future__ import annotations

import select
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.exc import InterfaceError, OperationalError

from common.errors import ServiceUnavailable
from common.migrations import upgrade
from common.schema import metadata
from common.settings import DEFAULT_DB_CONNECTIONS

# The database did not answer, or the pool had no connection free for pool_timeout: nothing
# about the data is known to be wrong, so the caller waits and tries again.
UNAVAILABLE: tuple[type[Exception], ...] = (OperationalError, InterfaceError, sa.exc.TimeoutError)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # WAL lets many worker processes read while one writes; busy_timeout makes writers
    # queue instead of failing with "database is locked".
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=60000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _drop_if_closed_by_server(dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
    """Give the pool a new connection in place of one the server has closed.

    In place of SQLAlchemy's pre-ping, a round trip on every checkout (two on PostgreSQL:
    a BEGIN and the ping), which a worker pays twice a group. A connection idle in the
    pool has nothing to read unless the server closed it (a restart, an administrator's
    terminate: an error message, then end of file), so a look at its socket, without
    waiting, finds what the ping would; anything readable is taken as closed, as the
    pool then only opens a new connection. A network that silently dropped the
    connection is found by the statement's error instead, which the callers retry.
    """
    if dbapi_conn.closed:
        raise sa.exc.DisconnectionError("the connection is closed")
    poller = select.poll()
    poller.register(dbapi_conn.fileno(), select.POLLIN | select.POLLPRI)
    if poller.poll(0):
        raise sa.exc.DisconnectionError("the server closed the connection")


def sqlalchemy_url(url: str) -> str:
    """The SQLAlchemy URL for a configured database URL (``postgresql://`` means psycopg 3)."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


def pooled_engine(url: str, connections: int = DEFAULT_DB_CONNECTIONS, **pool: Any) -> Engine:
    """An engine with the project's connection handling (SQLite's pragmas, PostgreSQL's
    check at checkout); ``connections``: most PostgreSQL connections it holds; ``pool``
    overrides the pool's defaults (sizes, timeouts)."""
    url = sqlalchemy_url(url)
    if url.startswith("sqlite"):
        # Every worker thread may hold a connection at once; SQLite serializes the writes.
        # Last in, first out: each SQLite connection keeps its own compiled statements (a
        # group's statements differ by its size) and page cache, up to 8 MB once warm, so
        # the pool hands out the connections used last and leaves the others cold. Taken in
        # turn, all 16 warmed up: 30-37 MB more RSS after 100,000 samples (bench.memory).
        engine = sa.create_engine(
            url, connect_args={"timeout": 60, "check_same_thread": False},
            **{"pool_size": 16, "max_overflow": 240, "pool_timeout": 120, "pool_use_lifo": True,
               **pool},
        )
        sa.event.listen(engine, "connect", _sqlite_pragmas)
    else:
        # Capped, with no overflow: the server's max_connections is shared by every
        # process of a run, so a worker's threads take turns on a few connections (their
        # statements take milliseconds) rather than each opening its own.
        engine = sa.create_engine(url, **{"pool_size": connections, "max_overflow": 0,
                                          "pool_recycle": 1800, "pool_timeout": 120, **pool})
        sa.event.listen(engine, "checkout", _drop_if_closed_by_server)
    return engine


# PostgreSQL's refusals of a new connection for want of room (SQLSTATE 53300, which psycopg
# does not report for a connection it never made): the server's max_connections, a role's
# or a database's CONNECTION LIMIT.
_NO_ROOM = ("too many clients already", "too many connections for")


def _answers(engine: Engine) -> bool:
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
        return True
    except sa.exc.DBAPIError:
        return False


def _create_schema(engine: Engine, tries: int = 3) -> None:
    """Create the tables missing. Processes starting at once on a new database race: each
    looks, finds a table missing and creates it, and all but one fail with "already
    exists" (SQLite) or a duplicate key in PostgreSQL's catalog; their next look finds it."""
    for attempt in range(1, tries + 1):
        try:
            metadata.create_all(engine)
            return
        except sa.exc.DBAPIError:
            if attempt == tries or not _answers(engine):
                raise
            time.sleep(0.05 * attempt)


def make_engine(url: str, connections: int = DEFAULT_DB_CONNECTIONS) -> Engine:
    """An engine whose schema exists; ServiceUnavailable if the database does not answer."""
    engine = pooled_engine(url, connections)
    try:
        _create_schema(engine)
    except OperationalError as exc:
        safe = engine.url.render_as_string(hide_password=True)
        if any(text in str(exc.orig) for text in _NO_ROOM):
            raise ServiceUnavailable(
                f"database {safe} has no connection left for this process: {exc.orig}; "
                "raise its max_connections (or the role's or database's connection limit), "
                f"or lower DATAGEN_DB_CONNECTIONS ({connections} a process now), so that "
                "every process of the run fits") from None
        raise ServiceUnavailable(
            f"database {safe} does not answer: {exc.orig}; check DATAGEN_DATABASE_URL"
        ) from None
    upgrade(engine)
    return engine


def insert_ignore(engine: Engine, table: sa.Table) -> Any:
    """INSERT ... ON CONFLICT DO NOTHING for the engine's dialect."""
    dialect = postgresql if engine.dialect.name == "postgresql" else sqlite
    return dialect.insert(table).on_conflict_do_nothing()
