"""A dataset closing under ``drain`` aborts its requests still queued inside the server
(they have produced nothing) and lets the running ones finish, on the GPU-physics
simulator with room for two running requests, so the others queue as on a loaded
SGLang. Nothing aborted is stored or charged; its prompt stays queued (not started)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
import sqlalchemy as sa

from common.closing import after_close
from common.ledger import Ledger
from common.schema import results
from common.settings import Settings
from common.sglang_client import SGLangClient
from common.store import Store
from tests.conftest import REDIS_URL, make_settings
from tests.faultkit import wait_for
from tests.helpers import assert_invariants, enqueue_paths, running_worker, write_dataset

RUNNING = 2
# Timing matters here (requests must queue on the server): not beside three test workers.
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def gpu_sim() -> Iterator[str]:
    from producer.template import BUNDLED_TOKENIZER
    from sim import SimConfig, SimServer

    # ~300-token outputs at ~50 tok/s a sequence, twice real time: a request runs ~3 s.
    server = SimServer(SimConfig(port=0, physics="gpu", time_scale=2.0, kv_tokens=20_000,
                                 max_running_requests=RUNNING, mean_output_tokens=300,
                                 tokenizer=str(BUNDLED_TOKENIZER)))
    yield server.start()
    server.stop()


def load(sim: str) -> dict[str, Any]:
    return dict(requests.get(f"{sim}/v1/loads", timeout=5).json()["loads"][0])


def stored_rids(store: Store, name: str) -> set[str]:
    with store.engine.connect() as conn:
        return set(conn.scalars(sa.select(results.c.rid).where(results.c.dataset == name)))


def test_a_drain_close_aborts_the_queued_requests_and_drains_the_running(
    gpu_sim: str, sqlite_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    requests.post(f"{gpu_sim}/sim/reset", timeout=5).raise_for_status()
    settings: Settings = make_settings(sqlite_url, gpu_sim, concurrency=12)
    enqueue_paths(settings, [str(write_dataset(tmp_path, "dq", 40))], max_new_tokens=2000)
    store, ledger = Store(settings.database_url), Ledger(redis.Redis.from_url(REDIS_URL))
    with running_worker(settings, concurrency=12):
        wait_for(lambda: load(gpu_sim)["num_running_reqs"] == RUNNING
                 and load(gpu_sim)["num_waiting_reqs"] >= 8, 30, "requests queued")
        # The running ones' started marks are written within workers/started.py's FLUSH_S.
        wait_for(lambda: len(ledger.inflight_rids("dq")) - len(ledger.queued_rids("dq"))
                 == RUNNING, 10, "the running ones marked started")
        ledger.close("dq", "manual")  # as `datagen purge` does, then the same after_close
        closed_at = time.time()
        after_close("dq", store=store, ledger=ledger, app=None,
                    client=SGLangClient(settings.sglang_urls))
        wait_for(lambda: ledger.state("dq").inflight == 0, 60, "the running ones drained")
        # Each charged before it is stored: wait for the rows too.
        wait_for(lambda: store.prompt_counts("dq").get("done", 0) == ledger.state("dq").samples,
                 30, "the drained ones stored")
    log = requests.get(f"{gpu_sim}/sim/requests", timeout=5).json()
    queued_aborts = [r for r in log if r["finish_type"] == "abort"
                     and r["completion_tokens"] == 0]
    assert len(queued_aborts) >= 8
    drained = [r for r in log if r["finish_type"] in ("stop", "length")
               and r["arrived_ts"] < closed_at < r["finished_ts"]]
    assert drained  # running at the close, finished after it and kept
    kept = stored_rids(store, "dq")
    assert {r["rid"] for r in drained} <= kept
    assert not kept & {r["rid"] for r in queued_aborts}
    counts = store.prompt_counts("dq")
    assert counts["done"] == len(kept) and counts["queued"] == 40 - len(kept)
    assert_invariants(store, ledger, ["dq"])  # nothing aborted was charged
