"""The whole path of a prompt, on real Redis, SQL, the simulator and a real worker."""

from __future__ import annotations

from pathlib import Path

import requests
import sqlalchemy as sa

from common.ledger import Ledger
from common.schema import results
from common.settings import Settings
from common.store import Store
from common.tokenids import unpack
from tests.helpers import (
    assert_invariants,
    enqueue_paths,
    running_worker,
    wait_settled,
    write_dataset,
)


def test_three_datasets_end_to_end(
    settings: Settings, store: Store, ledger: Ledger, sim: str, tmp_path: Path
) -> None:
    paths = [str(write_dataset(tmp_path, name, 40)) for name in ("alpha", "beta", "gamma")]
    summaries = enqueue_paths(settings, paths)
    assert [s.enqueued for s in summaries] == [40, 40, 40]
    with running_worker(settings):
        wait_settled(store, ["alpha", "beta", "gamma"])
    assert_invariants(store, ledger, ["alpha", "beta", "gamma"])
    for name in ("alpha", "beta", "gamma"):
        assert store.prompt_counts(name) == {"done": 40}
    log = requests.get(f"{sim}/sim/requests", timeout=5).json()
    assert len(log) == 120  # one request per prompt, none repeated


def test_stored_ids_equal_what_the_server_sent(
    settings: Settings, store: Store, sim: str, tmp_path: Path
) -> None:
    enqueue_paths(settings, [str(write_dataset(tmp_path, "ids", 5))])
    with running_worker(settings, concurrency=4):
        wait_settled(store, ["ids"])
    with store.engine.connect() as conn:
        rows = conn.execute(sa.select(results.c.sample_id, results.c.output_ids,
                                      results.c.prompt_tokens)).all()
    assert len(rows) == 5
    for sample_id, output_ids, _ in rows:
        prompt = store.prompt("ids", sample_id)
        assert prompt is not None
        again = requests.post(f"{sim}/generate", json={
            "input_ids": prompt.input_ids,
            "sampling_params": {"max_new_tokens": prompt.max_new_tokens}}, timeout=10).json()
        assert output_ids == again["output_ids"]
        with store.engine.connect() as conn:
            raw = conn.scalar(sa.text("SELECT output_ids FROM results WHERE sample_id = :s"),
                              {"s": sample_id})
        assert unpack(bytes(raw)) == again["output_ids"]


def test_rerun_enqueues_nothing_done_or_queued(
    settings: Settings, store: Store, sim: str, tmp_path: Path
) -> None:
    path = str(write_dataset(tmp_path, "again", 10))
    first = enqueue_paths(settings, [path])
    assert first[0].enqueued == 10
    second = enqueue_paths(settings, [path])  # nothing consumed yet: all still queued
    assert (second[0].enqueued, second[0].already_queued) == (0, 10)
    with running_worker(settings, concurrency=4):
        wait_settled(store, ["again"])
    third = enqueue_paths(settings, [path])
    assert (third[0].enqueued, third[0].already_done) == (0, 10)
