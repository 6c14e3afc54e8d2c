"""Concurrency auto: the controller on hand-made readings, the gate, the setting."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from itertools import pairwise

import pytest
import redis

from common.auto_limits import process_limits, read_limits, step_limits
from common.concurrency import AutoLimit, LimitState, share
from common.errors import ConfigError
from common.keys import AUTO_LIMITS, WORKERS
from common.server_loads import ServerLoad
from common.settings import AUTO, Settings
from ops.cli import build_parser
from workers.command import worker_argv
from workers.gate import Gate, GateTimeout

CTRL = AutoLimit()


def reading(running: int, waiting: int = 0, *, max_running: int = 48, used: int = 0,
            max_tokens: int = 159_000, retracted: int = 0) -> ServerLoad:
    return ServerLoad(running=running, waiting=waiting, used_tokens=used, total_tokens=used,
                      max_total_tokens=max_tokens, max_running=max_running,
                      gen_throughput=0.0, cache_hit_rate=0.0, retracted_waiting=retracted,
                      polled_at=0.0)


class Server:
    """A server that runs at most ``capacity`` requests, fed by a fleet that fills its
    limit at once but whose requests leave only ``turnover`` per poll (a queued request
    waits for a running one to end): the lag that makes a naive controller swing."""

    def __init__(self, capacity: int, turnover: int = 3, max_running: int = 48) -> None:
        self.capacity, self.turnover, self.max_running = capacity, turnover, max_running
        self.inflight = 0

    def follow(self, limit: int) -> ServerLoad:
        if limit >= self.inflight:
            self.inflight = limit
        else:
            self.inflight = max(limit, self.inflight - self.turnover)
        running = min(self.inflight, self.capacity)
        return reading(running, self.inflight - running, max_running=self.max_running)


def run(server: Server, polls: int, state: LimitState | None = None) -> list[int]:
    limits = []
    load = server.follow(CTRL.start)
    for _ in range(polls):
        state = CTRL.step(state, load)
        limits.append(state.limit)
        load = server.follow(state.limit)
    return limits


def direction_changes(limits: list[int]) -> int:
    moves = [b - a for a, b in pairwise(limits) if b != a]
    return sum(1 for a, b in pairwise(moves) if (a > 0) != (b > 0))


@pytest.mark.parametrize("capacity", [11, 40, 48])
def test_the_limit_settles_at_capacity_plus_a_small_queue(capacity: int) -> None:
    limits = run(Server(capacity), 40)
    goal = capacity + CTRL.queue(capacity)
    # Settled within 12 polls, then still for the rest, within the deadband of the goal.
    assert all(abs(x - goal) <= CTRL.deadband(goal) for x in limits[12:]), limits
    assert len(set(limits[12:])) == 1, limits
    # On the way: at most one overshoot and its correction, never a swing back and forth.
    assert direction_changes(limits) <= 1, limits


def test_a_step_in_capacity_moves_the_limit_to_the_new_level_without_swinging() -> None:
    server = Server(40)
    before = run(server, 20)
    server.capacity = 20  # half the server's KV pool gone
    state = LimitState(before[-1], 0, 20)
    after = run(server, 30, state)
    goal = 20 + CTRL.queue(20)
    assert abs(after[-1] - goal) <= CTRL.deadband(goal)
    assert all(abs(x - goal) <= CTRL.deadband(goal) for x in after[10:]), after
    assert direction_changes(after) == 0, after  # straight down, then still
    server.capacity = 40
    again = run(server, 30, LimitState(after[-1], 0, 50))
    assert abs(again[-1] - (40 + CTRL.queue(40))) <= CTRL.deadband(44)
    assert direction_changes(again) <= 1, again


def test_a_fleet_short_of_work_does_not_raise_its_limit() -> None:
    state = LimitState(30, 0, 5)
    # 10 in flight of the 30 allowed, nothing waits: no evidence more would run.
    assert CTRL.step(state, reading(10)).limit == 30
    # Filling its limit with room left: half way to every slot and a queue (48 + 3).
    assert CTRL.step(state, reading(30)).limit == 30 + 11


def test_new_retractions_hold_the_limit_and_old_ones_do_not_count_again() -> None:
    state = LimitState(30, 0, 5)
    # Room left by the reading, but the server just retracted: no rise.
    held = CTRL.step(state, reading(30, 0, retracted=2))
    assert held.limit == 30 and held.retracted_waiting == 2
    # The same retracted requests still waiting: the server's running count, plus a
    # queue, as for any saturated reading.
    assert CTRL.step(held, reading(30, 2, retracted=2)).limit == 33 - 1
    # New retractions with a long queue: down to the running count plus a queue, as
    # without them (a server that retracts is saturated), never below.
    assert CTRL.step(LimitState(40, 0, 5), reading(20, 20, retracted=3)).limit == 31


def test_the_limit_at_most_doubles_in_a_step() -> None:
    # Short requests and a nearly empty pool: room for all 48 slots, reached by doubling,
    # so that the first readings of what runs come before the whole burst.
    limits, state = [], None
    for running in (0, 2, 4, 8):
        state = CTRL.step(state, reading(running, used=running * 800))
        limits.append(state.limit)
    assert limits == [2, 4, 8, 16]


def test_room_left_is_what_the_kv_pool_holds_at_twice_the_running_requests_size() -> None:
    # The agentic shape (6K-token prompts, 8K-token outputs, 159K KV tokens) at its start:
    # 8 requests just prefilled hold 6K each. At that size the pool would hold 26, but
    # they grow: at twice it, 13, what the shape keeps running once the pool is full.
    start = reading(8, used=48_000)
    assert CTRL.room(LimitState(8, 0, 3), start) == 13
    assert CTRL.step(LimitState(8, 0, 3), start).limit == 12  # half way to 13 + 2
    # 12 running of 10K each: no room for more than run now, and none is taken away.
    assert CTRL.room(LimitState(12, 0, 5), reading(12, used=120_000)) == 12
    assert CTRL.room(LimitState(12, 0, 5), reading(12, used=1200)) == 48  # slots first


def test_a_full_kv_pool_is_saturation_and_the_cap_bounds_the_limit() -> None:
    state = LimitState(30, 0, 5)
    assert CTRL.step(state, reading(20, used=155_000)).limit == 26  # 20 + 2 queued, half way
    assert CTRL.step(LimitState(60, 0, 5), reading(8, max_running=8)).limit == 10  # 8 + 2


def test_a_worker_takes_its_share_of_the_fleets_limit() -> None:
    assert share(44, 1) == 44
    assert share(44, 3) == 15
    assert share(1, 4) == 1
    assert share(10, 0) == 10  # before any heartbeat


def test_the_state_is_read_back_as_written() -> None:
    state = LimitState(17, 2, 9)
    assert LimitState.from_json(state.to_json()) == state


# -- the gate -------------------------------------------------------------------------------

A, B = "http://a:1", "http://b:1"


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate((A, B), fallback=5, ready_s=0.0)
    g.set_limits({A: 2, B: 1})
    yield g


def test_the_gate_never_lets_more_than_the_limit_through(gate: Gate) -> None:
    held: list[str] = []
    seen_max = {A: 0, B: 0}
    lock = threading.Lock()
    go = threading.Event()

    def task() -> None:
        with gate.slot(lambda: A) as slot:
            with lock:
                held.append(slot.server)
                counts = gate.inflight()
                for url in (A, B):
                    seen_max[url] = max(seen_max[url], counts[url])
            go.wait(10)

    threads = [threading.Thread(target=task) for _ in range(6)]
    for t in threads:
        t.start()
    while len(held) < 3:  # 2 at A, the third at B, which has room
        threading.Event().wait(0.01)
    assert sorted(held) == [A, A, B] and gate.inflight() == {A: 2, B: 1}
    go.set()
    for t in threads:
        t.join(10)
    assert len(held) == 6 and seen_max == {A: 2, B: 1}
    assert gate.inflight() == {A: 0, B: 0}


def test_tasks_take_places_in_the_order_they_came() -> None:
    """The order the messages came in (the dataset's order, next turns ahead) is the
    order requests leave in, whether places free one by one or the limit rises."""
    order: list[int] = []
    lock = threading.Lock()
    go = threading.Event()

    def task(i: int) -> None:
        with gate.slot(lambda: A):
            with lock:
                order.append(i)
            go.wait(10)

    gate = Gate((A,), fallback=1, ready_s=0.0)
    gate.set_limits({A: 1})
    first = threading.Thread(target=task, args=(0,))
    first.start()
    threads = [first]
    for i in range(1, 9):
        threads.append(threading.Thread(target=task, args=(i,)))
        threads[-1].start()
        deadline = time.monotonic() + 10
        while gate.waiting() < i and time.monotonic() < deadline:
            time.sleep(0.001)
    assert gate.waiting() == 8 and order == [0]
    gate.set_limits({A: 5})  # four places at once: the four that came first
    deadline = time.monotonic() + 10
    while gate.waiting() > 4 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert order == [0, 1, 2, 3, 4]
    go.set()  # every place frees: the rest, still in order
    for t in threads:
        t.join(10)
    assert order == list(range(9))


def test_a_place_is_given_back_once_even_on_error(gate: Gate) -> None:
    with pytest.raises(RuntimeError), gate.slot(lambda: A) as slot:
        slot.release()  # the answer came in
        raise RuntimeError("store failed")
    assert gate.inflight() == {A: 0, B: 0}


def test_a_task_gives_up_its_wait_before_its_message_could_come_back() -> None:
    gate = Gate((A,), fallback=1, ready_s=0.0, max_wait_s=0.2)
    with gate.slot(lambda: A), pytest.raises(GateTimeout), gate.slot(lambda: A):
        pass
    assert gate.inflight() == {A: 0}


class Seen(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_server_without_a_load_gets_the_fallback(gate: Gate) -> None:
    # Straight on the gate's logger, enabled: a worker started earlier in this process
    # may have configured logging so that it is off, above WARNING, or short of root.
    logger, seen = logging.getLogger("workers.gate"), Seen()
    disabled, level = logger.disabled, logger.level
    logger.disabled = False
    logger.setLevel(logging.WARNING)
    logger.addHandler(seen)
    try:
        gate.set_limits({A: None, B: 3})
        gate.set_limits({A: None, B: 3})
    finally:
        logger.removeHandler(seen)
        logger.disabled = disabled
        logger.setLevel(level)
    assert gate.limits() == {A: 5, B: 3}
    assert sum("publishes no load" in m for m in seen.messages) == 1


# -- the setting ----------------------------------------------------------------------------

def test_concurrency_is_auto_by_default_or_a_number() -> None:
    assert Settings().concurrency == AUTO and Settings().threads == Settings().max_concurrency
    fixed = Settings.from_env({"DATAGEN_CONCURRENCY": "12"})
    assert fixed.concurrency == 12 and fixed.threads == 12 and not fixed.auto_concurrency
    auto = Settings.from_env({"DATAGEN_CONCURRENCY": "Auto", "DATAGEN_MAX_CONCURRENCY": "32"})
    assert auto.auto_concurrency and auto.threads == 32
    assert Settings.from_env(auto.to_env()) == auto
    with pytest.raises(ConfigError, match="whole number or auto"):
        Settings.from_env({"DATAGEN_CONCURRENCY": "many"})


# -- the fleet's limits in Redis ------------------------------------------------------------

def test_the_poller_steps_one_controller_and_every_worker_takes_its_share(
        redis_client: redis.Redis) -> None:
    urls = (A, B)
    first = step_limits(redis_client, {A: reading(0), B: None}, interval_s=1.0)
    assert set(first) == {A}
    # Another worker's poll steps the same state on: the controller outlives the lock.
    second = step_limits(redis_client, {A: reading(first[A].limit), B: None}, interval_s=1.0)
    assert second[A].polls == 2 and second[A].limit > first[A].limit
    assert read_limits(redis_client, list(urls)) == second
    assert redis_client.pttl(AUTO_LIMITS) > 0
    now = time.time()
    redis_client.zadd(WORKERS, {"w1": now, "w2": now, "w3": now, "gone": now - 60})
    mine = process_limits(redis_client, second, urls, dead_after_s=20)
    assert mine == {A: share(second[A].limit, 3), B: None}
    # A server that stops publishing its load loses its state: it gets the fallback.
    step_limits(redis_client, {A: None, B: None}, interval_s=1.0)
    assert read_limits(redis_client, list(urls)) == {}


def test_the_worker_flag_takes_auto_or_a_number(capsys: pytest.CaptureFixture[str]) -> None:
    auto = build_parser().parse_args(["worker", "--concurrency", "auto"])
    # Celery's pool then takes the app's threads, DATAGEN_MAX_CONCURRENCY.
    assert not any(a.startswith("--concurrency") for a in worker_argv(auto))
    fixed = build_parser().parse_args(["worker", "-c", "12"])
    assert worker_argv(fixed)[-1] == "--concurrency=12"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "-c", "many"])
    assert "'many' is not a whole number or auto" in capsys.readouterr().err
