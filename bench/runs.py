"""One measured leg: enqueue, start the consumer process(es), wait, read the server's log.

Rates come from the simulator's request log (the same clock for every kind of client):
completions over the busy window, from the first to the last completion. CPU seconds
of each process are sampled at the first completion and at the end of the window.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench.harness import (
    DATABASE,
    WORKDIR,
    Processes,
    context_switches,
    cpu_seconds,
    database_seconds,
    machine_seconds,
    main_thread,
    redis_pid,
    running,
    sim_completed,
    sim_requests,
    sim_reset,
    start_worker,
    wait_until,
)
from common.keys import queue_name
from common.schema import prompts
from common.settings import Settings
from common.store import Store

FINISHED = ("stop", "length")


@dataclass
class Leg:
    label: str
    completions: int = 0
    tokens: int = 0
    window_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)
    switches: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.completions / self.window_s if self.window_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.window_s if self.window_s > 0 else 0.0

    def cpu_ms_per_task(self, who: str) -> float:
        return 1000.0 * self.cpu_s.get(who, 0.0) / max(1, self.completions)

    def switches_per_task(self, who: str) -> float:
        return self.switches.get(who, 0) / max(1, self.completions)

    @property
    def worker_processes(self) -> int:
        """How many worker processes were measured (``worker0``, ``worker1``...)."""
        return sum(1 for k in self.cpu_s if k.startswith("worker") and k != "workers")


def busy_window(entries: list[dict[str, Any]], leg: Leg) -> Leg:
    """Fill ``leg`` from the log: completions and tokens after the first, over the window."""
    done = sorted((e for e in entries if e.get("status") == 200
                   and e.get("finish_type") in FINISHED), key=lambda e: e["finished_ts"])
    if len(done) >= 2:
        leg.window_s = done[-1]["finished_ts"] - done[0]["finished_ts"]
        leg.completions = len(done) - 1
        leg.tokens = sum(int(e["completion_tokens"]) for e in done[1:])
    leg.extra["requests"] = len(entries)
    return leg


Usage = tuple[dict[str, float], dict[str, int]]  # CPU seconds, context switches
# A leg whose server has finished nothing for this long is stuck (workers failing every
# task, a broken baseline checkout): it fails with that, instead of at its full timeout.
STALL_S = 60.0


def watch(sim_url: str, expected: int, pids: dict[str, int], timeout_s: float,
          stall_s: float = STALL_S, database_url: str = "") -> Usage:
    """Wait for ``expected`` finished requests; what ``pids`` used in between, and the
    database server's processes at ``database_url`` (``harness.database_seconds``: one
    that started in between is counted from its start, one that ended is left out)."""
    deadline = time.monotonic() + timeout_s
    start: Usage | None = None
    done, last, moved = 0, -1, time.monotonic()
    while time.monotonic() < deadline:
        done = sim_completed(sim_url)
        if start is None and done >= 1:
            start = _usage(pids, database_url)
        if done >= expected:
            end = _usage(pids, database_url)
            first = start or end
            return ({k: end[0][k] - first[0].get(k, 0.0) for k in end[0]},
                    {k: end[1][k] - first[1][k] for k in end[1]})
        gone = [k for k, pid in pids.items() if not running(pid)]
        if gone:
            raise RuntimeError(f"{', '.join(gone)} exited after {done} of {expected} requests; "
                               f"see the logs in {WORKDIR}")
        if done != last:
            last, moved = done, time.monotonic()
        elif time.monotonic() - moved > stall_s:
            raise TimeoutError(f"no request finished for {stall_s:.0f}s ({done} of {expected}); "
                               f"see the logs in {WORKDIR}")
        time.sleep(0.1)
    raise TimeoutError(f"only {done} of {expected} requests finished in {timeout_s:.0f}s")


# Key prefix of a worker's main thread (Celery's consumer) in a leg's CPU and switches.
MAIN = "main:"


def _usage(pids: dict[str, int], database_url: str = "") -> Usage:
    mains = {MAIN + k: main_thread(p) for k, p in pids.items() if k.startswith("worker")}
    database = database_seconds(database_url) if database_url else {}
    return ({**{k: cpu_seconds(p) for k, p in pids.items()}, **machine_seconds(), **database,
             **{k: cpu for k, (cpu, _) in mains.items()}},
            {**{k: context_switches(p) for k, p in pids.items()},
             **{k: n for k, (_, n) in mains.items()}})


def service_pids(settings: Settings) -> dict[str, int]:
    """The services a leg's CPU is also counted for (Redis, when it runs here)."""
    pid = redis_pid(settings.redis_url)
    return {"redis": pid} if pid else {}


def measured_leg(label: str, sim_url: str, cpu: dict[str, float],
                 switches: dict[str, int]) -> Leg:
    """The leg as the server's log and ``watch`` saw it, with every ``worker*`` process
    summed under "workers", their main threads under "consumers" and the database
    server's processes under "database"."""
    leg = busy_window(sim_requests(sim_url), Leg(label, cpu_s=cpu, switches=switches))
    for total, prefix in (("workers", "worker"), ("consumers", MAIN),
                          (DATABASE, f"{DATABASE}:")):
        leg.cpu_s[total] = sum(v for k, v in cpu.items() if k.startswith(prefix))
        leg.switches[total] = sum(v for k, v in switches.items() if k.startswith(prefix))
    return leg


def settled(store: Store) -> bool:
    q = sa.select(sa.func.count()).where(prompts.c.state == "queued")
    with store.engine.connect() as conn:
        return int(conn.scalar(q) or 0) == 0


def pipeline_leg(procs: Processes, label: str, settings: Settings, sim: tuple[str, int],
                 expected: int, *, workers: int = 1, timeout_s: float = 600,
                 on_start: Callable[[list[subprocess.Popen[bytes]]], None] | None = None) -> Leg:
    """``workers`` × ``datagen worker`` over what is enqueued; stopped before returning."""
    sim_reset(sim[0])
    started = [start_worker(procs, settings, settings.concurrency, tag=f"worker{k}")
               for k in range(workers)]
    try:
        cpu, switches = _watch_workers(started, settings, sim, expected, timeout_s, on_start)
        store = Store(settings.database_url)
        ok = wait_until(lambda: settled(store), 60, 0.5)
        store.engine.dispose()
        if not ok:
            raise TimeoutError(f"{label}: prompts still queued in SQL after the last response")
    finally:
        for proc in started:
            procs.stop(proc)
    return measured_leg(label, sim[0], cpu, switches)


def _watch_workers(started: list[subprocess.Popen[bytes]], settings: Settings,
                   sim: tuple[str, int], expected: int, timeout_s: float,
                   on_start: Callable[[list[subprocess.Popen[bytes]]], None] | None
                   ) -> tuple[dict[str, float], dict[str, int]]:
    """``watch`` the started workers (``worker0``, ``worker1``...), the simulator and the
    services until the server has answered ``expected`` requests."""
    if on_start:
        on_start(started)
    pids = {"sim": sim[1], **service_pids(settings),
            **{f"worker{k}": p.pid for k, p in enumerate(started)}}
    return watch(sim[0], expected, pids, timeout_s, database_url=settings.database_url)


def dump_payloads(settings: Settings, out: Path) -> list[str]:
    """{"dataset/sample_id": {input_ids, sampling, stream}} of every queued prompt; the
    queues."""
    store = Store(settings.database_url)
    payloads: dict[str, Any] = {}
    names = store.dataset_names()
    for name in names:
        ds = store.dataset(name)
        sampling = {k: v for k, v in ds.sampling.items() if k != "max_new_tokens"}
        sids = store.sample_ids(name, "queued")
        for start in range(0, len(sids), 64):  # the worker's group size: one SELECT each
            keys = [(name, sid) for sid in sids[start:start + 64]]
            for p in store.prompts(keys):
                assert p is not None
                payloads[f"{name}/{p.sample_id}"] = {
                    "input_ids": p.input_ids,
                    "sampling": {**sampling, "max_new_tokens": p.max_new_tokens},
                    "stream": ds.budget.streams_requests}
    store.engine.dispose()
    out.write_text(json.dumps(payloads))
    return [queue_name(n) for n in names]


def bare_celery_leg(procs: Processes, label: str, settings: Settings, sim: tuple[str, int],
                    expected: int, *, workers: int = 1, timeout_s: float = 600,
                    on_start: Callable[[list[subprocess.Popen[bytes]]], None] | None = None
                    ) -> Leg:
    """The baseline: a bare Celery task making the same HTTP call, same worker options
    (``workers`` processes, as ``pipeline_leg``)."""
    payload_file = WORKDIR / "tmp" / "payloads.json"
    queues = dump_payloads(settings, payload_file)
    sim_reset(sim[0])
    env = {**settings.to_env(), "DATAGEN_BENCH_PAYLOADS": str(payload_file)}
    started = [procs.start(
        [sys.executable, "-m", "celery", "-A", "bench.bare_worker", "worker",
         "--pool=threads", f"--concurrency={settings.concurrency}", "--loglevel=WARNING",
         "--without-gossip", "--without-mingle", "-Q", ",".join(queues),
         f"--hostname=bare{k}-{time.monotonic_ns()}@bench"],
        env=env, log=WORKDIR / f"bare-worker{k}.log") for k in range(workers)]
    try:
        cpu, switches = _watch_workers(started, settings, sim, expected, timeout_s, on_start)
    finally:
        for proc in started:
            procs.stop(proc)
    return measured_leg(label, sim[0], cpu, switches)
