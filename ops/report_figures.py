"""The report's figures, drawn with matplotlib: one per dataset and one overview.

Each figure is written twice from the same drawing: as SVG text for the page (text kept
as text, so it stays small, sharp and searchable) and as a PNG file. Figures are made
without pyplot, so no GUI backend or display is involved: matplotlib's own renderers
write both formats. Artists the page's readers look for carry an SVG
id (``set_gid``): the close marker of each dataset is ``close-<dataset>``.
"""

from __future__ import annotations

import io
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.dates as mdates
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter, StrMethodFormatter

from ops.report_data import SELECTION, DatasetReport, Report
from ops.report_sql import TimeAxis

STYLE: dict[Any, Any] = {
    "svg.fonttype": "none",  # text stays <text>, not glyph outlines
    "svg.hashsalt": "datagen-report",  # the same data gives the same file
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.titleweight": "bold",
    "axes.spines.top": False,
    "axes.spines.right": False,
}
COLORS = {
    "stop": "#4c78a8", "length": "#e45756", "abort": "#f58518", "budget": "#72b7b2",
    "kept": "#54a24b", "waiting": "#bab0ac", "cut": "#9d755d", "failed": "#e45756",
    "skipped": "#eeca3b",
}
PNG_DPI = 100
LABEL_SHARE = 0.06  # a part of the selection bar this wide or more shows its count
THOUSANDS = "{x:,.0f}"
ERROR_LABEL_CHARS = 60


def _when(epoch_s: float) -> float:
    """A moment as matplotlib's date axis counts it."""
    return float(mdates.date2num(datetime.fromtimestamp(epoch_s, UTC)))


def _times(axis: TimeAxis) -> list[float]:
    """Each bucket's middle, on matplotlib's date axis."""
    return [_when(axis.start_s + (i + 0.5) * axis.width_s) for i in range(axis.buckets)]


def _date_axis(ax: Axes) -> None:
    locator = mdates.AutoDateLocator(tz=UTC)
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator, tz=UTC))
    ax.set_xlabel("time (UTC)")


def _empty(ax: Axes, title: str, text: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666")
    ax.set_xticks([])
    ax.set_yticks([])


def _cumulative(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


def draw_budget(ax: Axes, d: DatasetReport, axis: TimeAxis) -> None:
    times = _times(axis)
    ax.step(times, _cumulative(d.cost_tokens), where="mid", color=COLORS["stop"],
            label=f"used ({d.basis} tokens)")
    ax.axhline(d.budget_tokens, color="#333", linestyle="--", linewidth=1,
               label=f"budget {d.budget_tokens:,}")
    if d.closed_at_s is not None:
        at = _when(d.closed_at_s)
        line = ax.axvline(at, color=COLORS["length"], linewidth=1.2,
                          label=f"closed ({d.close_reason or 'closed'})")
        line.set_gid(f"close-{d.name}")
        if d.used_at_close is not None:
            ax.plot([at], [d.used_at_close], "o", color=COLORS["length"])
    ax.set_title(f"{d.name}: tokens used against the budget")
    ax.set_ylabel("tokens")
    ax.yaxis.set_major_formatter(StrMethodFormatter(THOUSANDS))
    ax.legend(loc="best", fontsize=8, frameon=False)
    _date_axis(ax)


def draw_lengths(ax: Axes, d: DatasetReport) -> None:
    if not d.results:
        _empty(ax, f"{d.name}: output tokens", "no results yet")
        return
    # Stacked stairs, one outline per reason: a bar per bin and reason would be an SVG
    # element each and make the page several times larger.
    bottom = [0] * len(next(iter(d.lengths.values())))
    edges = [i * d.bin_width for i in range(len(bottom) + 1)]
    for reason, counts in d.lengths.items():
        top = [b + c for b, c in zip(bottom, counts, strict=True)]
        ax.stairs(top, edges, baseline=bottom, fill=True, label=reason,
                  color=COLORS.get(reason, "#888"))
        bottom = top
    if d.max_new_tokens:
        ax.axvline(d.max_new_tokens, color="#333", linestyle=":", linewidth=1,
                   label=f"max_new_tokens {d.max_new_tokens:,}")
    title = f"{d.name}: output tokens by finish reason"
    if d.broken:
        title += f"\n{d.length_share:.0%} hit max_new_tokens: check the data"
    ax.set_title(title, color=COLORS["length"] if d.broken else "black")
    ax.set_xlabel("output tokens")
    ax.set_ylabel("results")
    ax.legend(fontsize=8, frameon=False)


def draw_throughput(ax: Axes, d: DatasetReport, axis: TimeAxis) -> None:
    rates = [t / axis.width_s for t in d.output_tokens]
    ax.plot(_times(axis), rates, color=COLORS["stop"], label="output tok/s")
    ax.set_title(f"{d.name}: throughput (per {axis.width_s:,} s)")
    ax.set_ylabel("output tokens / s")
    ax.yaxis.set_major_formatter(StrMethodFormatter(THOUSANDS))
    ax.set_ylim(bottom=0)
    twin = ax.twinx()
    twin.plot(_times(axis), [n / axis.width_s for n in d.samples], color=COLORS["kept"],
              linewidth=0.8, label="samples/s")
    twin.set_ylabel("samples / s")
    twin.set_ylim(bottom=0)
    ax.legend(handles=[*ax.get_lines(), *twin.get_lines()], loc="best", fontsize=8,
              frameon=False)
    _date_axis(ax)


def _short(label: str) -> str:
    return label if len(label) <= ERROR_LABEL_CHARS else label[: ERROR_LABEL_CHARS - 1] + "…"


def draw_failures(ax: Axes, d: DatasetReport, axis: TimeAxis) -> None:
    title = f"{d.name}: failures and retries by error"
    if not d.failures and not any(d.retried_done):
        _empty(ax, title, "no failure, no retry")
        return
    edges = [_when(axis.start_s + i * axis.width_s) for i in range(axis.buckets + 1)]
    bottom = [0] * axis.buckets
    for label, counts in d.failures.items():
        top = [b + c for b, c in zip(bottom, counts, strict=True)]
        ax.stairs(top, edges, baseline=bottom, fill=True, label=_short(label))
        bottom = top
    if any(d.retried_done):
        ax.plot(_times(axis), d.retried_done, color="#333", linewidth=1, label="done after retries")
    ax.set_title(title)
    ax.set_ylabel("prompts")
    ax.legend(fontsize=7, frameon=False, loc="upper left")
    _date_axis(ax)


def draw_selection(ax: Axes, names: list[str], selections: list[dict[str, int]]) -> None:
    lefts = [0.0] * len(names)
    for part in SELECTION:
        counts = [s.get(part, 0) for s in selections]
        shares = [n / (sum(s.values()) or 1) for n, s in zip(counts, selections, strict=True)]
        bars = ax.barh(names, shares, left=lefts, color=COLORS[part], label=part)
        ax.bar_label(bars, [f"{n:,}" if share >= LABEL_SHARE else ""
                            for n, share in zip(counts, shares, strict=True)],
                     label_type="center", fontsize=8)
        lefts = [left + share for left, share in zip(lefts, shares, strict=True)]
    ax.set_xlim(0, 1)
    ax.xaxis.set_major_formatter(PercentFormatter(1.0))
    ax.invert_yaxis()
    ax.set_title("the selection the budget made: share of prompts")
    ax.legend(ncols=len(SELECTION), fontsize=8, frameon=False, loc="upper center",
              bbox_to_anchor=(0.5, -0.25))


def draw_turns(ax: Axes, d: DatasetReport) -> None:
    """Conversations by turns stored: where a budget or a failure ended them short."""
    counts = d.turns_stored
    ax.bar(list(counts), list(counts.values()), color=COLORS["stop"], width=0.8)
    ax.set_title(f"{d.name}: turns stored per conversation")
    ax.set_xlabel("turns stored")
    ax.set_ylabel("conversations")
    ax.set_xticks(list(counts))


def dataset_figure(d: DatasetReport, axis: TimeAxis) -> Figure:
    """Four panels and the selection; a fifth panel, turns per conversation, for a
    dataset regenerated turn by turn."""
    turns = bool(d.turns_stored)
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(11, 10.6 if turns else 8.2), layout="constrained")
        grid = fig.add_gridspec(4 if turns else 3, 2,
                                height_ratios=(3, 3, 2, 1) if turns else (3, 3, 1))
        draw_budget(fig.add_subplot(grid[0, 0]), d, axis)
        draw_lengths(fig.add_subplot(grid[0, 1]), d)
        draw_throughput(fig.add_subplot(grid[1, 0]), d, axis)
        draw_failures(fig.add_subplot(grid[1, 1]), d, axis)
        if turns:
            draw_turns(fig.add_subplot(grid[2, :]), d)
        draw_selection(fig.add_subplot(grid[-1, :]), [d.name], [d.selection])
    return fig


def overview_figure(report: Report) -> Figure:
    names = [d.name for d in report.datasets]
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(11, 1.6 + 0.35 * len(names) + 2.6), layout="constrained")
        grid = fig.add_gridspec(2, 1, height_ratios=(2.6, 0.6 + 0.35 * len(names)))
        ax = fig.add_subplot(grid[0])
        width = report.axis.width_s
        ax.stackplot(_times(report.axis), [[t / width for t in d.output_tokens]
                                           for d in report.datasets], labels=names)
        ax.set_title(f"all datasets: output tokens per second (per {width:,} s)")
        ax.yaxis.set_major_formatter(StrMethodFormatter(THOUSANDS))
        ax.legend(fontsize=7, frameon=False, loc="upper left", ncols=min(5, len(names) or 1))
        _date_axis(ax)
        draw_selection(fig.add_subplot(grid[1]), names, [d.selection for d in report.datasets])
    return fig


def svg_text(fig: Figure) -> str:
    """The figure as an inline ``<svg>`` element (no XML prolog, no DOCTYPE)."""
    buf = io.StringIO()
    with matplotlib.rc_context(STYLE):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    # Laid out now: the PNG keeps these positions (fractions of the figure, the same at
    # any resolution) instead of solving the layout again.
    fig.set_layout_engine("none")
    text = buf.getvalue()
    return _PATH_DATA.sub(_rounded, text[text.index("<svg"):])


_PATH_DATA = re.compile(r' d="([^"]*)"')
_DECIMALS = re.compile(r"(\d+\.\d)\d+")


def _rounded(match: re.Match[str]) -> str:
    """Path coordinates to a tenth of a point (matplotlib writes six decimals): invisible
    on screen, and a fifth off the page's size."""
    return ' d="' + _DECIMALS.sub(r"\1", match.group(1)) + '"'



def save_png(fig: Figure, path: Path) -> None:
    """Write the figure as PNG; after :func:`svg_text`, in the layout the SVG has."""
    with matplotlib.rc_context(STYLE):
        fig.savefig(path, format="png", dpi=PNG_DPI)
