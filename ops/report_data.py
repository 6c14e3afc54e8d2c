"""What ``datagen report`` draws, per dataset, gathered from the SQL aggregates of
ops/report_sql.py into dense series (one value per time bucket or length bin).

Everything here works on the aggregates' few rows, never on a row per sample; the page
embeds :meth:`Report.as_json` so that the figures' numbers can be read back and checked.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy.engine import Engine

from common.budget import cost_on
from ops import report_sql as q
from ops.progress import prompt_counts

# Finish reasons in the order they are stacked: SGLang's stop and length, then the
# worker's own (an abort by the policy, a cut at the budget).
FINISH_REASONS = ("stop", "length", "abort", "budget")
# A dataset whose outputs hit their cap this often is most likely broken (a template that
# never lets the model stop, a max_new_tokens far too small): the page says so.
LENGTH_WARN_SHARE = 0.5
# The shares of a dataset's prompts, in the order they are drawn.
SELECTION = ("kept", "waiting", "cut", "failed", "skipped")

# (steps done, steps in all, what is being done): a progress display plugs in here.
StepHook = Callable[[int, int, str], None]


def no_progress(done: int, total: int, what: str) -> None:
    """The default hook: report nothing."""


@dataclass
class DatasetReport:
    """One dataset's figures' numbers."""

    name: str
    state: str
    basis: str
    policy: str
    budget_tokens: int
    close_reason: str | None
    closed_at_s: int | None
    used_at_close: int | None
    max_new_tokens: int
    results: int = 0
    used_tokens: int = 0
    selection: dict[str, int] = field(default_factory=dict)
    # per time bucket: results stored, output tokens, tokens on the budget's basis
    samples: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    cost_tokens: list[int] = field(default_factory=list)
    bin_width: int = 1
    # finish reason -> results per bin of bin_width output tokens
    lengths: dict[str, list[int]] = field(default_factory=dict)
    # "failed: <error>" or "retrying: <error>" -> prompts per time bucket
    failures: dict[str, list[int]] = field(default_factory=dict)
    retried_done: list[int] = field(default_factory=list)
    # regenerated turn by turn (--turns all): conversations by how many turns are stored
    turns_stored: dict[int, int] = field(default_factory=dict)

    @property
    def kept_share(self) -> float:
        total = sum(self.selection.values())
        return self.selection.get("kept", 0) / total if total else 0.0

    @property
    def length_share(self) -> float:
        hit = sum(self.lengths.get("length", ()))
        return hit / self.results if self.results else 0.0

    @property
    def broken(self) -> bool:
        return self.results > 0 and self.length_share >= LENGTH_WARN_SHARE


@dataclass
class Report:
    """Every dataset's numbers on one shared time axis."""

    axis: q.TimeAxis
    datasets: list[DatasetReport]

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"axis": asdict(self.axis),
                               "datasets": [asdict(d) for d in self.datasets]}
        for entry, d in zip(out["datasets"], self.datasets, strict=True):
            entry.update(kept_share=d.kept_share, length_share=d.length_share, broken=d.broken)
        return out


def _selection(states: dict[str, int], closed: bool) -> dict[str, int]:
    queued = states.get("queued", 0)
    return {"kept": states.get("done", 0), "waiting": 0 if closed else queued,
            "cut": queued if closed else 0, "failed": states.get("failed", 0),
            "skipped": states.get("skipped", 0)}


def _axis(engine: Engine, rows: list[Any], sums: dict[str, q.ResultSummary]) -> q.TimeAxis:
    moments = [s.first_s for s in sums.values()] + [s.last_s for s in sums.values()]
    moments += [r.closed_s for r in rows if r.closed_s is not None]
    moments += list(q.trouble_span(engine) or ())
    if not moments:
        moments = [r.created_s for r in rows] or [0]
    return q.TimeAxis.spanning(min(moments), max(moments))


def _dense(by_index: dict[int, Any], n: int, pick: Callable[[Any], int]) -> list[int]:
    return [pick(by_index[i]) if i in by_index else 0 for i in range(n)]


def _named_errors(totals: list[tuple[str, str, str, int]]) -> list[tuple[str, str]]:
    per: dict[str, Counter[str]] = {}
    for name, _state, error, n in totals:
        per.setdefault(name, Counter())[error] += n
    return [(name, error) for name, c in per.items() for error, _ in c.most_common(q.TOP_ERRORS)]


def _bin_width(d: DatasetReport, sums: q.ResultSummary | None) -> int:
    top = max(d.max_new_tokens, sums.max_completion_tokens if sums else 0)
    return max(1, -(-(top + 1) // q.LENGTH_BINS))


def _fill_results(d: DatasetReport, sums: q.ResultSummary | None, axis: q.TimeAxis,
                  buckets: dict[int, q.Bucket]) -> None:
    if sums:
        d.results = sums.samples
        d.used_tokens = cost_on(d.basis, sums.prompt_tokens, sums.completion_tokens,
                                sums.kept_completion_tokens)
    n = axis.buckets
    d.samples = _dense(buckets, n, lambda b: b[0])
    d.output_tokens = _dense(buckets, n, lambda b: b[1])
    d.cost_tokens = _dense(buckets, n, lambda b: cost_on(d.basis, b[2], b[1], b[3]))


def _fill_lengths(d: DatasetReport, by_reason: dict[str, dict[int, int]]) -> None:
    bins = max([q.LENGTH_BINS, *(b + 1 for bins in by_reason.values() for b in bins)])
    reasons = [r for r in FINISH_REASONS if r in by_reason]
    reasons += sorted(set(by_reason) - set(FINISH_REASONS))
    d.lengths = {r: _dense(by_reason[r], bins, int) for r in reasons}


def _fill_failures(d: DatasetReport, axis: q.TimeAxis,
                   series: dict[tuple[str, str], dict[int, int]],
                   retried: dict[int, tuple[int, int]]) -> None:
    kinds = {"failed": "failed", "queued": "retrying"}
    for (state, error), by_bucket in sorted(series.items()):
        label = f"{kinds.get(state, state)}: {error}"
        d.failures[label] = _dense(by_bucket, axis.buckets, int)
    d.retried_done = _dense(retried, axis.buckets, lambda b: b[0])


def _datasets(rows: list[Any], engine: Engine) -> list[DatasetReport]:
    caps = q.max_new_tokens(engine)
    states = prompt_counts(engine)
    out = []
    for name, state, basis, policy, budget, reason, closed_s, used_close, _created in rows:
        d = DatasetReport(name, state, basis, policy, int(budget), reason,
                          None if closed_s is None else int(closed_s),
                          None if used_close is None else int(used_close), caps.get(name, 0))
        d.selection = _selection(states.get(name, {}), state == "closed")
        out.append(d)
    return out


def build_report(engine: Engine, progress: StepHook = no_progress) -> Report:
    """Every dataset's figures' numbers, in nine aggregate queries."""
    steps = 9
    progress(0, steps, "datasets")
    rows = q.dataset_rows(engine)
    progress(1, steps, "result sums")
    sums = q.result_summaries(engine)
    axis = _axis(engine, rows, sums)
    progress(2, steps, "prompt states")
    found = _datasets(rows, engine)
    progress(3, steps, "timeline")
    buckets = q.timeline(engine, axis)
    widths = {d.name: _bin_width(d, sums.get(d.name)) for d in found}
    progress(4, steps, "output lengths")
    lengths = q.histogram(engine, {n: w for n, w in widths.items() if n in sums})
    progress(5, steps, "errors")
    named = _named_errors(q.error_totals(engine))
    progress(6, steps, "failures")
    fails = q.failures(engine, axis, named)
    progress(7, steps, "retries")
    retried = q.retried_done(engine, axis)
    progress(8, steps, "turns")
    turns = q.turns_stored(engine)
    for d in found:
        d.turns_stored = dict(sorted(turns.get(d.name, {}).items()))
        d.bin_width = widths[d.name]
        _fill_results(d, sums.get(d.name), axis, buckets.get(d.name, {}))
        _fill_lengths(d, lengths.get(d.name, {}))
        _fill_failures(d, axis, fails.get(d.name, {}), retried.get(d.name, {}))
    progress(9, steps, "done")
    return Report(axis, found)
