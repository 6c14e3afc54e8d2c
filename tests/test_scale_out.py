"""Several worker processes and two SGLang servers (stand-ins for two hosts) share the queues."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests

from common.budget import Budget
from common.ledger import Ledger
from common.store import Store
from tests.conftest import make_settings
from tests.helpers import assert_invariants, enqueue_paths, wait_settled, write_dataset

EXACT_BUDGET = 3_000


@pytest.fixture
def two_sims() -> Iterator[tuple[str, str]]:
    from sim import SimConfig, SimServer

    servers = [SimServer(SimConfig(port=0, decode_tok_per_s=2000, mean_output_tokens=80))
               for _ in range(2)]
    urls = tuple(s.start() for s in servers)
    yield urls  # type: ignore[misc]
    for s in servers:
        s.stop()


def test_three_workers_two_servers(
    two_sims: tuple[str, str], sqlite_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    settings = make_settings(sqlite_url, two_sims[0]).replace(sglang_urls=",".join(two_sims))
    enqueue_paths(settings, [str(write_dataset(tmp_path, n, 50)) for n in ("wide1", "wide2")])
    enqueue_paths(settings, [str(write_dataset(tmp_path, "capped", 100))],
                  Budget(EXACT_BUDGET, policy="exact"))
    env = {**os.environ, **settings.to_env()}
    workers = [
        subprocess.Popen([sys.executable, "-m", "ops.cli", "worker", "-c", "6",
                          "--loglevel", "WARNING", "-n", f"w{i}@localhost"],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for i in range(3)
    ]
    store = Store(settings.database_url)
    try:
        wait_settled(store, ["wide1", "wide2", "capped"], timeout_s=120)
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(60)
    ledger = Ledger(redis_client)
    assert_invariants(store, ledger, ["wide1", "wide2", "capped"])
    assert store.prompt_counts("wide1") == store.prompt_counts("wide2") == {"done": 50}
    assert ledger.state("capped").used_tokens == EXACT_BUDGET
    assert store.dataset("capped").state == "closed"
    served = [len(requests.get(f"{url}/sim/requests", timeout=5).json()) for url in two_sims]
    assert all(n > 20 for n in served), served
    with store.engine.connect() as conn:
        by_server = dict(conn.exec_driver_sql(
            "SELECT server, COUNT(*) FROM results GROUP BY server").all())
    assert set(by_server) == set(two_sims)
