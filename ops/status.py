"""``datagen status``: per-dataset progress read straight from Redis and SQL.

Never a Celery inspect or control call with replies: their short timeouts would sweep
running tasks back into the queue.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from rich.live import Live
from rich.table import Table

from common.console import make_console
from common.ledger import Ledger
from common.services import connect
from common.settings import Settings
from common.store import Store


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


def _iso(ts: float | None, fallback: datetime | None) -> str | None:
    if fallback is not None:
        return fallback.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def collect(store: Store, ledger: Ledger) -> list[DatasetStatus]:
    rows = []
    for ds in store.datasets():
        counts = store.prompt_counts(ds.name)
        led = ledger.state(ds.name)
        closed = ds.state == "closed" or led.state == "closed"
        rows.append(DatasetStatus(
            name=ds.name,
            state="closed" if closed else "open",
            prompts=sum(counts.values()),
            done=counts.get("done", 0),
            failed=counts.get("failed", 0),
            skipped=counts.get("skipped", 0),
            queued=led.queued,
            used_tokens=led.used_tokens,
            budget_tokens=ds.budget.tokens,
            basis=ds.budget.basis,
            policy=ds.budget.policy,
            inflight=led.inflight,
            closed_at=_iso(led.closed_at, ds.closed_at) if closed else None,
            overshoot_tokens=ds.budget.overshoot(led.used_tokens),
        ))
    return rows


def _bar(used: int, budget: int, width: int = 12) -> str:
    frac = min(1.0, used / budget) if budget else 0.0
    filled = round(frac * width)
    return "█" * filled + "·" * (width - filled) + f" {frac:4.0%}"


def render(rows: list[DatasetStatus]) -> Table:
    table = Table(title=f"datagen status  {datetime.now(UTC):%Y-%m-%d %H:%M:%S}Z",
                  title_justify="left")
    for col in ("dataset", "state", "prompts", "done", "failed", "skipped", "queued",
                "in flight", "tokens used / budget", "", "overshoot"):
        table.add_column(col, justify="left" if col in ("dataset", "state", "") else "right")
    for r in rows:
        table.add_row(
            r.name, r.state, f"{r.prompts:,}", f"{r.done:,}", f"{r.failed:,}", f"{r.skipped:,}",
            f"{r.queued:,}", f"{r.inflight:,}", f"{r.used_tokens:,} / {r.budget_tokens:,}",
            _bar(r.used_tokens, r.budget_tokens), f"{r.overshoot_tokens:,}",
        )
    return table


def as_json(rows: list[DatasetStatus]) -> dict[str, Any]:
    return {"datasets": [asdict(r) for r in rows]}


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
