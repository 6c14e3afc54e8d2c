"""The PostgreSQL pool's check at checkout: a connection the server closed while it sat in
the pool is replaced before anyone uses it, without a round trip for the healthy ones."""

from __future__ import annotations

import time

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


def test_a_healthy_pooled_connection_is_kept() -> None:
    engine = make_engine(POSTGRES_URL)
    try:
        first = backend_pid(engine)
        assert [backend_pid(engine) for _ in range(5)] == [first] * 5
    finally:
        engine.dispose()


def test_a_pooled_connection_the_server_closed_is_replaced_at_checkout() -> None:
    engine = make_engine(POSTGRES_URL)
    try:
        closed = backend_pid(engine)
        terminate(closed)
        assert backend_pid(engine) != closed  # a new session, and no error on the way
    finally:
        engine.dispose()


def test_without_the_check_the_same_connection_fails_its_next_statement() -> None:
    """The control for the test above: a pool that neither pings nor looks hands out the
    closed connection, and the caller's statement fails."""
    engine = sa.create_engine(POSTGRES_URL)
    try:
        closed = backend_pid(engine)
        terminate(closed)
        with pytest.raises(sa_exc.OperationalError):
            backend_pid(engine)
    finally:
        engine.dispose()
