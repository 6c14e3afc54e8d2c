"""GroupCall: many threads' calls served by shared batch calls, each thread answered with
its own item's result or error, and a failed batch never stranding a later caller."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from workers.grouping import GroupCall


class Gate(BaseException):
    """Not an Exception: a batch that raises it must still release the other callers."""


def test_each_caller_gets_its_own_result_and_calls_share_batches() -> None:
    sizes: list[int] = []
    release = threading.Event()

    def batch(items: list[int]) -> list[int]:
        release.wait(5)  # the first batch holds, so the others queue up behind it
        sizes.append(len(items))
        return [i * i for i in items]

    group: GroupCall[int, int] = GroupCall(batch, max_group=8, linger_s=0.001)
    with ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(group, i) for i in range(200)]
        release.set()
        results = [f.result(timeout=10) for f in futures]
    assert results == [i * i for i in range(200)]
    assert sum(sizes) == 200 and max(sizes) <= 8
    assert len(sizes) < 200 and (group.batches, group.items) == (len(sizes), 200)


def test_an_item_error_fails_only_that_item() -> None:
    def batch(items: list[int]) -> list[int | BaseException]:
        return [ValueError(f"bad {i}") if i % 3 == 0 else i for i in items]

    group: GroupCall[int, int] = GroupCall(batch, max_group=16, linger_s=0.005)

    def call(i: int) -> int | str:
        try:
            return group(i)
        except ValueError as exc:
            return str(exc)

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(call, range(48)))
    assert got == [f"bad {i}" if i % 3 == 0 else i for i in range(48)]


def test_a_failed_batch_fails_its_items_and_later_calls_still_run() -> None:
    calls = [0]

    def batch(items: list[int]) -> list[int]:
        calls[0] += 1
        if calls[0] == 1:
            raise ConnectionError("database away")
        return items

    group: GroupCall[int, int] = GroupCall(batch, max_group=4, linger_s=0)
    with pytest.raises(ConnectionError, match="database away"):
        group(1)
    assert group(2) == 2


def test_a_short_answer_is_an_error_for_every_item() -> None:
    group: GroupCall[int, int] = GroupCall(lambda items: items[:-1], max_group=4, linger_s=0)
    with pytest.raises(RuntimeError, match="answered 0 of 1 items"):
        group(1)


def test_a_base_exception_reaches_the_leader_and_the_waiters() -> None:
    entered, release = threading.Event(), threading.Event()

    def batch(items: list[int]) -> list[int]:
        entered.set()
        release.wait(5)
        raise Gate()

    group: GroupCall[int, int] = GroupCall(batch, max_group=8, linger_s=0)
    outcomes: list[str] = []

    def call(i: int) -> None:
        try:
            group(i)
        except Gate:
            outcomes.append("gate")

    leader = threading.Thread(target=call, args=(0,))
    leader.start()
    assert entered.wait(5)
    followers = [threading.Thread(target=call, args=(i,)) for i in range(1, 4)]
    for t in followers:
        t.start()
    release.set()
    for t in [leader, *followers]:
        t.join(10)
    # The leader's batch raised Gate; the followers' own batch (after it) raised it too.
    assert outcomes == ["gate"] * 4


def test_leaders_time_is_counted_as_wall_clock_and_as_cpu() -> None:
    """The worker reports both: CPU is the leading thread's own, so time it spends
    blocked (a slow database) shows in the wall clock and not in the CPU."""

    def batch(items: list[int]) -> list[int]:
        end = time.thread_time() + 0.02
        while time.thread_time() < end:  # 20 ms of this thread's CPU
            pass
        time.sleep(0.05)  # blocked: wall clock only
        return items

    group: GroupCall[int, int] = GroupCall(batch, max_group=4, linger_s=0)
    assert group(1) == 1
    assert group.serve_cpu_s >= 0.02
    assert group.serve_s - group.serve_cpu_s >= 0.04


def test_a_stopping_worker_reports_each_steps_groups_and_leaders_time(
        caplog: pytest.LogCaptureFixture) -> None:
    from workers.app import _report_groups

    admissions: GroupCall[int, int] = GroupCall(lambda items: items, max_group=4, linger_s=0)
    settlements: GroupCall[int, int] = GroupCall(lambda items: items, max_group=4, linger_s=0)
    for i in range(3):
        admissions(i)
    context = SimpleNamespace(admissions=admissions, settlements=settlements)
    with caplog.at_level(logging.INFO, logger="datagen.worker"):
        _report_groups(sender=SimpleNamespace(app=SimpleNamespace(datagen_context=context)))
    messages = [r.getMessage() for r in caplog.records]
    lines = [m for m in messages if "shared steps" in m]
    assert lines[0].startswith("shared steps: 3 admissions in 3 groups; a group's leader: ")
    assert lines[1].startswith("shared steps: 0 settlements in 0 groups")


def test_a_leader_waits_for_company_only_while_calls_come_closer_than_its_linger() -> None:
    group: GroupCall[int, int] = GroupCall(lambda items: items, max_group=8, linger_s=0.01)
    for i in range(5):  # calls 50 ms apart, each gap counted as at most 4 lingers (40 ms)
        group(i)
        time.sleep(0.05)
    assert group.gap_s == pytest.approx(0.04 * (1 - 0.8**4), rel=0.2)
    assert group.gap_s > group.linger_s

    # Sparse calls: a lone leader goes on at once instead of waiting out a 30 s linger.
    group.linger_s, group.gap_s = 30.0, 1000.0
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(group, 7).result(timeout=10) == 7
    # Dense calls: it waits its linger for company that may come.
    group.linger_s, group.gap_s = 0.3, 0.0
    started = time.monotonic()
    assert group(8) == 8
    assert time.monotonic() - started >= 0.3


def test_the_denser_the_calls_the_longer_a_leader_waits_for_company() -> None:
    # Sparser than the 20 ms that makes a leader wait at all, though closer than its wait.
    group: GroupCall[int, int] = GroupCall(lambda items: items, max_group=8, linger_s=0.2,
                                           dense_gap_s=0.02, busy_gap_s=0.005,
                                           busy_linger_s=0.5)
    group.gap_s = 0.05
    started = time.monotonic()
    assert group(1) == 1
    assert time.monotonic() - started < 0.2
    group.gap_s, group._last = 0.01, None  # dense: its whole 200 ms wait, not the 500
    started = time.monotonic()
    assert group(2) == 2
    assert 0.2 <= time.monotonic() - started < 0.5
    group.gap_s, group._last = 0.001, None  # busier than 5 ms apart: its 500 ms wait
    started = time.monotonic()
    assert group(3) == 3
    assert time.monotonic() - started >= 0.5


def test_a_lingering_leader_goes_on_once_enough_callers_wait() -> None:
    # Calls come densely (no gap yet), so the leader lingers; it stops at three callers,
    # not at the group's limit of eight nor after its 30 s linger.
    sizes: list[int] = []

    def batch(items: list[int]) -> list[int]:
        sizes.append(len(items))
        return items

    group: GroupCall[int, int] = GroupCall(batch, max_group=8, linger_s=30.0, enough=3)
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(group, i) for i in range(3)]
        assert [f.result(timeout=10) for f in futures] == [0, 1, 2]
    assert sizes == [3]
    assert GroupCall(batch, max_group=4, linger_s=0, enough=10).enough == 4


class _TracedLock:
    """A caller's wake-up lock that notes which thread released it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self.released_by: str | None = None

    def acquire(self) -> None:
        self._lock.acquire()

    def release(self) -> None:
        self.released_by = threading.current_thread().name
        self._lock.release()


def test_a_batch_wakes_all_its_callers_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each served caller holds a worker slot until it returns: the leader wakes every one
    # of them as soon as the batch is done, none waits for another to run first.
    from dataclasses import dataclass, field

    from workers import grouping

    pending: list[grouping._Pending[int, int]] = []

    @dataclass(eq=False)
    class Traced(grouping._Pending[int, int]):
        wake: _TracedLock = field(default_factory=_TracedLock)  # type: ignore[assignment]

        def __post_init__(self) -> None:
            pending.append(self)

    monkeypatch.setattr(grouping, "_Pending", Traced)
    group: GroupCall[int, int] = GroupCall(lambda items: items, max_group=6, linger_s=5.0)
    threads = [threading.Thread(target=group, args=(i,), name=f"caller-{i}") for i in range(6)]
    for i, t in enumerate(threads):  # one by one, so the group's order is 0..5
        t.start()
        deadline = time.monotonic() + 5
        while len(pending) <= i and time.monotonic() < deadline:
            time.sleep(0.001)
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert group.batches == 1
    by_item = {p.item: p.wake.released_by for p in pending}
    assert by_item == {0: None, **{i: "caller-0" for i in range(1, 6)}}
