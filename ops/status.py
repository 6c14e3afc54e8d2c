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
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from typing import Any

from rich import box
from rich.live import Live
from rich.table import Table

from common.console import make_console
from common.failures import STOPPED, commonest_error
from common.ledger import Ledger, LedgerState
from common.services import connect
from common.settings import Settings
from common.store import DatasetRow, Store
from ops import progress
from ops.progress import RATE_WINDOW_S, ResultSums

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
    stop_error: str | None = None


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
         recent: ResultSums | None, stop_error: str | None) -> DatasetStatus:
    state = _state(ds, led)
    closed = state != "open"
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
        stop_error=stop_error if state == "stopped" else None,
    )


def collect(store: Store, ledger: Ledger, now: datetime | None = None) -> list[DatasetStatus]:
    dsets = store.datasets()
    counts = progress.prompt_counts(store.engine)
    sums = progress.result_sums(store.engine)
    recent = progress.recent_sums(store.engine, [d.name for d in dsets], RATE_WINDOW_S, now)
    rows = []
    for ds in dsets:
        led = ledger.state(ds.name)
        # Read for a stopped dataset only: the error its failures share is why it stopped.
        shared = commonest_error(store, ds.name) if _state(ds, led) == "stopped" else None
        rows.append(_row(ds, counts.get(ds.name, {}), led, sums.get(ds.name, ResultSums()),
                         recent.get(ds.name), shared[0] if shared else None))
    return rows


def totals(rows: list[DatasetStatus]) -> Totals:
    summed = ("prompts", "done", "failed", "skipped", "queued", "inflight", "used_tokens",
              "budget_tokens", "overshoot_tokens")
    etas = [r.eta_s for r in rows if r.state == "open" and r.eta_s is not None]
    return Totals(
        datasets=len(rows),
        open=sum(r.state == "open" for r in rows),
        **{key: sum(getattr(r, key) for r in rows) for key in summed},
        tok_per_s=round(sum(r.tok_per_s for r in rows), 1),
        eta_s=max(etas) if etas else None,
    )


def duration(seconds: int | None) -> str:
    """Compact, at most 7 characters: 42s, 12m 05s, 5h 07m, 2d 03h; blank when unknown."""
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d {seconds % 86400 // 3600:02d}h"


def short_tokens(n: int) -> str:
    """A budget as people say it (10M, 500k) when it is round, else in full."""
    for scale, suffix in ((1_000_000_000, "G"), (1_000_000, "M"), (1_000, "k")):
        if n >= scale and n % scale == 0:
            return f"{n // scale:,}{suffix}"
    return f"{n:,}"


def _bar(used: int, budget: int, width: int = 8) -> str:
    frac = min(1.0, used / budget) if budget else 0.0
    filled = round(frac * width)
    return "█" * filled + "·" * (width - filled) + f" {frac:4.0%}"


COLUMNS = ("dataset", "state", "prompts", "done", "failed", "skipped", "queued", "in\nflight",
           "tokens used / budget", "", "overshoot", "tok/s", "mean\ntok", "ETA")
LEFT = ("dataset", "state", "")


def _cells(r: DatasetStatus | Totals, name: str, state: str, mean: float | None) -> list[str]:
    return [
        name, state, f"{r.prompts:,}", f"{r.done:,}", f"{r.failed:,}", f"{r.skipped:,}",
        f"{r.queued:,}", f"{r.inflight:,}", f"{r.used_tokens:,} / {short_tokens(r.budget_tokens)}",
        _bar(r.used_tokens, r.budget_tokens), f"{r.overshoot_tokens:,}",
        f"{r.tok_per_s:,.1f}", "" if mean is None else f"{mean:,.0f}", duration(r.eta_s),
    ]


def render(rows: list[DatasetStatus]) -> Table:
    """The table: ten datasets of 14,714 prompts with 10M budgets fit 160 columns."""
    # No vertical rules: ten 10M datasets and a long name still fit 160 columns.
    table = Table(title=f"datagen status  {datetime.now(UTC):%Y-%m-%d %H:%M:%S}Z",
                  title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                  collapse_padding=True)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in LEFT else "right",
                         no_wrap=col != "dataset", overflow="fold")
    for i, r in enumerate(rows):
        table.add_row(*_cells(r, r.name, r.state, r.mean_tokens), end_section=i == len(rows) - 1)
    if rows:
        tot = totals(rows)
        table.add_row(*_cells(tot, "total", f"{tot.open} open", None))
    stops = [f"{r.name} stopped: its prompts failed with: {r.stop_error}\n"
             f"  fix the cause, then `datagen retry {r.name}` (it takes --top-p ... too)"
             for r in rows if r.state == "stopped"]
    if stops:
        table.caption, table.caption_justify = "\n".join(stops), "left"
    return table


def as_json(rows: list[DatasetStatus]) -> dict[str, Any]:
    keys = [f.name for f in fields(DatasetStatus) if f.name not in TABLE_ONLY]
    return {
        "datasets": [{k: getattr(r, k) for k in keys} for r in rows],
        "totals": asdict(totals(rows)),
    }


def run_status(args: argparse.Namespace, settings: Settings) -> int:
    store, ledger = connect(settings)
    if args.json:
        print(json.dumps(as_json(collect(store, ledger)), indent=2))
        return 0
    console = make_console()
    if not args.watch:
        console.print(render(collect(store, ledger)))
        return 0
    with Live(render(collect(store, ledger)), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(2)
                live.update(render(collect(store, ledger)), refresh=True)
        except KeyboardInterrupt:
            return 0
