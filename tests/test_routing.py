"""Requests go to the server with the most headroom by the servers' /v1/loads, polled once
per interval for the whole fleet; a server without a reading keeps its round-robin share."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests
import sqlalchemy as sa

from common.keys import SERVER_LOADS, SERVER_LOADS_LOCK
from common.routing import LoadRouter
from common.schema import results
from common.server_loads import ServerLoad, fetch_load, fetch_loads, parse_loads
from common.store import Store
from ops.localredis import free_port
from sim import SimConfig, SimServer
from tests.conftest import make_settings
from tests.helpers import enqueue_paths, running_worker, wait_settled, write_dataset
from workers.context import load_router
from workers.load_poller import poll_once

A, B, C = "http://a:30000", "http://b:30000", "http://c:30000"


def load(running: int, waiting: int = 0, *, max_running: int = 10, used: int = 0,
         queued_tokens: int = 0, max_tokens: int = 100_000, at: float = 1000.0) -> ServerLoad:
    return ServerLoad(running=running, waiting=waiting, used_tokens=used,
                      total_tokens=used + queued_tokens, max_total_tokens=max_tokens,
                      max_running=max_running, gen_throughput=0.0, cache_hit_rate=0.0,
                      retracted_waiting=0, polled_at=at)


def test_a_load_answer_is_summed_over_its_ranks() -> None:
    rank = {"num_running_reqs": 3, "num_waiting_reqs": 2, "num_used_tokens": 900,
            "num_total_tokens": 1500, "max_total_num_tokens": 10_000,
            "max_running_requests": 8, "gen_throughput": 120.5, "cache_hit_rate": 0.5,
            "queues": {"waiting": 2, "grammar": 0, "paused": 0, "retracted": 1}}
    got = parse_loads({"loads": [rank, {**rank, "cache_hit_rate": 0.25}]}, polled_at=5.0)
    assert got == ServerLoad(running=6, waiting=4, used_tokens=1800, total_tokens=3000,
                             max_total_tokens=20_000, max_running=16, gen_throughput=241.0,
                             cache_hit_rate=0.375, retracted_waiting=2, polled_at=5.0)
    assert got.token_usage == pytest.approx(0.09)
    assert ServerLoad.from_json(got.to_json()) == got


@pytest.mark.parametrize("body", [None, {}, {"loads": []}, {"loads": [3]},
                                  {"loads": [{"num_running_reqs": "many"}]}])
def test_an_answer_without_sglangs_shape_is_refused(body: object) -> None:
    with pytest.raises(ValueError):
        parse_loads(body)


def test_pressure_is_the_nearer_of_request_slots_and_kv_tokens() -> None:
    assert load(5, max_running=10).pressure() == 0.5
    assert load(5, 10, max_running=10).pressure() == 1.5  # a queue reads above 1
    assert load(5, max_running=10).pressure(extra_requests=3) == 0.8
    # Few requests, but their tokens fill the KV pool.
    assert load(2, used=90_000, queued_tokens=9_000).pressure() == pytest.approx(0.99)


def test_each_pick_goes_to_the_least_full_server_counting_what_it_sent() -> None:
    router = LoadRouter((A, B), stale_after_s=10)
    router.update({A: load(8), B: load(2)})  # B has 8 free slots, A 2
    picks = Counter(router.pick(now=1001) for _ in range(10))
    # B takes the first 6 (2 + 6 = A's 8), then they alternate, ties to the rotation's turn.
    assert picks[B] == 8 and picks[A] == 2
    # A new reading resets what was counted against it.
    router.update({A: load(0, at=1002), B: load(10, at=1002)})
    assert router.pick(now=1003) == A


def test_a_server_without_a_reading_keeps_its_round_robin_share() -> None:
    router = LoadRouter((A, B, C), stale_after_s=10)
    router.update({A: load(9), B: load(0), C: None})
    picks = Counter(router.pick(now=1001) for _ in range(300))
    assert picks[C] == 100  # its turn in the rotation, every third pick
    assert picks[B] > picks[A]  # the others' turns go by load


def test_stale_readings_or_none_at_all_mean_round_robin() -> None:
    router = LoadRouter((A, B), stale_after_s=10)
    assert [router.pick(now=1001) for _ in range(4)] == [A, B, A, B]
    router.update({A: load(10, at=1000), B: load(0, at=1000)})
    assert [router.pick(now=1011) for _ in range(4)] == [A, B, A, B]  # 11 s old
    # An older reading than the one held changes nothing.
    router.update({B: load(10, at=999)})
    assert router.loads()[B].running == 0


def test_a_router_only_where_there_is_a_choice(sqlite_url: str) -> None:
    one = make_settings(sqlite_url, A)
    assert load_router(one) is None
    assert load_router(one.replace(sglang_urls=(A, B), load_poll_s=0)) is None
    router = load_router(one.replace(sglang_urls=(A, B)))
    assert router is not None and router.urls == (A, B)


@pytest.fixture(scope="module")
def fast_and_slow() -> Iterator[tuple[str, str]]:
    """Two servers of 4 slots each, one eight times the other's decode speed."""
    common = {"port": 0, "max_running_requests": 4, "mean_output_tokens": 30}
    with SimServer(SimConfig(decode_tok_per_s=400, **common)) as fast, \
            SimServer(SimConfig(decode_tok_per_s=50, **common)) as slow:
        assert fast.url and slow.url
        yield fast.url, slow.url


def test_the_fleet_polls_once_per_interval_and_shares_the_readings(
        fast_and_slow: tuple[str, str], redis_client: redis.Redis) -> None:
    fast, slow = fast_and_slow
    silent = f"http://127.0.0.1:{free_port()}"
    urls = (fast, slow, silent)
    first = poll_once(redis_client, urls, interval_s=30)
    assert first[silent] is None and fetch_load(silent) is None
    assert first[fast] is not None and first[fast].max_running == 4
    assert set(redis_client.hkeys(SERVER_LOADS)) == {fast.encode(), slow.encode()}
    assert redis_client.pttl(SERVER_LOADS_LOCK) > 0
    # Another process in the same interval reads what the first one wrote: the same
    # readings, to the polled_at, and no new request to the servers.
    second = poll_once(redis_client, urls, interval_s=30)
    assert second == first
    again = fetch_loads([fast])[fast]
    assert again is not None and again.polled_at > first[fast].polled_at != 0


def test_a_slow_server_gets_fewer_requests(fast_and_slow: tuple[str, str], tmp_path: Path,
                                           sqlite_url: str, redis_client: redis.Redis) -> None:
    """Round robin would send each half; by load, the fast server takes most of them."""
    fast, slow = fast_and_slow
    for url in fast_and_slow:
        requests.post(f"{url}/sim/reset", timeout=5).raise_for_status()
    settings = make_settings(sqlite_url, fast, sglang_urls=(fast, slow), load_poll_s=0.1)
    enqueue_paths(settings, [str(write_dataset(tmp_path, "mix", 160))])
    store = Store(settings.database_url)
    with running_worker(settings, concurrency=16):
        wait_settled(store, ["mix"], timeout_s=120, client=redis_client)
    with store.engine.connect() as conn:
        served = Counter(conn.execute(sa.select(results.c.server)).scalars())
    assert sum(served.values()) == 160
    # Capacity is 8:1; round robin gives 80 each. Well clear of both: a fast share
    # of at least 65%.
    assert served[fast] >= 0.65 * 160, json.dumps(served)
