"""The one typed settings object every datagen process builds from its environment.

Nothing else in the project reads ``os.environ``: command-line flags override fields with
:meth:`Settings.replace`, and the object is passed down explicitly.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from common.errors import ConfigError
from common.order import check_seed

ENV_PREFIX = "DATAGEN_"
# ``concurrency`` that sizes itself from the servers' loads (workers/gate.py).
AUTO: Literal["auto"] = "auto"
# A worker at full rate had up to 7 connections out at once, but 230 of its 239 checkouts
# found at most one other out; the server's max_connections has to cover every process's
# share (docs/PERFORMANCE.md, "A 100-node SGLang fleet").
DEFAULT_DB_CONNECTIONS = 4


# The databases datagen runs on, and the SQLAlchemy drivers it installs for them.
DATABASES = {"sqlite": ("pysqlite",), "postgresql": ("psycopg",)}
REDIS_SCHEMES = ("redis", "rediss", "unix")
# The least value of each numeric setting, and whether that value itself is allowed.
LEAST: dict[str, tuple[float, bool]] = {
    "request_timeout_s": (0, False),
    "connect_timeout_s": (0, False),
    "max_attempts": (1, True),
    "retry_base_s": (0, True),
    "retry_max_s": (0, True),
    "concurrency": (1, True),
    "max_concurrency": (1, True),
    # With one, a read made while the thread holds a connection (inside a streamed query's
    # loop) would wait for itself until the pool's timeout.
    "db_connections": (2, True),
    "default_budget_tokens": (1, True),
    "default_seed": (0, True),
    "heartbeat_s": (0, False),
    "dead_after_s": (0, False),
    "sweep_s": (0, False),
    "sweep_quiet_s": (0, True),
    "start_wait_s": (0, False),
    "stop_after_failures": (0, True),
    "load_poll_s": (0, True),
    "progress_every_s": (0, True),
    "metrics_port": (0, True),
}
MAX_PORT = 65535


def env_name(field_name: str) -> str:
    """The environment variable of a settings field."""
    return ENV_PREFIX + ("SGLANG_URL" if field_name == "sglang_urls" else field_name.upper())


def masked(url: str) -> str:
    """``url`` with any password replaced by ``***``, for messages, parsable or not."""
    return re.sub(r"(//[^/@:]*:)[^/@]*@", r"\1***@", url)


def _split_urls(raw: str) -> tuple[str, ...]:
    urls = tuple(u.strip().rstrip("/") for u in raw.split(",") if u.strip())
    if not urls:
        raise ConfigError("DATAGEN_SGLANG_URL is empty: give at least one http://host:port")
    return urls


def _check_http_url(url: str) -> None:
    where = f"DATAGEN_SGLANG_URL entry {masked(url)!r}"
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{where} must start with http:// or https://")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsed here so that a bad port is named now
    except ValueError as exc:
        raise ConfigError(f"{where} is not a URL: {exc}") from None
    if not parts.hostname:
        raise ConfigError(f"{where} names no host: give http://host:port")


def check_redis_url(url: str) -> None:
    """ConfigError unless ``url`` is a Redis URL redis-py and kombu both read the same way."""
    where = f"DATAGEN_REDIS_URL={masked(url)!r}"
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in REDIS_SCHEMES:
        raise ConfigError(f"{where} is not a Redis URL: give redis://[:password@]host:port/db "
                          "(or rediss:// for TLS, unix:///path.sock)")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsed here so that a bad port is named now
    except ValueError as exc:
        raise ConfigError(f"{where} is not a Redis URL: {exc}") from None
    db = parts.path.strip("/")
    if scheme != "unix" and db and not db.isdigit():
        # redis-py would quietly use database 0, kombu fail on it later.
        raise ConfigError(f"{where}: the database after the last / must be a number, "
                          f"not {db!r}")


def check_database_url(url: str) -> None:
    """ConfigError unless ``url`` names a database of ``DATABASES`` that datagen can open."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    where = f"DATAGEN_DATABASE_URL={masked(url)!r}"
    supported = "use sqlite:///path.db or postgresql://user:password@host:5432/db"
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://"):]
    try:
        parsed = make_url(url)
        parsed.port  # noqa: B018 - parsed here so that a bad port is named now
    except (ArgumentError, ValueError):
        raise ConfigError(f"{where} is not a database URL; {supported}") from None
    name, _, driver = parsed.drivername.partition("+")
    if name not in DATABASES:
        raise ConfigError(f"{where}: unsupported database {name!r}; datagen runs on "
                          f"{' and '.join(DATABASES)}: {supported}")
    if driver and driver not in DATABASES[name]:
        raise ConfigError(f"{where}: unsupported driver {driver!r} for {name}; use "
                          f"{name}+{DATABASES[name][0]}:// or {name}://")


@dataclass(frozen=True)
class Settings:
    redis_url: str = "redis://127.0.0.1:6379/0"
    database_url: str = "sqlite:///datagen.db"
    sglang_urls: tuple[str, ...] = ("http://127.0.0.1:30000",)
    tokenizer: str = ""
    # Load a tokenizer whose class is Python code beside its files (Kimi K2's): that runs
    # the code, so only when asked.
    trust_remote_code: bool = False
    # A non-streaming /generate sends nothing until the sample is complete, so the read
    # timeout is the hard upper bound of one request, and of one task.
    request_timeout_s: float = 1800.0
    connect_timeout_s: float = 5.0
    max_attempts: int = 5
    retry_base_s: float = 2.0
    retry_max_s: float = 60.0
    # Requests a worker has in flight: "auto" keeps each server busy with a small queue,
    # by its /v1/loads (workers/gate.py); a number is a threads pool of that size.
    concurrency: int | Literal["auto"] = AUTO
    # Under "auto": the worker's threads, the most requests it can ever have in flight.
    max_concurrency: int = 256
    # Most connections one process holds to PostgreSQL (SQLite: not limited). A worker's
    # threads share them: its grouped steps need one or two at a time.
    db_connections: int = DEFAULT_DB_CONNECTIONS
    default_budget_tokens: int = 10_000_000
    # The shuffle seed of a dataset created without --seed (common/order.py).
    default_seed: int = 0
    # Liveness: a worker silent for dead_after_s has its unacked messages returned at once.
    heartbeat_s: float = 5.0
    dead_after_s: float = 20.0
    # The SQL sweep: every sweep_s one worker republishes the prompts SQL holds as queued,
    # untouched for sweep_quiet_s, that Redis has neither queued nor unacked (a Redis that
    # lost its data, or a worker killed between kombu's BRPOP of a message and its record).
    sweep_s: float = 300.0
    sweep_quiet_s: float = 300.0
    # A worker started before Redis or the database waits this long for them (one line per
    # service every few seconds), then exits 3 for its supervisor to start it again.
    start_wait_s: float = 600.0
    # A dataset whose prompts fail this many times in a row with the same permanent error
    # (a 400 every sample gets) is stopped rather than failed prompt by prompt; 0: never.
    stop_after_failures: int = 5
    # With several servers, each request goes to the one with the most headroom by their
    # /v1/loads, read every load_poll_s by one worker for all; 0: round robin.
    load_poll_s: float = 1.0
    # Where stderr is no terminal (compose logs, CI), enqueue, export and validate write a
    # progress line this often; 0 writes one at every step.
    progress_every_s: float = 5.0
    # The port a worker serves Prometheus's /metrics on; 0: not served. One port per
    # process: two workers on one host need two ports (a container has its own).
    metrics_port: int = 0
    sglang_api_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        """Every value checked once, here, whether it came from the environment, a flag or
        code: a bad one stops the command with a message naming its variable."""
        for name, (least, allowed) in LEAST.items():
            value = getattr(self, name)
            if name == "concurrency" and value == AUTO:
                continue
            if not math.isfinite(value):
                raise ConfigError(f"{env_name(name)}={value} is not a finite number")
            if value < least or (value == least and not allowed):
                bound = f"at least {least:g}" if allowed else f"above {least:g}"
                raise ConfigError(f"{env_name(name)}={value} must be {bound}")
        if self.metrics_port > MAX_PORT:
            raise ConfigError(f"{env_name('metrics_port')}={self.metrics_port} is not a port: "
                              f"give 1-{MAX_PORT}, or 0 for none")
        check_seed(self.default_seed, env_name("default_seed"))
        check_redis_url(self.redis_url)
        check_database_url(self.database_url)
        for url in self.sglang_urls:
            _check_http_url(url)

    @property
    def auto_concurrency(self) -> bool:
        return self.concurrency == AUTO

    @property
    def threads(self) -> int:
        """The worker's threads: ``concurrency``, or under "auto" ``max_concurrency``."""
        return self.max_concurrency if self.concurrency == AUTO else int(self.concurrency)

    @property
    def visibility_timeout_s(self) -> int:
        """Above the longest possible task (one request plus its retries' waits).

        Every process (producer, worker, CLI, Flower) uses this same value: the Redis
        transport lets any consumer sweep unacked messages older than *its own* timeout
        back into the queue, so a shorter value anywhere would run a live task twice.
        """
        return int(self.request_timeout_s + self.connect_timeout_s + self.retry_max_s + 600)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        base = cls()
        kwargs: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if f.name == "sglang_urls":
                raw = env.get(ENV_PREFIX + "SGLANG_URL", raw)
            if raw is None or raw == "":
                continue
            kwargs[f.name] = _parse(f.name, raw, getattr(base, f.name))
        return cls(**kwargs)  # type: ignore[arg-type]

    def to_env(self) -> dict[str, str]:
        """The environment that rebuilds these settings in a child process."""
        env = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "sglang_urls":
                env[ENV_PREFIX + "SGLANG_URL"] = ",".join(value)
            elif value != "":
                env[ENV_PREFIX + f.name.upper()] = str(value)
        return env

    def replace(self, **overrides: object) -> Settings:
        """Apply command-line flags; ``None`` means the flag was not given."""
        given = {k: v for k, v in overrides.items() if v is not None}
        if isinstance(given.get("sglang_urls"), str):
            given["sglang_urls"] = _split_urls(str(given["sglang_urls"]))
        return dataclasses.replace(self, **given)  # type: ignore[arg-type]


def _parse(name: str, raw: str, default: object) -> object:
    if name == "sglang_urls":
        return _split_urls(raw)
    if name == "concurrency":
        return _parse_concurrency(raw)
    try:
        if isinstance(default, bool):
            return raw.strip().lower() in {"1", "true", "yes", "on"}
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
    except ValueError:
        kind = "a whole number" if isinstance(default, int) else "a number"
        raise ConfigError(f"{env_name(name)}={raw!r} is not {kind}") from None
    return raw.strip()


def _parse_concurrency(raw: str) -> int | Literal["auto"]:
    if raw.strip().lower() == AUTO:
        return AUTO
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{env_name('concurrency')}={raw!r} is not a whole number or "
                          f"{AUTO}") from None
