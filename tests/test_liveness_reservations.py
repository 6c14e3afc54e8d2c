"""The reaper frees reservations that no live worker claims, and only those."""

from __future__ import annotations

import time

import redis

from common.budget import Budget
from common.keys import WORKERS, worker_rids
from common.ledger import Admission, Ledger
from workers.liveness import release_orphaned_reservations

GRACE_S = 5.0


def reserved(client: redis.Redis, name: str, *rids: str) -> Ledger:
    """A dataset with a reservation of 500 tokens for each of ``rids``."""
    ledger = Ledger(client)
    ledger.configure(name, Budget(100_000))
    for rid in rids:
        assert ledger.admit(name, rid, 1000, 500) is Admission.ADMITTED
    return ledger


def claimed(client: redis.Redis, worker: str, rid: str) -> None:
    """A live worker's heartbeat publishing ``rid`` as in flight."""
    client.zadd(WORKERS, {worker: time.time()})
    client.sadd(worker_rids(worker), rid)


def test_an_unclaimed_reservation_is_freed_after_the_grace_and_a_claimed_one_never(
    redis_client: redis.Redis,
) -> None:
    ledger = reserved(redis_client, "orph", "dead-rid", "live-rid")
    claimed(redis_client, "alive@host", "live-rid")
    suspects: dict[tuple[str, str], float] = {}

    assert release_orphaned_reservations(redis_client, suspects, 100.0, GRACE_S) == 0
    assert release_orphaned_reservations(redis_client, suspects, 104.0, GRACE_S) == 0
    assert sorted(ledger.inflight_rids("orph")) == ["dead-rid", "live-rid"]
    assert release_orphaned_reservations(redis_client, suspects, 105.0, GRACE_S) == 1
    assert ledger.inflight_rids("orph") == ["live-rid"]
    assert ledger.state("orph").reserved_tokens == 500
    assert release_orphaned_reservations(redis_client, suspects, 500.0, GRACE_S) == 0
    assert suspects == {}


def test_a_reservation_claimed_before_the_grace_ends_is_kept(
    redis_client: redis.Redis,
) -> None:
    """A rid admitted just after its worker's beat is unclaimed until the next beat."""
    ledger = reserved(redis_client, "late", "new-rid")
    suspects: dict[tuple[str, str], float] = {}
    assert release_orphaned_reservations(redis_client, suspects, 10.0, GRACE_S) == 0
    claimed(redis_client, "w@host", "new-rid")  # the next beat
    assert release_orphaned_reservations(redis_client, suspects, 20.0, GRACE_S) == 0
    assert ledger.inflight_rids("late") == ["new-rid"]
    assert suspects == {}


def test_a_sweep_that_meets_redis_away_leaves_the_heartbeat_running() -> None:
    """An error from the sweep, its lock's SET included, is logged: raised, it would end
    the heartbeat's thread and the worker would look dead to the others."""
    from ops.localredis import free_port
    from workers.liveness import Heartbeat, Received

    away = redis.Redis(port=free_port(), socket_connect_timeout=0.5)
    beat = Heartbeat(None, away, "away@host", Received(), 1.0, 5.0,  # type: ignore[arg-type]
                     sweep_s=0.0)
    beat._maybe_sweep()  # Connection refused, logged, not raised
