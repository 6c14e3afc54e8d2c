"""``datagen report [--out DIR]``: a run's figures from SQL, as one page and as PNG files.

Writes ``DIR/index.html`` (self-contained: opens offline, from a file), ``DIR/overview.png``
and ``DIR/<dataset>.png``, the same figures the page shows. The numbers come from a few
aggregate queries (ops/report_sql.py), so the command reads no row per sample; it only
reads, so it may run while workers write.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from common.errors import InputError
from common.progress_bar import ProgressBar
from common.settings import Settings
from common.store import Store
from ops.argtypes import add_quiet_flag
from ops.report_data import Report, StepHook, build_report, no_progress
from ops.report_page import render_page

PAGE = "index.html"
OVERVIEW_PNG = "overview.png"


def add_report_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("report", help="an HTML page and PNG figures of the run, from SQL")
    p.add_argument("--out", default="report",
                   help="directory to write into, created if absent (default: %(default)s)")
    add_quiet_flag(p)
    return p


def on_bar(bar: ProgressBar) -> StepHook:
    """One of write_report's hooks counted on ``bar``: the queries' steps, then the
    figures', each phase adding its own total."""
    seen = {"total": 0, "done": 0}

    def step(done: int, total: int, what: str) -> None:
        if total != seen["total"]:
            bar.grow(total - seen["total"])
            seen["total"] = total
        bar.label(what)
        bar.advance(done - seen["done"])
        seen["done"] = done

    return step


@dataclass(frozen=True)
class Written:
    page: Path
    pngs: list[Path]
    report: Report


def write_report(store: Store, out: Path, query_progress: StepHook = no_progress,
                 draw_progress: StepHook = no_progress) -> Written:
    """Query, draw and write the page and the PNGs into ``out``.

    The hooks are called after each step of the querying, then of the drawing (one step
    per figure), with (steps done, steps in all, what comes next)."""
    # Imported here: every command builds the whole parser, this one's included, and
    # matplotlib (with numpy) would add tens of MB to each worker.
    from ops import report_figures as figures

    report = build_report(store.engine, query_progress)
    if not report.datasets:
        raise InputError(f"no datasets in {store.describe()} yet: nothing to report")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--out {out}: {exc.strerror or exc}") from None
    steps = len(report.datasets) + 1
    draw_progress(0, steps, "overview")
    fig = figures.overview_figure(report)
    overview_svg = figures.svg_text(fig)
    pngs = [out / OVERVIEW_PNG]
    figures.save_png(fig, pngs[0])
    svgs: dict[str, str] = {}
    for i, d in enumerate(report.datasets, start=1):
        draw_progress(i, steps, d.name)
        fig = figures.dataset_figure(d, report.axis)
        svgs[d.name] = figures.svg_text(fig)
        pngs.append(out / f"{d.name}.png")
        figures.save_png(fig, pngs[-1])
    draw_progress(steps, steps, "page")
    page = out / PAGE
    html = render_page(report, store.describe(), overview_svg, svgs, datetime.now(UTC))
    tmp = page.with_suffix(".tmp")
    tmp.write_text(html, encoding="utf-8")
    os.replace(tmp, page)  # a reader never sees half a page
    return Written(page, pngs, report)


def run_report(args: argparse.Namespace, settings: Settings) -> int:
    store = Store(settings.database_url, settings.db_connections)
    try:
        with ProgressBar("report", "steps", None, quiet=args.quiet,
                         every_s=settings.progress_every_s) as bar:
            written = write_report(store, Path(args.out), on_bar(bar), on_bar(bar))
    finally:
        store.engine.dispose()
    size_kib = written.page.stat().st_size / 1024
    print(f"wrote {written.page} ({size_kib:,.0f} KiB, {len(written.report.datasets)} "
          f"datasets) and {len(written.pngs)} PNG files in {written.page.parent}",
          file=sys.stdout)
    return 0
