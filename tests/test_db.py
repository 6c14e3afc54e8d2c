"""The PostgreSQL pool's check at checkout: a connection the server closed while it sat in
the pool is replaced before anyone uses it, without a round trip for the healthy ones."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from common.db import make_engine
from tests.conftest import POSTGRES_URL


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
