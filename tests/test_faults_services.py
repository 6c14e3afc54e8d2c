"""Faults of the services around the workers, on the real stack: Redis restarted empty, a
Redis connection blip, a PostgreSQL restart, and the producer killed mid-enqueue.

Each scenario test runs a function of tests/faultkit_scenarios.py on private servers (a
redis-server and a PostgreSQL cluster of their own, never the shared ones) with ``datagen
worker`` subprocesses, then checks the invariants: every prompt settled once, results
unique, Redis counters equal to SQL sums, budgets within their policy's bound. Faults that
the scenarios hit only by chance are reproduced on purpose by dedicated tests (a TCP proxy
that resets one Redis call, retries falling due while PostgreSQL is down).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from common import ledger_scripts
from common.keys import KOMBU_UNACKED, dataset_keys
from common.ledger import Ledger, LedgerState
from common.replies import text
from common.schema import prompts
from common.store import Store
from tests.conftest import make_settings
from tests.faultkit import PrivateRedis, PrivateTlsRedis, Sim, Workers, sim_faults, wait_for
from tests.faultkit_checks import settle
from tests.faultkit_pg import PrivatePostgres
from tests.faultkit_producer import producer_kill
from tests.faultkit_proxy import OutageProxy, ResetProxy
from tests.faultkit_scenarios import (
    postgres_restart,
    redis_blip,
    redis_loss,
    redis_outage,
    worker_kill,
)
from tests.faultkit_stack import Outcome, Stack, enqueue, wait_busy, write_manifest
from tests.helpers import enqueue_paths, running_worker, write_dataset

RECOVERY_LIMIT_S = 60.0
# Well under the default sweep (Settings.sweep_s) and the visibility timeout.
OUTAGE_RECOVERY_S = 30.0
PACED = {"decode_tok_per_s": 150, "mean_output_tokens": 80, "max_running_requests": 64}


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    with PrivateRedis() as server:
        yield server


# kombu's BRPOP takes a message and records it as unacked in a second round trip: a
# worker killed in between, or a BRPOP reply lost in a cut connection, leaves the message
# nowhere in Redis. The workers' SQL sweep sends it again, here within seconds.
QUICK_SWEEP = {"sweep_s": 2.0, "sweep_quiet_s": 5.0}


def _stack(tmp: Path, db: str, redis_server: PrivateRedis, sim: Sim,
           sweep: dict[str, float] | None = None, **kw: object) -> Stack:
    settings = make_settings(db, sim.url, redis_url=redis_server.url, heartbeat_s=1.0,
                             dead_after_s=5.0, **(sweep or {}))
    return Stack(settings, tmp, sim, redis=redis_server, **kw)  # type: ignore[arg-type]


def _loss(tmp: Path, private_redis: PrivateRedis, recover: str,
          pace: dict[str, int] = PACED) -> tuple[Outcome, Stack]:
    with Sim(tmp / "sim.jsonl", **pace) as sim:
        stack = _stack(tmp, f"sqlite:///{tmp / 'db.sqlite'}", private_redis, sim)
        return redis_loss(stack, per_dataset=100, losses=2, recover=recover), stack


def test_worker_sigkills_lose_nothing_and_leave_no_reservation(
    private_redis: PrivateRedis, tmp_path: Path
) -> None:
    """A killed worker's reservations are freed by the reaper, as its messages are: left
    behind, they would hold the dataset's admission short of its budget for good."""
    with Sim(tmp_path / "sim.jsonl", **PACED) as sim:
        stack = _stack(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", private_redis, sim,
                       sweep=QUICK_SWEEP)
        out = worker_kill(stack, per_dataset=100, kills=2)
    out.check.assert_ok()  # every prompt settled once, counters = SQL, no reservation left
    assert len(out.faults) == 2 and all("SIGKILL" in f for f in out.faults)
    assert out.check.states == {"done": 200}
    assert max(out.recovery_s) < RECOVERY_LIMIT_S, out.recovery_s


def test_worker_sigkills_over_tls_lose_nothing(tmp_path: Path) -> None:
    """``rediss://`` takes kombu's Redis transport over TLS: the workers, the producer
    and the reaper reach a TLS-only Redis that they verify, and killed workers lose
    nothing."""
    with PrivateTlsRedis() as server, Sim(tmp_path / "sim.jsonl", **PACED) as sim:
        stack = _stack(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", server, sim,
                       sweep=QUICK_SWEEP)
        out = worker_kill(stack, per_dataset=100, kills=2)
    out.check.assert_ok()
    assert len(out.faults) == 2 and out.check.states == {"done": 200}
    assert max(out.recovery_s) < RECOVERY_LIMIT_S, out.recovery_s


def test_redis_restart_with_total_data_loss_then_enqueue_rerun(
    private_redis: PrivateRedis, tmp_path: Path
) -> None:
    # The workers rebuild a Redis that lost its data on their own, at once; the re-run, a
    # process of its own, ends seconds later. A slower pace leaves the second loss work
    # to hit when it comes.
    out, stack = _loss(tmp_path, private_redis, "enqueue", {**PACED, "decode_tok_per_s": 50})
    out.check.assert_ok()
    assert len(out.faults) == 2 and all("enqueue" in f for f in out.faults)
    assert out.check.states["done"] == 200 + stack.store.prompt_counts("rl_cap")["done"]
    assert out.notes["capped_closed_after_each_loss"] == [True, True]
    assert stack.store.dataset("rl_cap").close_reason == "budget"
    for name in ("rl_a", "rl_b", "rl_cap"):  # the ledger has its terms back, from SQL
        assert stack.ledger.state(name).budget_tokens == stack.store.dataset(name).budget.tokens
    assert_in_flight_only_repeated(out, stack)
    assert max(out.recovery_s) < RECOVERY_LIMIT_S, out.recovery_s


def test_redis_restart_with_total_data_loss_then_requeue_lost(
    private_redis: PrivateRedis, tmp_path: Path
) -> None:
    out, stack = _loss(tmp_path, private_redis, "requeue")
    assert len(out.faults) == 2 and all("requeue_lost" in f for f in out.faults)
    assert out.check.states["done"] == 200 + stack.store.prompt_counts("rl_cap")["done"]
    assert_in_flight_only_repeated(out, stack)
    assert out.notes["capped_closed_after_each_loss"] == [True, True]
    out.check.assert_ok()


def assert_in_flight_only_repeated(out: Outcome, stack: Stack) -> None:
    """Only a sample in flight at a loss is generated again: its task retries when its
    charge meets the dead Redis, and the recovery republishes its still-queued prompt, so
    it costs three requests at most; every other sample costs one."""
    assert out.check.requests_max <= 3
    assert out.check.regenerated <= len(out.faults) * stack.workers * stack.concurrency


def test_redis_connection_blip_costs_at_most_one_extra_request(
    private_redis: PrivateRedis, tmp_path: Path
) -> None:
    with Sim(tmp_path / "sim.jsonl", **PACED) as sim:
        stack = _stack(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", private_redis, sim,
                       sweep=QUICK_SWEEP)
        out = redis_blip(stack, per_dataset=40, blips=1, grace_s=8.0)
    out.check.assert_ok()  # no reservation left either (see the aimed blip below)
    # Celery's consumer restart puts back every message the worker holds; a BRPOP reply lost
    # with a killed connection is the workers' quick sweep's to send again.
    assert out.notes["stranded_until_sweep"] == 0
    assert out.check.states == {"done": 80}
    assert (out.check.lost, out.check.duplicated, out.check.drift) == (0, 0, 0)
    assert "connections" in out.faults[0] and not out.faults[0].endswith(": 0 connections")
    assert out.check.requests_max <= 2  # the re-queued duplicate costs one request at most
    assert max(out.recovery_s) < RECOVERY_LIMIT_S


def test_a_redis_outage_strands_no_prompt(private_redis: PrivateRedis, tmp_path: Path) -> None:
    """Redis unreachable for 4 s, its data kept, while every slot has a request in flight
    (the ``redis-outage`` scenario of ``python -m bench.reliability``, small)."""
    with OutageProxy(private_redis.port) as proxy, \
            Sim(tmp_path / "sim.jsonl", **PACED) as sim:
        settings = make_settings(f"sqlite:///{tmp_path / 'db.sqlite'}", sim.url,
                                 redis_url=proxy.url, heartbeat_s=1.0, dead_after_s=5.0,
                                 **QUICK_SWEEP)
        stack = Stack(settings, tmp_path, sim, redis=private_redis, outage=proxy)
        out = redis_outage(stack, per_dataset=40, outages=1, down_s=4.0, grace_s=8.0)
    out.check.assert_ok()
    assert out.notes["stranded_until_sweep"] == 0
    assert out.check.states == {"done": 80}
    assert (out.check.lost, out.check.duplicated, out.check.drift) == (0, 0, 0)
    assert not out.faults[0].endswith(": 0 connections cut")
    assert max(out.recovery_s) < RECOVERY_LIMIT_S


def test_a_blip_during_a_ledger_call_strands_no_prompt_and_leaks_no_reservation(
    private_redis: PrivateRedis, sqlite_url: str, sim: str, tmp_path: Path
) -> None:
    """What a random CLIENT KILL does now and then (seen in the blip scenario at scale),
    aimed: every connection carrying the ledger's ADMIT script is reset while armed, after
    Redis has run it and before its answer comes back."""
    ledger = Ledger(private_redis.client())
    # The batched ADMIT, as a worker's admissions send it; loaded here, not through the proxy.
    admit_sha = ledger.redis.script_load(ledger_scripts.ADMIT_MANY).encode()
    with ResetProxy(private_redis.port, marker=admit_sha, drop="reply") as proxy:
        settings = make_settings(sqlite_url, sim, redis_url=proxy.url)
        enqueue_paths(settings, [str(write_dataset(tmp_path, "blip", 4))])
        store = Store(settings.database_url)
        proxy.armed.set()
        with running_worker(settings, concurrency=4):
            with contextlib.suppress(AssertionError):  # a fixed worker keeps retrying
                wait_for(lambda: proxy.resets and not ledger.state("blip").queued
                         and not ledger.redis.hlen("unacked"), 10, "every message taken")
            proxy.armed.clear()
            settled = settle(store, ["blip"], 10)
            state = ledger.state("blip")
            # Only for the message of a failure: which rids are held, and whether they are
            # still held a moment later (a request then in flight) or for good (a leak).
            held = _inflight(ledger, "blip")
            later = _inflight(ledger, "blip", after_s=3.0) if held else {}
    assert proxy.resets > 0
    assert settled, store.prompt_counts("blip")
    assert (state.inflight, state.reserved_tokens) == (0, 0), (
        f"held at settle: {held}; 3 s later: {later}; ADMIT answers dropped: {proxy.resets}")


def _inflight(ledger: Ledger, name: str, after_s: float = 0.0) -> dict[str, str]:
    time.sleep(after_s)
    raw = ledger.redis.hgetall(dataset_keys(name).inflight)
    return {text(k): text(v) for k, v in raw.items()}


@pytest.fixture(scope="module")
def pg_outcome(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    """One PostgreSQL restart run, shared by the two tests below."""
    tmp = tmp_path_factory.mktemp("pg")
    with PrivateRedis() as rs, PrivatePostgres() as pg, Sim(tmp / "sim.jsonl", **PACED) as sim:
        stack = _stack(tmp, pg.url, rs, sim, pg=pg)
        yield postgres_restart(stack, per_dataset=40, restarts=1, down_s=3.0, grace_s=6.0)


def test_postgres_restart_loses_and_duplicates_nothing(pg_outcome: Outcome) -> None:
    out = pg_outcome
    out.check.assert_ok()
    assert out.notes["stuck_until_enqueue_rerun"] == 0  # no operator needed
    assert out.check.states == {"done": 80}
    assert out.check.requests_max == 1  # nothing was generated twice
    assert max(out.recovery_s) < RECOVERY_LIMIT_S


def test_retries_due_while_postgres_is_down_are_not_dropped(tmp_path: Path) -> None:
    """Each sample's first request fails (HTTP 500); PostgreSQL goes down before the
    retries' countdown (1.5-3 s) runs out, so every retry starts during the outage."""
    with PrivateRedis() as rs, PrivatePostgres() as pg, \
            Sim(tmp_path / "sim.jsonl", decode_tok_per_s=0) as sim:
        settings = make_settings(pg.url, sim.url, redis_url=rs.url, retry_base_s=3.0,
                                 retry_max_s=3.0, max_attempts=5)
        stack = Stack(settings, tmp_path, sim, redis=rs, pg=pg, workers=1)
        enqueue(stack, write_manifest(stack, {"pgr": (8, None)}))
        sim_faults(sim.url, fail_next=8, error_status=500)
        with Workers(settings, tmp_path / "workers.log") as workers:
            workers.start("w0", 8)
            wait_for(lambda: _attempts(stack) == 8, 30, "8 first attempts recorded", 0.02)
            pg.restart(down_s=4.0)
            settled = settle(stack.store, ["pgr"], 15)
        assert settled, stack.store.prompt_counts("pgr")
        assert stack.store.prompt_counts("pgr") == {"done": 8}


def _attempts(stack: Stack) -> int:
    with stack.store.engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.sum(prompts.c.attempts))) or 0)


def test_producer_killed_mid_enqueue_loses_and_doubles_nothing(
    private_redis: PrivateRedis, tmp_path: Path
) -> None:
    fast = {"decode_tok_per_s": 0, "mean_output_tokens": 40, "max_running_requests": 128}
    with Sim(tmp_path / "sim.jsonl", **fast) as sim:
        stack = _stack(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", private_redis, sim,
                       concurrency=16)
        out = producer_kill(stack, prompts=2000, kills=1)
    assert "SIGKILL" in out.faults[0]
    assert out.notes == {"messages_missing_after_rerun": 0, "messages_doubled_after_rerun": 0}
    out.check.assert_ok()
    assert out.check.states == {"done": 2000}
    assert out.check.requests_max == 1


def test_tasks_whose_retry_cannot_be_sent_while_redis_is_away_are_not_delayed(
    private_redis: PrivateRedis, tmp_path: Path
) -> None:
    """Redis unreachable (a network outage that keeps its data) while every request is in
    flight: each task's charge fails, and so does sending its retry. Each sample must still
    be generated again within seconds of Redis answering, not be left to the sweep
    (minutes) or the visibility timeout (over ten minutes)."""
    direct = private_redis.client()
    ledger = Ledger(direct)
    with OutageProxy(private_redis.port) as proxy, \
            Sim(tmp_path / "sim.jsonl", decode_tok_per_s=0, latency_s=2.0) as sim:
        settings = make_settings(f"sqlite:///{tmp_path / 'db.sqlite'}", sim.url,
                                 redis_url=proxy.url, retry_base_s=0.5, retry_max_s=2.0,
                                 heartbeat_s=1.0, dead_after_s=5.0)
        stack = Stack(settings, tmp_path, sim, redis=private_redis, workers=1)
        enqueue(stack, write_manifest(stack, {"away": (8, None)}))
        with Workers(settings, tmp_path / "workers.log") as workers:
            workers.start("w0", 8)
            wait_busy(stack, ["away"], 8)
            proxy.down()  # every request is answered while Redis is away
            time.sleep(4.0)
            proxy.up()
            back = time.monotonic()
            settled = settle(stack.store, ["away"], OUTAGE_RECOVERY_S)
            waited = time.monotonic() - back
            assert settled, (stack.store.prompt_counts("away"), workers.text()[-3000:])
            # What the outage left behind is cleared by the running worker: a message put
            # back beside its retry is settled as a duplicate, and a reservation whose
            # release Redis did not take is freed by the reaper.
            wait_for(lambda: not direct.hlen(KOMBU_UNACKED) and _idle(ledger.state("away")),
                     OUTAGE_RECOVERY_S, "no message or reservation left")
    assert "could not send the retry" in workers.text()  # the outage met the retries
    # A threads pool cannot cancel a running task: the worker does not try at a connection
    # loss, so the log holds no traceback per task in flight, nor Celery's advice to.
    assert "Failed to cancel" not in workers.text()
    assert "In Celery 5.1" not in workers.text()
    assert stack.store.prompt_counts("away") == {"done": 8}
    assert waited < OUTAGE_RECOVERY_S
    assert ledger.state("away").samples == 8


def _idle(state: LedgerState) -> bool:
    return not (state.queued or state.inflight or state.reserved_tokens)
