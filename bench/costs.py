"""Per-task costs: Redis commands (MONITOR, filtered to the bench DB) and SQL statements.

SQL statements are counted with SQLAlchemy events on every engine of this process, so
the worker counted here runs in-process (``celery.contrib.testing.worker``, threads pool,
the same app ``datagen worker`` builds). PostgreSQL's own ``pg_stat_database`` counters
for the bench database give an independent count of transactions and rows.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bench.harness import POSTGRES_SA_URL, REDIS_URL


class RedisMonitor:
    """Counts commands sent to the bench DB; those run inside Lua scripts separately.

    The reader blocks with no socket timeout: redis-py drops a connection whose read timed
    out, which ended MONITOR at the first quiet half second and cut the count short
    without a word (a worker whose requests all take seconds sends nothing for seconds).
    Leaving, it wakes the reader with a PING of its own, and raises if the reader stopped
    before then, so a short count is never reported."""

    def __init__(self, url: str = REDIS_URL) -> None:
        self.url = url
        self.client = redis.Redis.from_url(url)
        self.db = int(self.client.connection_pool.connection_kwargs.get("db", 0))
        self.direct: Counter[str] = Counter()
        self.lua: Counter[str] = Counter()
        self.failed: Exception | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-monitor")

    def _run(self) -> None:
        try:
            with self.client.monitor() as mon:
                while True:
                    cmd = mon.next_command()
                    if self._stop.is_set():
                        return
                    if cmd.get("db") != self.db:
                        continue
                    name = str(cmd.get("command", "")).split(" ", 1)[0].upper()
                    (self.lua if cmd.get("client_type") == "lua" else self.direct)[name] += 1
        except Exception as exc:  # reported by __exit__ unless it came after the stop
            if not self._stop.is_set():
                self.failed = exc

    def __enter__(self) -> RedisMonitor:
        self._thread.start()
        time.sleep(0.3)
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        time.sleep(0.5)  # let the stream catch up
        self._stop.set()
        waker = redis.Redis.from_url(self.url, socket_timeout=5)
        try:
            waker.ping()
        finally:
            waker.close()
        self._thread.join(5)
        self.client.close()
        if exc_type is not None:
            return  # the body's own error is the one to see
        if self._thread.is_alive():
            raise RuntimeError("the MONITOR reader did not stop")
        if self.failed is not None:
            raise RuntimeError(f"MONITOR stopped early, so its count is short: "
                               f"{self.failed!r}") from self.failed


class SqlCounter:
    """Statements (by first keyword), rows sent in executemany, and commits."""

    def __init__(self) -> None:
        self.statements: Counter[str] = Counter()
        self.commits = 0
        self._lock = threading.Lock()

    def _on_execute(self, conn: Any, cursor: Any, statement: str, params: Any,
                    context: Any, executemany: bool) -> None:
        word = statement.lstrip().split(None, 1)[0].upper() if statement.strip() else "?"
        with self._lock:
            self.statements[word + (" (many)" if executemany else "")] += 1

    def _on_commit(self, conn: Any) -> None:
        with self._lock:
            self.commits += 1

    @contextmanager
    def counting(self) -> Iterator[SqlCounter]:
        sa.event.listen(Engine, "before_cursor_execute", self._on_execute)
        sa.event.listen(Engine, "commit", self._on_commit)
        try:
            yield self
        finally:
            sa.event.remove(Engine, "before_cursor_execute", self._on_execute)
            sa.event.remove(Engine, "commit", self._on_commit)


PG_FIELDS = ("xact_commit", "xact_rollback", "tup_returned", "tup_fetched", "tup_inserted",
             "tup_updated")


def pg_stats() -> dict[str, int]:
    """The bench database's counters (flushed by PostgreSQL about once a second)."""
    engine = sa.create_engine(POSTGRES_SA_URL)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_stat_force_next_flush()"))
            row = conn.execute(sa.text(
                f"SELECT {', '.join(PG_FIELDS)} FROM pg_stat_database "
                "WHERE datname = current_database()")).one()
            return dict(zip(PG_FIELDS, (int(v) for v in row), strict=True))
    finally:
        engine.dispose()


def pg_connections() -> int:
    engine = sa.create_engine(POSTGRES_SA_URL)
    try:
        with engine.connect() as conn:
            return int(conn.scalar(sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"))
                or 0) - 1
    finally:
        engine.dispose()


def per_task(counter: Counter[str], n: int, top: int = 12) -> list[tuple[str, float]]:
    return [(k, v / max(1, n)) for k, v in counter.most_common(top)]
