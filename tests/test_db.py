"""The pools. PostgreSQL's looks at each connection it hands out: one the server closed
while it sat in the pool is replaced before anyone uses it, without a round trip for the
healthy ones; and it holds at most the configured number. SQLite's reuses its warm
connection."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from common.db import make_engine
from common.errors import ConfigError, ServiceUnavailable
from common.schema import metadata
from common.settings import Settings
from common.store import Store
from tests.conftest import POSTGRES_URL
from tests.helpers import all_at_once


def backend_pid(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())


def terminate(pid: int) -> None:
    """End a session from outside, as a server restart does, and wait until it is gone."""
    # Autocommit: inside one transaction pg_stat_activity is a snapshot that never changes.
    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            assert conn.exec_driver_sql(f"SELECT pg_terminate_backend({pid})").scalar_one()
            deadline = time.monotonic() + 10
            while conn.exec_driver_sql(
                    f"SELECT count(*) FROM pg_stat_activity WHERE pid = {pid}").scalar_one():
                assert time.monotonic() < deadline, f"backend {pid} still there after 10 s"
                time.sleep(0.05)
    finally:
        admin.dispose()


@pytest.fixture
def checked() -> Iterator[sa.Engine]:
    """The project's engine: its pool looks at each connection it hands out."""
    engine = make_engine(POSTGRES_URL)
    yield engine
    engine.dispose()


@pytest.fixture
def unchecked() -> Iterator[sa.Engine]:
    """A pool that neither pings nor looks."""
    engine = sa.create_engine(POSTGRES_URL)
    yield engine
    engine.dispose()


def test_a_healthy_pooled_connection_is_kept(checked: sa.Engine) -> None:
    first = backend_pid(checked)
    assert [backend_pid(checked) for _ in range(5)] == [first] * 5


def test_a_pooled_connection_the_server_closed_is_replaced_at_checkout(
    checked: sa.Engine,
) -> None:
    closed = backend_pid(checked)
    terminate(closed)
    assert backend_pid(checked) != closed  # a new session, and no error on the way


def test_without_the_check_the_same_connection_fails_its_next_statement(
    unchecked: sa.Engine,
) -> None:
    """The control for the test above: the closed connection is handed out, and the
    caller's statement fails."""
    closed = backend_pid(unchecked)
    terminate(closed)
    with pytest.raises(sa_exc.OperationalError):
        backend_pid(unchecked)


def test_sqlite_hands_out_the_connection_returned_last(tmp_path: Path) -> None:
    """Each SQLite connection keeps its own statements and page cache: the pool reuses the
    warm one rather than taking its connections in turn."""
    engine = make_engine(f"sqlite:///{tmp_path / 'lifo.db'}")
    try:
        first, second = engine.connect(), engine.connect()
        drivers = [c.connection.driver_connection for c in (first, second)]
        first.close()
        second.close()
        with engine.connect() as again:
            assert again.connection.driver_connection is drivers[1]
    finally:
        engine.dispose()


def test_a_process_holds_at_most_its_connections_and_its_threads_take_turns() -> None:
    """Every process of a run shares the server's max_connections: twelve threads that
    each want a connection at once get three between them, and all of them are served."""
    engine = make_engine(POSTGRES_URL, connections=3)
    inside, peak, pids, lock = [0], [0], set(), threading.Lock()

    def use() -> None:
        with engine.connect() as conn:
            with lock:
                inside[0] += 1
                peak[0] = max(peak[0], inside[0])
            pid = conn.exec_driver_sql("SELECT pg_backend_pid() FROM pg_sleep(0.05)").scalar_one()
            with lock:
                inside[0] -= 1
                pids.add(pid)

    try:
        threads = [threading.Thread(target=use) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads)
        assert len(pids) <= 3 and peak[0] == 3  # the cap was reached, and never passed
        assert engine.pool.checkedout() == 0
    finally:
        engine.dispose()


def test_the_cap_comes_from_the_environment() -> None:
    settings = Settings.from_env({"DATAGEN_DB_CONNECTIONS": "2"})
    store = Store(POSTGRES_URL, settings.db_connections)
    try:
        assert store.engine.pool.size() == 2  # the cap itself: the test above
    finally:
        store.engine.dispose()
    assert Settings().db_connections == 4
    with pytest.raises(ConfigError, match="DATAGEN_DB_CONNECTIONS=1 must be at least 2"):
        Settings.from_env({"DATAGEN_DB_CONNECTIONS": "1"})


def test_a_server_with_no_connection_left_says_what_to_change() -> None:
    """A fleet past PostgreSQL's max_connections is refused at connect, with the same
    SQLSTATE as a role at its connection limit: the message names the limits, not the
    URL."""
    role = f"datagen_full_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 0")
        url = sa.make_url(POSTGRES_URL).set(username=role, password=None)
        with pytest.raises(ServiceUnavailable) as caught:
            make_engine(url.render_as_string(hide_password=False), connections=3)
        message = str(caught.value)
        assert f'too many connections for role "{role}"' in message
        assert "max_connections" in message and "DATAGEN_DB_CONNECTIONS (3 a process" in message
        assert "check DATAGEN_DATABASE_URL" not in message
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP ROLE IF EXISTS {role}")
        admin.dispose()


def test_processes_starting_at_once_on_a_new_database_all_get_its_schema(db_url: str) -> None:
    engines = all_at_once(lambda: make_engine(db_url), 8)
    assert set(metadata.tables) <= set(sa.inspect(engines[0]).get_table_names())
    for engine in engines:
        engine.dispose()
