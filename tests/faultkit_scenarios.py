"""Fault scenarios on Redis and PostgreSQL, each a function of its scale, returning what
it measured. The tests run them small; ``python -m bench.reliability`` runs them large."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from common.audit import requeue_lost
from common.celery_app import make_celery
from common.publish import Publisher
from tests.faultkit import Workers, held_unacked
from tests.faultkit_checks import check_run, load_requests, queued_open, quiesce, settle
from tests.faultkit_stack import (
    Outcome,
    Stack,
    enqueue,
    first_completion_after,
    now,
    rerun_enqueue,
    wait_busy,
    wait_progress,
    write_manifest,
)

SETTLE_S = float(os.environ.get("FAULTKIT_SETTLE_S", "120"))


def start_workers(stack: Stack) -> Workers:
    workers = Workers(stack.settings, stack.tmp / "workers.log")
    for i in range(stack.workers):
        workers.start(f"w{i}", stack.concurrency)
    return workers


def _wait_turn(stack: Stack, names: list[str], i: int, n: int, total: int) -> bool:
    """Wait for fault ``i`` of ``n``: at (i + 1)/(n + 2) of the run, or, when a recovery
    took longer, once half the worker slots' worth of samples is done again. False when
    too little work is left for the fault to hit anything."""
    slots = stack.workers * stack.concurrency
    target = max(total * (i + 1) // (n + 2), stack.done(names) + slots // 2)
    if target > total - slots:
        return False
    wait_progress(stack, names, target)
    return queued_open(stack.store, names) >= slots


def settle_reviving(stack: Stack, workers: Workers, names: list[str],
                    timeout_s: float = SETTLE_S) -> bool:
    """Settle while reviving crashed workers, as a supervisor would."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers.revive()
        if settle(stack.store, names, min(5.0, deadline - time.monotonic())):
            return True
    return False


def settle_or_stall(stack: Stack, workers: Workers, names: list[str], stall_s: float) -> bool:
    """Settle (reviving crashed workers); False as soon as no prompt has settled for
    ``stall_s`` while some are still queued: those are stranded, not merely slow."""
    deadline = time.monotonic() + SETTLE_S
    last, since = queued_open(stack.store, names), time.monotonic()
    while last and time.monotonic() < deadline:
        workers.revive()
        time.sleep(0.2)
        left = queued_open(stack.store, names)
        if left != last:
            last, since = left, time.monotonic()
        elif time.monotonic() - since > stall_s:
            return False
    return last == 0


def settle_or_sweep(stack: Stack, workers: Workers, names: list[str], grace_s: float) -> int:
    """Settle; if no prompt settles for ``grace_s`` while some are queued, those were
    stranded: count them, and recover them as the workers' sweep would after 5-10 minutes.
    Returns how many were stranded."""
    if settle_or_stall(stack, workers, names, grace_s):
        return 0
    stranded = queued_open(stack.store, names)
    requeue_lost(stack.store, stack.ledger.redis, Publisher(make_celery(stack.settings)), 0)
    settle_reviving(stack, workers, names)
    return stranded


def finish(stack: Stack, name: str, names: list[str], started: float, **kw: object) -> Outcome:
    entries = load_requests(log_file=stack.sim.log_file)
    check = check_run(stack.store, stack.ledger, names, entries=entries,
                      drain_bound_tokens=stack.drain_bound)
    return Outcome(name, check.prompts, check=check, elapsed_s=round(time.monotonic() - started, 1),
                   **kw)  # type: ignore[arg-type]


def redis_loss(stack: Stack, per_dataset: int, losses: int = 1,
               recover: str = "alternate") -> Outcome:
    """Redis (no persistence) crashes mid-run and comes back empty. Each loss is recovered
    by re-running ``datagen enqueue`` (``recover="enqueue"``), by the workers' own sweep,
    ``common.audit.requeue_lost`` (``"requeue"``), or by each in turn (``"alternate"``)."""
    assert stack.redis is not None
    started = time.monotonic()
    manifest = write_manifest(stack, {"rl_a": (per_dataset, None), "rl_b": (per_dataset, None),
                                      "rl_cap": (per_dataset, 400)})  # closes after ~5
    names = ["rl_a", "rl_b", "rl_cap"]
    enqueue(stack, manifest)
    faults, recovery, closed_after = [], [], []
    with start_workers(stack) as workers:
        _wait_closed(stack, "rl_cap")
        for i in range(losses):
            if not _wait_turn(stack, names[:2], i, losses, 2 * per_dataset):
                break
            stack.redis.restart_empty()
            back = now()
            faults.append(_recover(stack, manifest, recover, i))
            time.sleep(1.0)  # a worker the reconnect crashed has exited by now
            workers.revive()
            recovery.append(first_completion_after(stack, back))
            closed_after.append(stack.ledger.is_closed("rl_cap"))
        settle_reviving(stack, workers, names)
        quiesce(stack.ledger, names)
    notes = {"capped_closed_after_each_loss": closed_after, "worker_exits": workers.exits}
    return finish(stack, "Redis restart, all data lost", names, started, faults=faults,
                   recovery_s=recovery, notes=notes)


def _recover(stack: Stack, manifest: Path, how: str, i: int) -> str:
    if how == "enqueue" or (how == "alternate" and i % 2 == 0):
        rerun_enqueue(stack, manifest)
        return "redis crash, empty restart; `datagen enqueue` re-run"
    publisher = Publisher(make_celery(stack.settings))
    again = requeue_lost(stack.store, stack.ledger.redis, publisher, 0)
    return f"redis crash, empty restart; requeue_lost() sent {sum(again.values())}"


def _wait_closed(stack: Stack, name: str) -> None:
    deadline = time.monotonic() + SETTLE_S
    while stack.store.dataset(name).state != "closed":
        assert time.monotonic() < deadline, f"{name} never closed"
        time.sleep(0.1)


def redis_blip(stack: Stack, per_dataset: int, blips: int = 1, grace_s: float = 20.0) -> Outcome:
    """Every Redis client connection is killed (CLIENT KILL TYPE normal) while tasks run.
    Prompts stranded are counted and recovered (``settle_or_sweep``)."""
    redis_server = stack.redis
    assert redis_server is not None

    def blip() -> str:
        return f"CLIENT KILL TYPE normal: {redis_server.blip()} connections"

    return _while_busy(stack, "Redis connection blip", ["bl_a", "bl_b"], per_dataset, blips,
                       blip, grace_s)


def redis_outage(stack: Stack, per_dataset: int, outages: int = 1, down_s: float = 4.0,
                 grace_s: float = 20.0) -> Outcome:
    """Redis unreachable for ``down_s`` (every connection cut and refused; its data kept)
    while every worker slot has a request in flight, so tasks meet the outage in their
    ledger calls, their acks and the retries they send. Prompts stranded are counted and
    recovered (``settle_or_sweep``)."""
    proxy = stack.outage
    assert proxy is not None

    def outage() -> str:
        cut = proxy.down()
        time.sleep(down_s)
        proxy.up()
        return f"Redis unreachable for {down_s:.0f} s: {cut} connections cut"

    return _while_busy(stack, "Redis unreachable", ["ro_a", "ro_b"], per_dataset, outages,
                       outage, grace_s)


def _while_busy(stack: Stack, title: str, names: list[str], per_dataset: int, count: int,
                fault: Callable[[], str], grace_s: float) -> Outcome:
    """``count`` faults spread over a run, each once every worker slot has a request in
    flight; ``fault`` injects one (returning once the service is back) and describes it."""
    started = time.monotonic()
    enqueue(stack, write_manifest(stack, {n: (per_dataset, None) for n in names}))
    faults, recovery = [], []
    with start_workers(stack) as workers:
        for i in range(count):
            if not _wait_turn(stack, names, i, count, len(names) * per_dataset):
                break
            wait_busy(stack, names, stack.concurrency)
            faults.append(fault())
            recovery.append(first_completion_after(stack, now()))
        stranded = settle_or_sweep(stack, workers, names, grace_s)
        quiesce(stack.ledger, names)
    notes = {"stranded_until_sweep": stranded, "worker_exits": workers.exits}
    return finish(stack, title, names, started, faults=faults, recovery_s=recovery,
                  notes=notes)


def postgres_restart(stack: Stack, per_dataset: int, restarts: int = 1, down_s: float = 3.0,
                     grace_s: float = 10.0) -> Outcome:
    """PostgreSQL restarts (fast shutdown, down for ``down_s``) mid-run. Whenever no prompt
    settles for ``grace_s`` the prompts left queued without a message are counted and an
    operator's re-run of ``datagen enqueue`` recovers them; then the invariants are checked."""
    assert stack.pg is not None
    started = time.monotonic()
    names = ["pg_a", "pg_b"]
    manifest = write_manifest(stack, {n: (per_dataset, None) for n in names})
    enqueue(stack, manifest)
    faults, recovery, stuck = [], [], []
    with start_workers(stack) as workers:
        for i in range(restarts):
            if not _wait_turn(stack, names, i, restarts, 2 * per_dataset):
                break
            stack.pg.restart(down_s)
            back = now()
            faults.append(f"postgres fast shutdown, down {down_s:.0f}s, restart")
            try:
                recovery.append(first_completion_after(stack, back, grace_s))
            except AssertionError:  # stalled: nothing left to consume
                stuck.append(queued_open(stack.store, names))
                rerun_enqueue(stack, manifest)
                recovery.append(first_completion_after(stack, back))
        if not settle_or_stall(stack, workers, names, grace_s):
            stuck.append(queued_open(stack.store, names))
            rerun_enqueue(stack, manifest)
            settle_reviving(stack, workers, names)
        quiesce(stack.ledger, names)
    notes = {"stuck_until_enqueue_rerun": sum(stuck), "enqueue_reruns": len(stuck),
             "worker_exits": workers.exits}
    return finish(stack, "PostgreSQL restart", names, started, faults=faults,
                   recovery_s=recovery, notes=notes)


def worker_kill(stack: Stack, per_dataset: int, kills: int = 3) -> Outcome:
    """Workers SIGKILLed mid-generation, taking turns; each is replaced at once, as a
    supervisor would. Recovery is the time from a kill until every message the dead
    worker held unacked has been returned to its queue by the other workers' reaper."""
    started = time.monotonic()
    names = ["wk_a", "wk_b"]
    enqueue(stack, write_manifest(stack, {n: (per_dataset, None) for n in names}))
    faults, recovery = [], []
    with start_workers(stack) as workers:
        for i in range(kills):
            if not _wait_turn(stack, names, i, kills, 2 * per_dataset):
                break
            wait_busy(stack, names, stack.concurrency)
            victim = sorted(workers.procs)[i % len(workers.procs)]
            held = _wait_holding(stack, victim)
            workers.kill(victim)
            faults.append(f"SIGKILL of worker {victim} holding {len(held)} unacked messages")
            recovery.append(_returned_s(stack, held))
            workers.start(f"{victim}k", stack.concurrency)
        settle_reviving(stack, workers, names)
        quiesce(stack.ledger, names)
    return finish(stack, "worker SIGKILL", names, started, faults=faults,
                  recovery_s=recovery)


def _wait_holding(stack: Stack, worker: str) -> set[str]:
    deadline = time.monotonic() + 30
    while not (held := held_unacked(stack.ledger.redis, worker)):
        assert time.monotonic() < deadline, f"{worker} never held a message"
        time.sleep(0.05)
    return held


def _returned_s(stack: Stack, held: set[str], limit_s: float = 180.0) -> float:
    """Seconds until each held tag has left ``unacked`` (a returned message may be taken
    again at once under the same tag, so each counts from the first time it is gone)."""
    killed_at, waiting = time.monotonic(), set(held)
    while waiting:
        assert time.monotonic() - killed_at < limit_s, f"{len(waiting)} messages never came back"
        waiting = {t for t in waiting if stack.ledger.redis.hexists("unacked", t)}
        time.sleep(0.05)
    return time.monotonic() - killed_at
