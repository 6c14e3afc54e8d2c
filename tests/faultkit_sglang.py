"""SGLang faults from the simulator, phase by phase, while workers run: 500s, 503 queue
full, dropped connections, aborted generations, slow answers, timeouts, a server playing
dead (``down_for_s``) and a server process stopped and started again on the same port.

What is measured besides the run invariants: the most requests one sample cost (bounded
by ``max_attempts``), whether each prompt's counted attempts equal the failed requests the
server saw for it (after a process restart, plus at most the requests the stopping process
cut off unlogged), the shortest gap between two tries of a sample (the backoff), and how
long generation stalled after an outage.
"""

from __future__ import annotations

import collections
import itertools
import re
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from common.schema import prompts
from tests.faultkit import sim_faults
from tests.faultkit_checks import (
    COMPLETED,
    load_requests,
    queued_open,
    quiesce,
    requests_per_sample,
)
from tests.faultkit_scenarios import finish, settle_reviving, start_workers
from tests.faultkit_stack import Outcome, Stack, enqueue, first_completion_after, now
from tests.faultkit_stack import write_manifest as _manifest

BASE_DECODE = 250.0
# A counted attempt in the workers' log: "<dataset>/<sample_id> attempt N failed (<error>);
# retry in ..." or, for the last one, "<dataset>/<sample_id> failed: after N attempts: ...".
_ATTEMPT_LINE = re.compile(
    r"(\S+)/(\S+) (?:attempt \d+ failed \(|failed: after \d+ attempts: )(.*)")
# What a client reads when the connection its request went out on was closed or reset with
# no answer: a stopping server's doing, whether or not a handler ever saw the request.
# Compared without case: http.client says "Remote end closed ...".
_UNANSWERED = ("remote end closed connection without response", "connection reset by peer")
CLEAR = {"error_rate": 0.0, "error_status": 500, "fail_next": 0, "disconnect_rate": 0.0,
         "disconnect_next": 0, "latency_s": 0.0, "abort_next": 0, "decode_tok_per_s": BASE_DECODE}
OUTAGES = ("down_for_s", "process_restart")
# How close to the client's read timeout a server-side finish counts as raced by it.
TIMEOUT_SLACK_S = 0.1
ALL_PHASES = ("http_500", "queue_full_503", "disconnects", "aborts", "slow", "timeouts",
              "down_for_s", "process_restart")


def phase_faults(phase: str, stack: Stack, hold_s: float) -> dict[str, Any]:
    timeout = stack.settings.request_timeout_s
    table: dict[str, dict[str, Any]] = {
        "http_500": {"error_rate": 0.3, "error_status": 500},
        "queue_full_503": {"fail_next": 3 * stack.concurrency, "error_status": 503},
        "disconnects": {"disconnect_rate": 0.3},
        "aborts": {"abort_next": stack.concurrency},
        "slow": {"decode_tok_per_s": BASE_DECODE / 3},
        "timeouts": {"latency_s": timeout * 2},
        "down_for_s": {"down_for_s": hold_s},
    }
    return table.get(phase, {})


def sglang_faults(stack: Stack, per_dataset: int, phases: tuple[str, ...] = ALL_PHASES,
                  hold_s: float = 1.5) -> Outcome:
    started = time.monotonic()
    names = ["sg_a", "sg_b"]
    enqueue(stack, _manifest(stack, {n: (per_dataset, None) for n in names}))
    faults, recovery, restarted = [], [], False
    with start_workers(stack) as workers:
        for phase in phases:
            _wait_some_done(stack, names)
            if queued_open(stack.store, names) < 2 * stack.concurrency:
                break  # too little work left for this phase to hit anything
            back = _inject(stack, phase, hold_s)
            faults.append(f"{phase} for {hold_s:.1f}s")
            restarted = restarted or phase == "process_restart"
            if phase in OUTAGES:
                recovery.append(first_completion_after(stack, back))
        settle_reviving(stack, workers, names)
        quiesce(stack.ledger, names)
    outcome = finish(stack, "SGLang faults", names, started, faults=faults,
                      recovery_s=recovery)
    outcome.notes.update(attempt_accounting(stack, names, workers.log if restarted else None))
    return outcome


def _wait_some_done(stack: Stack, names: list[str]) -> None:
    """A phase starts once a few more samples are done, so each one hits a busy worker."""
    target = stack.done(names) + stack.concurrency
    deadline = time.monotonic() + 30
    while stack.done(names) < target and time.monotonic() < deadline:
        time.sleep(0.05)


def _inject(stack: Stack, phase: str, hold_s: float) -> float:
    """Apply one phase's fault for ``hold_s``; returns when the server was healthy again."""
    if phase == "process_restart":
        stack.sim.restart(hold_s)
        return now()
    sim_faults(stack.sim.url, **phase_faults(phase, stack, hold_s))
    time.sleep(hold_s)
    sim_faults(stack.sim.url, **CLEAR)
    return now()


def _unanswered(workers_log: Path) -> collections.Counter[tuple[str, str]]:
    """Per sample, the attempts the workers counted because the connection was closed or
    reset before an answer came."""
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    if workers_log.exists():
        for line in workers_log.read_text(errors="replace").splitlines():
            sample = unanswered_attempt(line)
            if sample is not None:
                counts[sample] += 1
    return counts


def unanswered_attempt(line: str) -> tuple[str, str] | None:
    """The (dataset, sample_id) of a workers' log line that counts an attempt whose
    connection was closed or reset before an answer came; None for any other line."""
    m = _ATTEMPT_LINE.search(line)
    if m and any(error in m.group(3).lower() for error in _UNANSWERED):
        return m.group(1), m.group(2)
    return None


def attempt_accounting(stack: Stack, names: list[str],
                       restart_log: Path | None = None) -> dict[str, Any]:
    """Compare each prompt's counted attempts with the failed requests the server saw.

    After a server process restart (``restart_log``: the workers' log of such a run) one
    kind of failure is in no server log: a request that reached the stopping process on a
    kept-alive connection, but no handler that would log it (unread when the process
    closed the socket, or read after the log was closed). The worker sees the connection
    reset or closed unanswered and rightly counts an attempt: it cannot tell whether the
    request ran. So, in such a run only, a sample's counted attempts may exceed its logged
    failures by its unanswered closes beyond the disconnects the server logged for it,
    and by no more."""
    per_sample = requests_per_sample(stack.store, names,
                                     load_requests(log_file=stack.sim.log_file))
    unanswered = _unanswered(restart_log) if restart_log else collections.Counter()
    q = sa.select(prompts.c.dataset, prompts.c.sample_id, prompts.c.state, prompts.c.attempts,
                  prompts.c.error).where(prompts.c.dataset.in_(names))
    mismatched, errors_missing, gaps = [], 0, []
    timeout_s = stack.settings.request_timeout_s
    with stack.store.engine.connect() as conn:
        rows = conn.execute(q).all()
    for ds, sid, state, attempts, error in rows:
        seen = sorted(per_sample.get((ds, sid), []), key=lambda e: e["arrived_ts"])
        failed = sum(1 for e in seen if not (e["status"] == 200
                                             and e["finish_type"] in COMPLETED))
        # A request the server finished just as the client's read timeout fired is a
        # success in the server's log and a timeout for the worker, which retried it.
        failed += sum(1 for e in seen[:-1] if e["status"] == 200
                      and e["finish_type"] in COMPLETED
                      and e["finished_ts"] - e["arrived_ts"] >= timeout_s - TIMEOUT_SLACK_S)
        unlogged = max(0, unanswered[(ds, sid)] - sum(1 for e in seen
                                                      if e["finish_type"] == "disconnect"))
        if not failed <= attempts <= failed + unlogged:
            # What the server logged for the sample, and its last error: the evidence a
            # rare mismatch needs (its run's files are not kept).
            logged = [(e["status"], e["finish_type"], e["detail"]) for e in seen]
            mismatched.append(f"{ds}/{sid}: {attempts} attempts counted, {failed} failed "
                              f"requests, up to {unlogged} unanswered and unlogged; server "
                              f"log {logged}; last error {error!r}")
        if state == "failed" and not error:
            errors_missing += 1
        gaps += [b["arrived_ts"] - a["finished_ts"] for a, b in itertools.pairwise(seen)]
    return {"attempts_not_matching_server": mismatched, "failed_without_error": errors_missing,
            "retried_samples": sum(1 for r in rows if r[3]), "failed": sum(
                1 for r in rows if r[2] == "failed"),
            "min_retry_gap_s": round(min(gaps), 3) if gaps else None}
