"""Fixtures on real services: Redis (a dedicated DB, flushed before and after each test),
SQLite and PostgreSQL (the same store tests on both), the simulator over HTTP, and a
real Celery worker with the threads pool. Under pytest-xdist each worker has a Redis DB
and a PostgreSQL database of its own (tests/isolation.py)."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
import sqlalchemy as sa

import common.db
from common.ledger import Ledger
from common.schema import metadata
from common.settings import Settings
from common.store import Store
from tests import isolation, leftovers

REDIS_URL = isolation.redis_url(isolation.REDIS_BASE, isolation.worker_id())
POSTGRES_URL = isolation.postgres_url(isolation.POSTGRES_BASE, isolation.worker_id())
ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "prompts"


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, check before any worker starts that the last one has a Redis DB."""
    workers = getattr(config.option, "numprocesses", None)
    if isolation.worker_id() is None and workers:
        try:
            isolation.redis_url(isolation.REDIS_BASE, f"gw{workers - 1}")
        except isolation.IsolationError as exc:
            raise pytest.UsageError(str(exc)) from None


def pytest_sessionstart(session: pytest.Session) -> None:
    """The PostgreSQL database of this run (an xdist worker's own, or the one
    DATAGEN_TEST_POSTGRES_URL names) exists before the first test. A server that does not
    answer is left to the tests that need it to report."""
    with contextlib.suppress(sa.exc.OperationalError):
        isolation.create_database(sa.make_url(POSTGRES_URL))


# Every engine the code under test opens, so that each test's pooled connections are
# closed when it ends: tests make stores freely, and an engine dropped without dispose()
# keeps its connections until the collector finds it. Four xdist workers doing that ran
# PostgreSQL out of its 100 connections.
_ENGINES: weakref.WeakSet[sa.Engine] = weakref.WeakSet()
_pooled_engine = common.db.pooled_engine


def _tracked_engine(*args: Any, **kwargs: Any) -> sa.Engine:
    engine = _pooled_engine(*args, **kwargs)
    _ENGINES.add(engine)
    return engine


common.db.pooled_engine = _tracked_engine  # type: ignore[assignment]


@pytest.fixture(autouse=True)
def _close_pooled_connections() -> Iterator[None]:
    """After each test, close the connections its engines hold idle. An engine stays usable
    (a module's store opens new ones when next asked); one in use keeps its connection."""
    yield
    for engine in list(_ENGINES):
        engine.dispose()


@pytest.fixture(scope="module", autouse=True)
def _no_datagen_process_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """A module's ``datagen`` subprocesses end with it (tests/leftovers.py says why)."""
    yield
    left = leftovers.datagen_children()
    if left:
        leftovers.end(list(left))
        warnings.warn(f"{request.module.__name__} left running: {sorted(left.values())}",
                      stacklevel=1)


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def _fresh_postgres() -> str:
    engine = sa.create_engine(POSTGRES_URL)
    metadata.drop_all(engine)
    engine.dispose()
    return POSTGRES_URL


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'datagen.db'}"
    return _fresh_postgres()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'datagen.db'}"


@pytest.fixture(scope="session")
def sim_server() -> Iterator[str]:
    from producer.template import BUNDLED_TOKENIZER
    from sim import SimConfig, SimServer

    server = SimServer(
        SimConfig(port=0, decode_tok_per_s=0, mean_output_tokens=60, max_running_requests=64,
                  tokenizer=str(BUNDLED_TOKENIZER))
    )
    url = server.start()
    yield url
    server.stop()


@pytest.fixture
def sim(sim_server: str) -> str:
    """The shared simulator, with its request log and faults reset for this test."""
    requests.post(f"{sim_server}/sim/reset", timeout=5).raise_for_status()
    return sim_server


def make_settings(db: str, sim_url: str, **overrides: object) -> Settings:
    base = Settings(
        redis_url=REDIS_URL,
        database_url=db,
        sglang_urls=(sim_url,),
        request_timeout_s=30,
        max_attempts=3,
        retry_base_s=0.05,
        retry_max_s=0.2,
        concurrency=16,
    )
    return base.replace(**overrides)


@pytest.fixture
def settings(db_url: str, sim: str, redis_client: redis.Redis) -> Settings:
    return make_settings(db_url, sim)


@pytest.fixture
def store(settings: Settings) -> Store:
    return Store(settings.database_url)


@pytest.fixture
def ledger(redis_client: redis.Redis) -> Ledger:
    return Ledger(redis_client)


@pytest.fixture(scope="session")
def remote_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer folder whose class is Python code (ops/build_remote_tokenizer.py),
    built once per session; transformers loads it only with trust_remote_code=True."""
    from ops.build_remote_tokenizer import write

    folder = tmp_path_factory.mktemp("tokenizers") / "datagen_remote_tokenizer"
    write(folder)
    return folder


@pytest.fixture(scope="session")
def code_sim(remote_tokenizer: Path) -> Iterator[str]:
    """A simulator whose tokenizer is that Python-code one."""
    from sim import SimConfig, SimServer

    server = SimServer(SimConfig(port=0, decode_tok_per_s=0, mean_output_tokens=40,
                                 max_running_requests=64, tokenizer=str(remote_tokenizer),
                                 trust_remote_code=True))
    yield server.start()
    server.stop()
