"""The reliability report: the fault scenarios of tests/test_faults_*.py at a larger scale.

    python -m bench.reliability [--quick] [--runs N] [--only NAME ...] [--out docs/RELIABILITY.md]

Each scenario runs against processes of its own (a private redis-server, a private
PostgreSQL cluster when it needs one, the SGLang simulator, ``datagen worker``
subprocesses), never against the shared services, and everything it starts is stopped
when it ends, failed or not. The scenarios themselves live in tests/faultkit_*.py, shared
with the tests, so this must run from a source checkout (the repository root).

Writes a Markdown report: per scenario the runs, prompts, faults injected, prompts lost,
samples duplicated, Redis counter drift against SQL and recovery times, then each run's
details and every invariant it broke. Exits 1 if any invariant broke, else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from common.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
PACED = {"decode_tok_per_s": 300, "mean_output_tokens": 80, "max_running_requests": 64}
INSTANT = {"decode_tok_per_s": 0, "mean_output_tokens": 40, "max_running_requests": 128}
NOTES = """
**lost**: prompts of an open dataset never settled (done, failed or skipped), or done without
a result row, once the run is over. **stranded**: prompts left `queued` in SQL with no message
after a fault; only a re-run of `datagen enqueue` (or the workers' sweep, 5-10 min later)
brings them back, which the scenario then does, so they are not counted as lost (issue 1
below, now fixed). **worker exits**: worker processes that died and were restarted, as compose's
`restart: unless-stopped` would (issue 3). **duplicated**: result rows beyond one per
(dataset, sample_id), plus samples the Redis ledger counts more often than SQL holds them.
**counter drift**: the sum over datasets of |Redis `used` - SQL sum| + |Redis `samples` -
result rows|. **recovery**: seconds from the service being back (or the blip) until SGLang
receives a request that then completes; for a stalled run it includes the wait and the
operator's re-run; for worker-kill, seconds from the SIGKILL until every message the dead
worker held unacked is back in its queue (the reaper). **max requests / sample**: the most
`/generate` requests the simulator saw for one sample. Every run also checks that no
reservation is left, that SQL and Redis agree on which datasets are closed, and that each
budget is within its policy's bound (drain: total concurrency x max_new_tokens). Datasets
closed by their budget keep their remaining prompts `queued`, by design.

## Issues these scenarios found

1. Fixed: a task that met a database or Redis outage outside the result store
   (`store.prompt`, `record_attempt`, `ledger.admit`, ...) was acked and its prompt stranded
   `queued` with no message until an enqueue re-run or the 5-10 min sweep, and an ADMIT whose
   answer was lost kept its reservation. Workers now retry such tasks, uncounted, and free
   the reservation (`test_retries_due_while_postgres_is_down_are_not_dropped`,
   `test_a_blip_during_a_ledger_call_strands_no_prompt_and_leaks_no_reservation`).
2. Fixed: `common.audit.requeue_lost` (the workers' sweep) did not rebuild ledgers after a
   Redis loss, so a closed dataset showed `open` with 0 tokens used
   (`test_redis_restart_with_total_data_loss_then_requeue_lost`).
3. Fixed: `datagen worker` exited 0 after Celery's "Unrecoverable error" (database down at
   start, or kombu's `'NoneType' object has no attribute 'hostname'` while restoring unacked
   messages on a Redis reconnect, seen now and then on an empty Redis restart:
   `worker_exits`), so a supervisor that restarts only on failure left it down. It now
   exits 1, or 3 when Redis or the database did not answer within `DATAGEN_START_WAIT_S`
   (`test_the_worker_exits_non_zero_when_the_database_does_not_answer`).
4. Fixed: a bad `budget_tokens`, `policy` or `basis` in a manifest was reported without the
   manifest and dataset it came from (`test_bad_terms_in_a_manifest_name_where_they_are`).
5. Fixed: a worker SIGKILLed mid-request left its admission reservations in the ledger
   for good (16 after two kills), which would hold a drain dataset near its budget waiting
   forever. The reaper now frees reservations no live worker claims
   (`test_worker_sigkills_lose_nothing_and_leave_no_reservation`).
6. Fixed: a task that met a Redis outage (Redis unreachable, its data kept: `redis-outage`)
   sent its retry into the same outage. Celery turns a retry it cannot send into a reject
   without requeue, so the sample waited for the workers' sweep (5-10 min) or, when the
   reject failed too, for the visibility timeout (41 min by default): 14 of 300 prompts
   after one 4 s outage at the quick scale. A task now holds its message and sends the
   retry again until Redis answers
   (`test_tasks_whose_retry_cannot_be_sent_while_redis_is_away_are_not_delayed`).
7. Fixed: a worker started before Redis logged a 60-line traceback per try, and once a
   Redis that had lost its data came up it neither rebuilt the ledgers nor enqueued the
   prompts SQL held as queued: they waited for an enqueue re-run or the 5-10 min sweep. A
   worker now waits for Redis and the database with one line per service, and the first
   worker to find a Redis without its data (at its start or at a heartbeat) rebuilds it
   at once (`test_a_worker_started_before_an_empty_redis_drains_what_sql_holds_queued`,
   `test_redis_restarted_empty_under_a_running_worker_is_rebuilt_at_once`).
"""


@dataclass(frozen=True)
class Spec:
    key: str
    run: Callable[[Any, dict[str, Any]], Any]  # (Stack, scale params) -> Outcome
    full: dict[str, Any]
    quick: dict[str, Any]
    sim: dict[str, Any] = field(default_factory=lambda: dict(PACED))
    settings: dict[str, Any] = field(default_factory=dict)
    postgres: bool = False
    # Workers reach Redis through a proxy that can make it unreachable (tests/faultkit_proxy).
    outage: bool = False
    concurrency: int = 8


def _specs() -> list[Spec]:
    from tests import faultkit_producer as pk
    from tests import faultkit_scenarios as sc
    from tests import faultkit_sglang as sg

    sglang_sim = {**PACED, "decode_tok_per_s": sg.BASE_DECODE}
    sglang_settings = {"request_timeout_s": 1.5, "max_attempts": 8, "retry_base_s": 0.3,
                       "retry_max_s": 1.5}
    return [
        Spec("worker-kill", lambda s, p: sc.worker_kill(s, **p),
             {"per_dataset": 1000, "kills": 3}, {"per_dataset": 150, "kills": 2}),
        Spec("redis-loss-enqueue", lambda s, p: sc.redis_loss(s, recover="enqueue", **p),
             {"per_dataset": 1000, "losses": 3}, {"per_dataset": 150, "losses": 2}),
        Spec("redis-loss-requeue", lambda s, p: sc.redis_loss(s, recover="requeue", **p),
             {"per_dataset": 1000, "losses": 2}, {"per_dataset": 150, "losses": 1}),
        Spec("redis-blip", lambda s, p: sc.redis_blip(s, **p),
             {"per_dataset": 1000, "blips": 3}, {"per_dataset": 150, "blips": 2}),
        Spec("redis-outage", lambda s, p: sc.redis_outage(s, **p),
             {"per_dataset": 1000, "outages": 3, "down_s": 4.0},
             {"per_dataset": 150, "outages": 1, "down_s": 4.0}, outage=True),
        Spec("postgres-restart", lambda s, p: sc.postgres_restart(s, **p),
             {"per_dataset": 1000, "restarts": 3, "down_s": 3.0},
             {"per_dataset": 150, "restarts": 1, "down_s": 3.0}, postgres=True),
        Spec("sglang-faults", lambda s, p: sg.sglang_faults(s, **p),
             {"per_dataset": 1000, "phases": sg.ALL_PHASES * 2},
             {"per_dataset": 300, "phases": sg.ALL_PHASES}, sim=sglang_sim,
             settings=sglang_settings),
        Spec("producer-kill", lambda s, p: pk.producer_kill(s, **p),
             {"prompts": 20_000, "kills": 3}, {"prompts": 4_000, "kills": 2}, sim=INSTANT,
             concurrency=16),
    ]


def run_spec(spec: Spec, params: dict[str, Any]) -> Any:
    from tests.faultkit import PrivateRedis, Sim
    from tests.faultkit_pg import PrivatePostgres
    from tests.faultkit_proxy import OutageProxy
    from tests.faultkit_stack import Stack

    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(
            prefix=f"datagen-rel-{spec.key}-") as raw:
        tmp = Path(raw)
        redis_server = stack.enter_context(PrivateRedis())
        outage = stack.enter_context(OutageProxy(redis_server.port)) if spec.outage else None
        pg = stack.enter_context(PrivatePostgres()) if spec.postgres else None
        sim = stack.enter_context(Sim(tmp / "sim.jsonl", **spec.sim))
        db = pg.url if pg else f"sqlite:///{tmp / 'datagen.db'}"
        settings = Settings(
            redis_url=outage.url if outage else redis_server.url, database_url=db,
            sglang_urls=(sim.url,),
            request_timeout_s=30, max_attempts=3, retry_base_s=0.05, retry_max_s=0.2,
            concurrency=spec.concurrency, heartbeat_s=1.0, dead_after_s=5.0,
        ).replace(**spec.settings)
        run_stack = Stack(settings, tmp, sim, redis=redis_server, pg=pg, outage=outage,
                          concurrency=spec.concurrency)
        return spec.run(run_stack, params)


def _version(argv: Sequence[str]) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=10).stdout
        return (out.strip().splitlines() or ["?"])[0]
    return "?"


def machine() -> str:
    mem = "?"
    with contextlib.suppress(OSError):
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 1024 / 1024:.0f} GiB"
    from tests.faultkit_pg import pg_bin

    return (f"{platform.platform()}, {len(os.sched_getaffinity(0))} cores, {mem} RAM; Python "
            f"{platform.python_version()}; {_version(['redis-server', '--version'])}; "
            f"{_version([str(pg_bin() / 'postgres'), '--version'])}")


def _seconds(values: list[float]) -> str:
    return f"{max(values):.1f} s max, {statistics.median(values):.1f} s median" if values else "-"


def summary_row(key: str, outcomes: list[Any]) -> str:
    checks = [o.check for o in outcomes]
    faults = sum(len(o.faults) for o in outcomes)
    recovery = [r for o in outcomes for r in o.recovery_s]
    ok = "ok" if all(c.ok for c in checks) else f"**{sum(len(c.problems) for c in checks)} broken**"
    stranded = sum(o.notes.get(k, 0) for o in outcomes
                   for k in ("stuck_until_enqueue_rerun", "stranded_until_sweep"))
    exits = sum(len(o.notes.get("worker_exits", [])) for o in outcomes)
    return (f"| {key} | {len(outcomes)} | {sum(c.prompts for c in checks):,} | {faults} | "
            f"{sum(c.lost for c in checks)} | {'**' if stranded else ''}{stranded:,}"
            f"{'**' if stranded else ''} | {sum(c.duplicated for c in checks)} | "
            f"{sum(c.drift for c in checks)} | {_seconds(recovery)} | "
            f"{max(c.requests_max for c in checks)} | {exits} | {ok} |")


def details(key: str, outcomes: list[Any]) -> list[str]:
    lines = [f"### {key}", ""]
    for i, out in enumerate(outcomes, 1):
        states = ", ".join(f"{n:,} {s}" for s, n in sorted(out.check.states.items()))
        lines += [f"Run {i}: {out.scenario}, {out.check.prompts:,} prompts ({states}), "
                  f"{out.elapsed_s:.0f} s; samples generated twice: {out.check.regenerated}.",
                  "", "Faults injected:", ""]
        lines += [f"- {f}" for f in out.faults] + [""]
        if out.notes:
            lines += ["Observed: " + "; ".join(f"`{k}` = {_short(v)}" for k, v in
                                               out.notes.items()), ""]
        lines += [f"- **broken:** {p}" for p in out.check.problems] or ["All invariants held."]
        lines.append("")
    return lines


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 160 else text[:157] + "..."


def render(results: dict[str, list[Any]], argv: Sequence[str], started: datetime,
           elapsed_s: float) -> str:
    command = " ".join(["python -m bench.reliability", *argv]).strip()
    head = [
        "# Reliability report", "",
        f"Generated by `{command}` on {started:%Y-%m-%d %H:%M} UTC in {elapsed_s / 60:.1f} "
        f"min, on {machine()}.", "",
        "Every scenario runs on the real stack against processes of its own: a private "
        "redis-server without persistence, a private PostgreSQL cluster, the SGLang "
        "simulator and `datagen worker` subprocesses (two, unless noted). The scenarios are "
        "those of `tests/test_faults_*.py` (code in `tests/faultkit_*.py`) at a larger "
        "scale. Reproduce with the command above from the repository root; `--quick` runs a "
        "smaller scale.", "",
        "| scenario | runs | prompts | faults | lost | stranded | duplicated | counter drift | "
        "recovery | max requests / sample | worker exits | invariants |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |",
    ]
    body = [summary_row(k, v) for k, v in results.items()]
    runs = [line for k, v in results.items() for line in details(k, v)]
    return "\n".join([*head, *body, NOTES, "## Runs", "", *runs]).rstrip() + "\n"


def _keep_bad_input(out: Path, text: str) -> str:
    """``text`` with the "Bad input" section ``out`` has now: tests/bad_input.py writes it."""
    from tests.bad_input import section_of, with_section

    section = section_of(out.read_text()) if out.is_file() else ""
    return with_section(text, section) if section else text


def _aborted(key: str, exc: Exception) -> Any:
    from tests.faultkit_checks import Check
    from tests.faultkit_stack import Outcome

    return Outcome(key, 0, [], Check(problems=[f"run aborted: {type(exc).__name__}: {exc}"]))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench.reliability", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller scale (minutes)")
    parser.add_argument("--runs", type=int, default=1, help="runs of each scenario")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="only these scenarios")
    parser.add_argument("--out", default=str(ROOT / "docs" / "RELIABILITY.md"))
    args = parser.parse_args(argv)
    if not (ROOT / "tests" / "faultkit.py").is_file():
        print("bench.reliability needs the source checkout's tests/ folder", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    # A SIGTERM unwinds like Ctrl-C, so every private server and worker is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started, clock = datetime.now(UTC), time.monotonic()
    results: dict[str, list[Any]] = {}
    for spec in _specs():
        if args.only and spec.key not in args.only:
            continue
        for run in range(args.runs):
            print(f"reliability: {spec.key} run {run + 1}/{args.runs} ...", flush=True)
            try:
                out = run_spec(spec, spec.quick if args.quick else spec.full)
            except Exception as exc:  # one broken run must not lose the others' report
                out = _aborted(spec.key, exc)
            results.setdefault(spec.key, []).append(out)
            print(f"  {len(out.faults)} faults, lost {out.check.lost}, duplicated "
                  f"{out.check.duplicated}, drift {out.check.drift}, "
                  f"{'ok' if out.check.ok else out.check.problems}", flush=True)
    Path(args.out).write_text(_keep_bad_input(Path(args.out), render(
        results, argv, started, time.monotonic() - clock)))
    print(f"reliability: wrote {args.out}")
    return 0 if all(o.check.ok for outs in results.values() for o in outs) else 1


if __name__ == "__main__":
    sys.exit(main())
