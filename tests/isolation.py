"""Each pytest-xdist worker's own Redis and PostgreSQL databases.

The suite's services come from ``DATAGEN_TEST_REDIS_URL`` and ``DATAGEN_TEST_POSTGRES_URL``.
Tests flush their Redis database and drop their tables freely, so workers running side by
side (``pytest -n 4``) each take their own, derived from those two URLs:

- Redis: the URL's database number minus the worker's index (gw0 keeps it, gw1 takes
  one less, ...), on the same server: the default 15 gives 15, 14, 13, 12 to four workers.
- PostgreSQL: the URL's database with the worker's id as a suffix (``test_gw0``, ...), on
  the same server, created from its ``postgres`` database when missing.

Without xdist (plain ``pytest``) both URLs are used as they are.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

import sqlalchemy as sa

# The suite's settings, as given: what a run without xdist uses.
REDIS_BASE = os.environ.get("DATAGEN_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
POSTGRES_BASE = os.environ.get(
    "DATAGEN_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


class IsolationError(Exception):
    """The settings leave a worker no database of its own."""


def worker_id() -> str | None:
    """``gw0``, ``gw1``, ... in an xdist worker (xdist sets it before conftest is read)."""
    return os.environ.get("PYTEST_XDIST_WORKER") or None


def worker_index(worker: str) -> int:
    return int(worker.removeprefix("gw"))


def redis_url(base: str, worker: str | None) -> str:
    """The Redis URL of this worker: ``base`` on a database of its own."""
    if worker is None:
        return base
    parts = urlsplit(base)
    number = parts.path.lstrip("/") or "0"
    if not number.isdigit():
        raise IsolationError(f"DATAGEN_TEST_REDIS_URL={base}: the database must be a number")
    db = int(number) - worker_index(worker)
    if db < 0:
        raise IsolationError(
            f"DATAGEN_TEST_REDIS_URL={base}: worker {worker} would need database {db}; "
            f"give a database of at least the worker count minus one (15 by default)")
    return urlunsplit(parts._replace(path=f"/{db}"))


def postgres_url(base: str, worker: str | None) -> str:
    """The PostgreSQL URL of this worker: ``base`` on a database of its own."""
    if worker is None:
        return base
    url = sa.make_url(base)
    return url.set(database=f"{url.database}_{worker}").render_as_string(hide_password=False)


def create_database(url: sa.URL) -> None:
    """Create ``url``'s PostgreSQL database on a server that lacks it (a new machine)."""
    admin = sa.create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            exists = conn.scalar(sa.text("SELECT 1 FROM pg_database WHERE datname = :name"),
                                 {"name": url.database})
            if not exists:
                conn.execute(sa.text(f'CREATE DATABASE "{url.database}"'))
    finally:
        admin.dispose()
