"""Connections to Redis and the database, with clear errors when they do not answer."""

from __future__ import annotations

import os

import redis
import sqlalchemy as sa

from common.db import sqlalchemy_url
from common.errors import ServiceUnavailable
from common.ledger import Ledger
from common.pairing import pair
from common.settings import Settings, masked
from common.store import Store

# A probe answers well inside Docker's healthcheck timeout and a worker's start-up wait.
PROBE_TIMEOUT_S = 3.0


def safe_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    return masked(url)


def connect_redis(settings: Settings) -> redis.Redis:
    client = redis.Redis.from_url(
        settings.redis_url, socket_connect_timeout=5, health_check_interval=25
    )
    try:
        client.ping()
    except redis.RedisError as exc:
        raise ServiceUnavailable(
            f"Redis at {safe_url(settings.redis_url)} does not answer ({exc}); "
            "start it or set DATAGEN_REDIS_URL"
        ) from None
    return client


def connect(settings: Settings) -> tuple[Store, Ledger]:
    """The store and its ledger; StoreMismatch if the Redis holds another database's."""
    store = Store(settings.database_url, settings.db_connections)
    ledger = Ledger(connect_redis(settings))
    pair(store, ledger)
    return store, ledger


def short_reason(exc: BaseException) -> str:
    """Why a connection failed, in a few words: "connection refused" rather than a
    driver's sentence, else the first line of its message."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return os.strerror(seen.errno).lower()
        if isinstance(seen, TimeoutError):
            return "timed out"
        seen = seen.__cause__ or seen.__context__
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    # libpq: 'connection failed: connection to server at "h", port 5432 failed: FATAL:  why'
    why = lines[0].rsplit("failed: ", 1)[-1].removeprefix("FATAL:").strip() or lines[0]
    return why[:1].lower() + why[1:]


def redis_problem(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when Redis answers PING, else why not."""
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s,
                                  socket_timeout=timeout_s)
    try:
        client.ping()
    except redis.RedisError as exc:
        return short_reason(exc)
    finally:
        client.close()
    return None


def database_problem(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when the database answers SELECT 1, else why not (no schema is created)."""
    full = sqlalchemy_url(url)
    connect_args = {"connect_timeout": int(timeout_s)} if "+psycopg" in full else {}
    engine = sa.create_engine(full, connect_args=connect_args, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except sa.exc.SQLAlchemyError as exc:
        return short_reason(exc)
    finally:
        engine.dispose()
    return None
