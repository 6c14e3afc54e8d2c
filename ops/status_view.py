"""How ``datagen status`` looks: the table, and the lines under it for what its counts
alone would hide (samples waiting to be retried, ledgers rebuilt from SQL)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:  # ops.status imports this module to draw its rows
    from ops.status import DatasetStatus, Totals

# An error is shown on one line of the notes; the JSON keeps it whole.
ERROR_SHOWN_CHARS = 200


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
           "retry\nwait", "tokens used / budget", "", "overshoot", "tok/s", "mean\ntok", "ETA")
LEFT = ("dataset", "state", "")


def _cells(r: DatasetStatus | Totals, name: str, state: str, mean: float | None) -> list[str]:
    return [
        name, state, f"{r.prompts:,}", f"{r.done:,}", f"{r.failed:,}", f"{r.skipped:,}",
        f"{r.queued:,}", f"{r.inflight:,}", f"{r.retrying:,}",
        f"{r.used_tokens:,} / {short_tokens(r.budget_tokens)}",
        _bar(r.used_tokens, r.budget_tokens), f"{r.overshoot_tokens:,}",
        f"{r.tok_per_s:,.1f}", "" if mean is None else f"{mean:,.0f}", duration(r.eta_s),
    ]


def _one_line(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= ERROR_SHOWN_CHARS else flat[: ERROR_SHOWN_CHARS - 3] + "..."


def notes(rows: Sequence[DatasetStatus]) -> list[str]:
    """Lines for datasets that need a look: those stopped by an error all their failures
    share, with what to do, those whose samples wait to be retried, with the newest
    error, and the conversations of datasets regenerated turn by turn, by state.

    Samples retried against a server that refuses connections sit in the workers, neither
    queued nor in flight, so without this line a stuck run would look idle and fine."""
    stopped = [
        f"{r.name} stopped: its prompts failed with: {_one_line(r.stop_error or '')}\n"
        f"  fix the cause, then `datagen retry {r.name}` (it takes --top-p ... too)"
        for r in rows if r.state == "stopped"
    ]
    retrying = [
        f"{r.name}: {r.retrying:,} samples waiting to be retried; last error "
        f"({r.last_error_count:,} of them): {_one_line(r.last_error or '')}"
        for r in rows if r.retrying
    ]
    uncharged = [
        f"{r.name}: {r.not_kept:,} samples stored but not charged (basis kept): cut while "
        "reasoning or cut to the budget, so no export keeps them as answers"
        for r in rows if r.basis == "kept" and r.not_kept
    ]
    return (stopped + retrying + uncharged
            + [_conversations(r) for r in rows if r.conversations])


def _conversations(r: DatasetStatus) -> str:
    c = r.conversations or {}
    return (f"{r.name}: {c['total']:,} conversations, turn by turn (its prompts are turns): "
            f"{c['complete']:,} complete, {c['in_progress']:,} in progress, "
            f"{c['partial']:,} partial ({c.get('tools_differ', 0):,} at tool calls that "
            f"differ), {c['not_started']:,} not started")


def render(rows: Sequence[DatasetStatus], totals: Totals | None,
           extra: Sequence[str] = ()) -> Group:
    """The table and its notes: ten datasets of 14,714 prompts with 10M budgets fit 160
    columns."""
    # No vertical rules: ten 10M datasets and a long name still fit 160 columns.
    table = Table(title=f"datagen status  {datetime.now(UTC):%Y-%m-%d %H:%M:%S}Z",
                  title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                  collapse_padding=True)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in LEFT else "right",
                         no_wrap=col != "dataset", overflow="fold")
    for i, r in enumerate(rows):
        table.add_row(*_cells(r, r.name, r.state, r.mean_tokens), end_section=i == len(rows) - 1)
    if totals is not None:
        table.add_row(*_cells(totals, "total", f"{totals.open} open", None))
    lines = [*extra, *notes(rows)]
    return Group(table, *(Text(line, overflow="fold") for line in lines))
