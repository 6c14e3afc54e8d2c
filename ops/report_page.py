"""The report's one HTML page: a summary table, the figures inline as SVG, and the numbers
behind them as a JSON block (``<script type="application/json" id="report-data">``).

Self-contained: no script to run, no stylesheet, font or image fetched from anywhere, so
it opens from a file on a machine with no network.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from html import escape

from ops.report_data import DatasetReport, Report

CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1140px;
       color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
p.meta { color: #555; margin-top: 0; }
table { border-collapse: collapse; font-size: 0.9em; margin: 1em 0; }
th, td { padding: 0.25em 0.7em; border-bottom: 1px solid #ddd; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.warning { background: #fde8e8; border-left: 4px solid #e45756; padding: 0.5em 1em; }
figure { margin: 1.5em 0; }
figcaption { font-weight: bold; margin-bottom: 0.3em; }
svg { max-width: 100%; height: auto; }
"""
COLUMNS = ("dataset", "state", "budget", "used", "results", "kept", "hit max_new_tokens",
           "closed")


def _closed(d: DatasetReport) -> str:
    if d.closed_at_s is None:
        return ""
    at = datetime.fromtimestamp(d.closed_at_s, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    return f"{at} ({d.close_reason or 'closed'})"


def _row(d: DatasetReport) -> str:
    cells = (d.name, d.state, f"{d.budget_tokens:,} {d.basis}", f"{d.used_tokens:,}",
             f"{d.results:,}", f"{d.kept_share:.1%}", f"{d.length_share:.1%}", _closed(d))
    tds = "".join(f"<td>{escape(c)}</td>" for c in cells)
    return f'<tr id="row-{escape(d.name)}">{tds}</tr>'


def _warnings(report: Report) -> str:
    lines = [f"<li><b>{escape(d.name)}</b>: {d.length_share:.0%} of its {d.results:,} "
             "results stopped at max_new_tokens; such outputs are cut mid-answer, which "
             "usually means a broken template or a cap far too small.</li>"
             for d in report.datasets if d.broken]
    return f'<div class="warning" id="warnings"><ul>{"".join(lines)}</ul></div>' if lines \
        else ""


def _figure(fig_id: str, caption: str, svg: str) -> str:
    return (f'<figure id="{escape(fig_id)}"><figcaption>{escape(caption)}</figcaption>'
            f"{svg}</figure>")


def _json_block(report: Report) -> str:
    # "</" inside a script element would end it early; JSON allows "<\/" for "</".
    text = json.dumps(report.as_json(), sort_keys=True).replace("</", "<\\/")
    return f'<script type="application/json" id="report-data">{text}</script>'


def render_page(report: Report, source: str, overview_svg: str,
                dataset_svgs: dict[str, str], generated: datetime) -> str:
    """The page; ``dataset_svgs`` maps each dataset to its figure's inline SVG."""
    head = "".join(f"<th>{escape(c)}</th>" for c in COLUMNS)
    rows = "".join(_row(d) for d in report.datasets)
    figures = "".join(_figure(f"figure-{d.name}", d.name, dataset_svgs[d.name])
                      for d in report.datasets)
    stamp = generated.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>datagen report</title><style>{CSS}</style></head><body>"
        "<h1>datagen report</h1>"
        f'<p class="meta">{escape(source)}; generated {stamp}; time buckets of '
        f"{report.axis.width_s:,} s</p>{_warnings(report)}"
        f'<table id="summary"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>'
        f'{_figure("figure-overview", "all datasets", overview_svg)}{figures}'
        f"{_json_block(report)}</body></html>\n"
    )
