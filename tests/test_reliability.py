"""Faults on the real stack: worker processes killed with SIGKILL mid-generation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests

from common.ledger import Ledger
from common.settings import Settings
from common.store import Store
from tests.conftest import make_settings
from tests.faultkit import held_unacked
from tests.helpers import assert_invariants, enqueue_paths, wait_settled, write_dataset

RECOVERY_LIMIT_S = 60.0


@pytest.fixture(scope="module")
def paced_sim() -> Iterator[str]:
    """About a second per request, so every kill catches requests in flight."""
    from sim import SimConfig, SimServer

    server = SimServer(SimConfig(port=0, decode_tok_per_s=300, mean_output_tokens=300,
                                 max_running_requests=64))
    url = server.start()
    yield url
    server.stop()


def start_worker(settings: Settings, name: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, **settings.to_env()}
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "worker", "-c", "8", "--loglevel", "INFO",
             "-n", f"{name}@localhost"],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )


def kill_and_time_recovery(
    client: redis.Redis, proc: subprocess.Popen[bytes], worker: str
) -> float:
    # A worker's start takes seconds, and much longer on a machine busy with other work.
    deadline = time.monotonic() + 90
    while not held_unacked(client, worker):
        assert time.monotonic() < deadline, f"{worker} never held a message"
        time.sleep(0.05)
    held = held_unacked(client, worker)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = time.monotonic()
    while any(client.hexists("unacked", t) for t in held):
        assert time.monotonic() - killed_at < RECOVERY_LIMIT_S * 2, "messages never came back"
        time.sleep(0.2)
    return time.monotonic() - killed_at


def test_three_sigkills_across_two_workers_lose_nothing(
    paced_sim: str, sqlite_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    requests.post(f"{paced_sim}/sim/reset", timeout=5).raise_for_status()
    # A worker killed between kombu's BRPOP of a message and its unacked record leaves the
    # message nowhere in Redis: the workers' SQL sweep sends it again, here within seconds.
    settings = make_settings(sqlite_url, paced_sim, heartbeat_s=1.0, dead_after_s=5.0,
                             sweep_s=2.0, sweep_quiet_s=5.0)
    names = ["k1", "k2"]
    # Enough work that the third victim, started after two kills, still finds messages to
    # hold when the workers run fast (16 in flight at about a second each).
    per_dataset = 240
    enqueue_paths(settings, [str(write_dataset(tmp_path, n, per_dataset)) for n in names])
    log = tmp_path / "workers.log"
    procs = {"a": start_worker(settings, "a0", log), "b": start_worker(settings, "b0", log)}
    recoveries = []
    try:
        for i, slot in enumerate(["a", "b", "a"]):
            current = procs[slot]
            recoveries.append(kill_and_time_recovery(redis_client, current, f"{slot}{i // 2}"))
            procs[slot] = start_worker(settings, f"{slot}{i // 2 + 1}", log)
        store = Store(settings.database_url)
        wait_settled(store, names, timeout_s=120, client=redis_client, log=log)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    assert len(recoveries) == 3 and max(recoveries) < RECOVERY_LIMIT_S, recoveries
    assert_invariants(store, Ledger(redis_client), names)
    for n in names:
        assert store.prompt_counts(n) == {"done": per_dataset}
