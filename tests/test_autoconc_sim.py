"""Concurrency auto against the GPU-physics simulator, with a real worker: the limit
follows the server's capacity, holds through a change of speed, and the server never
sees more requests at once than the gate allows; a fixed concurrency N still sends N."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests

from common.concurrency import AutoLimit, LimitState
from common.keys import AUTO_LIMITS
from common.settings import Settings
from sim import SimConfig, SimServer
from tests.conftest import make_settings
from tests.helpers import enqueue_paths, running_worker, write_dataset

CAP = 8  # the server's running cap
CTRL = AutoLimit()
POLL_S = 0.1
GUARD_S = 120.0  # a bound on a test that would hang, never a figure the test checks


@pytest.fixture
def gpu_sim() -> Iterator[str]:
    cfg = SimConfig(port=0, physics="gpu", max_running_requests=CAP, mean_output_tokens=300,
                    time_scale=10.0)
    with SimServer(cfg) as srv:
        assert srv.url
        yield srv.url


def faults(url: str, **changes: float) -> None:
    requests.post(f"{url}/sim/faults", json=changes, timeout=5).raise_for_status()


def peak_in_flight(url: str) -> int:
    """The most requests the server held at once, from its request log."""
    log = requests.get(f"{url}/sim/requests", timeout=10).json()
    events = sorted([(e["arrived_ts"], 1) for e in log] +
                    [(e["finished_ts"], -1) for e in log if e.get("finished_ts")])
    peak = held = 0
    for _, delta in events:
        held += delta
        peak = max(peak, held)
    return peak


class Limits:
    """The fleet's limit at one server, one entry per poll seen."""

    def __init__(self, client: redis.Redis, url: str) -> None:
        self.client, self.url = client, url
        self.by_poll: dict[int, int] = {}

    def latest(self) -> LimitState | None:
        raw = self.client.hget(AUTO_LIMITS, self.url)
        state = LimitState.from_json(raw) if raw else None
        if state is not None:
            self.by_poll[state.polls] = state.limit
        return state

    def until_poll(self, polls: int) -> None:
        deadline = time.monotonic() + GUARD_S
        while time.monotonic() < deadline:
            state = self.latest()
            if state is not None and state.polls >= polls:
                return
            time.sleep(POLL_S / 2)
        raise TimeoutError(f"the limit was not stepped {polls} times")

    def between(self, first: int, last: int) -> list[int]:
        return [v for p, v in sorted(self.by_poll.items()) if first <= p <= last]


def auto_settings(db: str, url: str) -> Settings:
    return make_settings(db, url, concurrency="auto", max_concurrency=32, load_poll_s=POLL_S)


def band(capacity: int) -> tuple[int, int]:
    goal = capacity + CTRL.queue(capacity)
    return goal - CTRL.deadband(goal) - 1, goal


def test_the_limit_follows_capacity_and_holds_through_a_speed_change(
        gpu_sim: str, tmp_path: Path, sqlite_url: str, redis_client: redis.Redis) -> None:
    settings = auto_settings(sqlite_url, gpu_sim)
    enqueue_paths(settings, [str(write_dataset(tmp_path, "auto", 2000))],
                  max_new_tokens=600)
    limits = Limits(redis_client, gpu_sim)
    with running_worker(settings, concurrency=settings.threads):
        limits.until_poll(30)
        low, high = band(CAP)
        assert all(low <= x <= high for x in limits.between(15, 30)), limits.by_poll
        # Three times slower: the same requests run at once, so the limit holds.
        faults(gpu_sim, time_scale=3.0)
        limits.until_poll(60)
        assert all(low <= x <= high for x in limits.between(31, 60)), limits.by_poll
        # Half the running cap: the limit moves to the new level within 15 polls and
        # stays there.
        faults(gpu_sim, time_scale=10.0, max_running_requests=CAP // 2)
        limits.until_poll(90)
        low, high = band(CAP // 2)
        assert all(low <= x <= high for x in limits.between(76, 90)), limits.by_poll
        # The threads still holding messages finish them fast: a worker stops only once
        # they are done, and one left running would write to the next test's Redis.
        faults(gpu_sim, time_scale=1000.0, max_running_requests=CAP)
    # Counted at the server: never more at once than the highest limit (the cap's).
    assert peak_in_flight(gpu_sim) <= band(CAP)[1]


def test_a_fixed_concurrency_still_sends_n(gpu_sim: str, tmp_path: Path, sqlite_url: str,
                                           redis_client: redis.Redis) -> None:
    settings = make_settings(sqlite_url, gpu_sim, concurrency=5, load_poll_s=POLL_S)
    enqueue_paths(settings, [str(write_dataset(tmp_path, "fixed", 60))], max_new_tokens=600)
    with running_worker(settings, concurrency=5) as app:
        deadline = time.monotonic() + GUARD_S
        while requests.get(f"{gpu_sim}/sim/stats", timeout=5).json()["completed"] < 30:
            assert time.monotonic() < deadline, "the worker did not get through 30 samples"
            time.sleep(0.2)
        assert app.datagen_context.gate is None  # type: ignore[attr-defined]
    assert peak_in_flight(gpu_sim) == 5
