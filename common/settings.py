"""The one typed settings object every datagen process builds from its environment.

Nothing else in the project reads ``os.environ``: command-line flags override fields with
:meth:`Settings.replace`, and the object is passed down explicitly.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from common.errors import ConfigError

ENV_PREFIX = "DATAGEN_"
# A worker at full rate had up to 7 connections out at once, but 230 of its 239 checkouts
# found at most one other out; the server's max_connections has to cover every process's
# share (docs/PERFORMANCE.md, "A 100-node SGLang fleet").
DEFAULT_DB_CONNECTIONS = 4


def _split_urls(raw: str) -> tuple[str, ...]:
    urls = tuple(u.strip().rstrip("/") for u in raw.split(",") if u.strip())
    if not urls:
        raise ConfigError("DATAGEN_SGLANG_URL is empty: give at least one http://host:port")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"DATAGEN_SGLANG_URL entry {url!r} must start with http:// or https://")
    return urls


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
    # Worker concurrency: a threads pool sized to the SGLang running-request capacity.
    concurrency: int = 64
    # Most connections one process holds to PostgreSQL (SQLite: not limited). A worker's
    # threads share them: its grouped steps need one or two at a time.
    db_connections: int = DEFAULT_DB_CONNECTIONS
    default_budget_tokens: int = 10_000_000
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
    sglang_api_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        # With one, a read made while the thread holds a connection (inside a streamed
        # query's loop) would wait for itself until the pool's timeout.
        if self.db_connections < 2:
            raise ConfigError(
                f"{ENV_PREFIX}DB_CONNECTIONS={self.db_connections} must be at least 2")

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
    try:
        if isinstance(default, bool):
            return raw.strip().lower() in {"1", "true", "yes", "on"}
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
    except ValueError:
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a number") from None
    return raw
