"""``datagen status``: per-dataset progress read straight from Redis and SQL.

Never a Celery inspect or control call with replies: their short timeouts would sweep
running tasks back into the queue.

Throughput is the completion tokens of results stored in the last minute, divided by 60;
the ETA is the time to whichever comes first at that pace: the budget (remaining budget
tokens) or the end of the prompts (prompts still queued × the mean tokens per sample so
far), both on the dataset's budget basis. It is null for a closed dataset and while no
result arrived in the last minute, and 0 once no prompt is left to generate. The totals'
ETA is the largest of the open datasets' known ETAs, since datasets run side by side.
During a run's first minute the window is not full yet, so the rate reads low.

``retrying`` counts the prompts still queued whose last attempt failed (the error the
worker recorded in SQL): they wait inside workers for their retry, so they are neither
``queued`` (messages in Redis) nor ``inflight``. A server that refuses connections is
retried without end, so this, with ``last_error`` and ``last_error_count`` (how many of
them hold that newest error), is what tells a stuck run from an idle one. A closed
dataset has none: its prompts left queued are dropped when a worker meets them.

``not_kept`` counts the results stored that the exports do not keep as answers (cut
while reasoning, or cut to the budget: common/kept.py); on basis ``kept`` these are the
samples stored but not charged, and a note under the table says how many.

``conversations`` (datasets enqueued with ``--turns all``; null otherwise) counts the
dataset's conversations by state, read from their turns (common/conversation_store.py):
``complete``, ``in_progress``, ``partial`` (some turns stored, none left to run: the
dataset closed, or a turn failed or had no room, or the model's tool calls were not the
line's: ``tools_differ`` counts those) and ``not_started``. There, ``prompts``
and the state counts are turns.

A Redis that holds no ledger of a dataset SQL knows (flushed, restarted without its
data, or a new database) would show zero tokens used: status rebuilds it from SQL first,
as workers and ``enqueue`` do, and says so under the table (on stderr with ``--json``).

``--watch`` redraws in place on a terminal; into a pipe or a file it writes one frame
every 2 s (the table under its timestamped title, then a blank line), flushed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live

from common.auto_limits import read_limits
from common.console import make_console
from common.conversation_store import ConversationCounts, conversation_counts
from common.failures import STOPPED, commonest_error
from common.ledger import Ledger, LedgerState
from common.reconcile import reconcile_dataset
from common.services import connect
from common.settings import Settings
from common.store import DatasetRow, Store
from ops import progress, status_view
from ops.progress import RATE_WINDOW_S, ResultSums, Retrying
from ops.status_servers import ServerStatus, collect_servers, render_servers, servers_json
from ops.status_view import duration

__all__ = ["DatasetStatus", "Totals", "collect", "duration", "eta_seconds", "rebuild_lost",
           "render", "run_status", "totals"]
WATCH_EVERY_S = 2.0

# Fields of DatasetStatus shown in the table but left out of the JSON, whose keys are
# a documented contract.
TABLE_ONLY = ("mean_tokens",)


@dataclass(frozen=True)
class DatasetStatus:
    name: str
    state: str
    prompts: int
    done: int
    failed: int
    skipped: int
    queued: int
    used_tokens: int
    budget_tokens: int
    basis: str
    policy: str
    inflight: int
    closed_at: str | None
    overshoot_tokens: int
    tok_per_s: float
    eta_s: int | None
    mean_tokens: float | None
    retrying: int = 0
    last_error: str | None = None
    last_error_count: int = 0
    stop_error: str | None = None
    conversations: dict[str, int] | None = None
    # Its publishing order (common/order.py): "shuffle" with its seed, or "file" (seed null).
    order: str = "shuffle"
    seed: int | None = 0
    # Its sampling mixtures (common/draws.py), null for none; samples of each prompt.
    mixtures: dict[str, list[dict[str, Any]]] | None = None
    generations: int = 1
    # Results stored that the exports do not keep (common.kept): on basis "kept" they are
    # the samples stored uncharged.
    not_kept: int = 0


@dataclass(frozen=True)
class Totals:
    datasets: int
    open: int
    prompts: int
    done: int
    failed: int
    skipped: int
    queued: int
    inflight: int
    used_tokens: int
    budget_tokens: int
    overshoot_tokens: int
    tok_per_s: float
    eta_s: int | None
    retrying: int


def _iso(ts: float | None, fallback: datetime | None) -> str | None:
    if fallback is not None:
        return fallback.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def eta_seconds(
    *, closed: bool, prompts_left: int, budget_left: int, mean: float | None, rate: float
) -> int | None:
    """Seconds until the budget or the prompts run out, whichever is first (see module)."""
    if closed:
        return None
    if prompts_left == 0:
        return 0
    if rate <= 0 or mean is None:
        return None
    return round(min(budget_left, prompts_left * mean) / rate)


def _state(ds: DatasetRow, led: LedgerState) -> str:
    if ds.state != "closed" and led.state != "closed":
        return "open"
    return "stopped" if STOPPED in (ds.close_reason, led.close_reason) else "closed"


def _row(ds: DatasetRow, counts: dict[str, int], led: LedgerState, sums: ResultSums,
         recent: ResultSums | None, retry: Retrying,
         stop_error: str | None, chats: ConversationCounts | None = None) -> DatasetStatus:
    state = _state(ds, led)
    closed = state != "open"
    if closed:  # its prompts left queued are dropped, not retried, whatever they last met
        retry = Retrying()
    basis, mean = ds.budget.basis, sums.mean(ds.budget.basis)
    queued_prompts = counts.get("queued", 0)
    eta = eta_seconds(
        closed=closed, prompts_left=queued_prompts, mean=mean,
        budget_left=max(0, ds.budget.tokens - led.used_tokens),
        rate=progress.rate(recent, basis, RATE_WINDOW_S),
    )
    return DatasetStatus(
        name=ds.name,
        state=state,
        prompts=sum(counts.values()),
        done=counts.get("done", 0),
        failed=counts.get("failed", 0),
        skipped=counts.get("skipped", 0),
        queued=led.queued,
        used_tokens=led.used_tokens,
        budget_tokens=ds.budget.tokens,
        basis=basis,
        policy=ds.budget.policy,
        inflight=led.inflight,
        closed_at=_iso(led.closed_at, ds.closed_at) if closed else None,
        overshoot_tokens=ds.budget.overshoot(led.used_tokens),
        tok_per_s=round(progress.rate(recent, "output", RATE_WINDOW_S), 1),
        eta_s=eta,
        mean_tokens=mean,
        retrying=retry.samples,
        last_error=retry.last_error,
        last_error_count=retry.last_error_samples,
        stop_error=stop_error if state == "stopped" else None,
        conversations=None if chats is None else asdict(chats),
        order=ds.order.kind,
        seed=ds.order.seed,
        mixtures=ds.mixtures.to_json(),
        generations=ds.generations,
        not_kept=sums.not_kept,
    )


def collect(store: Store, ledger: Ledger, now: datetime | None = None) -> list[DatasetStatus]:
    dsets = store.datasets()
    counts = progress.prompt_counts(store.engine)
    sums = progress.result_sums(store.engine)
    recent = progress.recent_sums(store.engine, [d.name for d in dsets], RATE_WINDOW_S, now)
    retrying = progress.retrying(store.engine)
    rows = []
    for ds in dsets:
        led = ledger.state(ds.name)
        # Read for a stopped dataset only: the error its failures share is why it stopped.
        state = _state(ds, led)
        shared = commonest_error(store, ds.name) if state == "stopped" else None
        chats = (conversation_counts(store, ds.name, closed=state != "open")
                 if ds.turns == "all" else None)
        rows.append(_row(ds, counts.get(ds.name, {}), led, sums.get(ds.name, ResultSums()),
                         recent.get(ds.name), retrying.get(ds.name, Retrying()),
                         shared[0] if shared else None, chats))
    return rows


def rebuild_lost(store: Store, ledger: Ledger) -> list[str]:
    """Rebuild from SQL each ledger Redis lacks; returns a line saying so, if any was.

    The datasets set is written with every ledger (``Ledger.configure``), so a dataset
    SQL knows and Redis does not list has no ledger there at all."""
    lost = sorted(set(store.dataset_names()) - set(ledger.known()))
    if not lost:
        return []
    added = sum(reconcile_dataset(store, ledger, name).tokens_added for name in lost)
    where, _ = ledger.where()
    return [f"Redis at {where} held no ledger of {', '.join(lost)}: rebuilt from SQL "
            f"({added:,} tokens)"]


def totals(rows: list[DatasetStatus]) -> Totals:
    summed = ("prompts", "done", "failed", "skipped", "queued", "inflight", "used_tokens",
              "budget_tokens", "overshoot_tokens", "retrying")
    etas = [r.eta_s for r in rows if r.state == "open" and r.eta_s is not None]
    return Totals(
        datasets=len(rows),
        open=sum(r.state == "open" for r in rows),
        **{key: sum(getattr(r, key) for r in rows) for key in summed},
        tok_per_s=round(sum(r.tok_per_s for r in rows), 1),
        eta_s=max(etas) if etas else None,
    )


def render(rows: list[DatasetStatus], extra: Sequence[str] = ()) -> Group:
    """The table of ``rows`` with their totals, and the notes under it (ops.status_view)."""
    return status_view.render(rows, totals(rows) if rows else None, extra)


def as_json(rows: list[DatasetStatus]) -> dict[str, Any]:
    keys = [f.name for f in fields(DatasetStatus) if f.name not in TABLE_ONLY]
    return {
        "datasets": [{k: getattr(r, k) for k in keys} for r in rows],
        "totals": asdict(totals(rows)),
    }


def run_status(args: argparse.Namespace, settings: Settings) -> int:
    store, ledger = connect(settings)

    def frame() -> RenderableType:
        rebuilt = rebuild_lost(store, ledger)
        return Group(render(collect(store, ledger), rebuilt),
                     render_servers(servers()))

    def servers() -> list[ServerStatus]:
        return collect_servers(settings,
                               limits=read_limits(ledger.redis, list(settings.sglang_urls)))

    if args.json:
        for line in rebuild_lost(store, ledger):
            print(f"datagen status: {line}", file=sys.stderr)
        doc = as_json(collect(store, ledger))
        doc["servers"] = servers_json(servers())
        print(json.dumps(doc, indent=2))
        return 0
    console = make_console()
    if not args.watch:
        console.print(frame())
        return 0
    return watch(console, frame)


def watch(console: Console, frame: Callable[[], RenderableType],
          every_s: float = WATCH_EVERY_S) -> int:
    """Redraw in place on a terminal; elsewhere, append frames (Live would write nothing
    to a pipe until it stops). Ends on Ctrl-C, or quietly when the reader goes away."""
    try:
        if console.is_terminal:
            with Live(frame(), console=console, auto_refresh=False) as live:
                while True:
                    time.sleep(every_s)
                    live.update(frame(), refresh=True)
        while True:
            console.print(frame())
            console.print()
            console.file.flush()
            time.sleep(every_s)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        # `datagen status --watch | head`: stop without a traceback at exit's flush.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
