"""The SQL aggregates behind ``datagen report``: every figure's numbers, counted in the database.

Each query is one GROUP BY over results or prompts; time buckets and histogram bins are
computed in the query (integer division of epoch seconds, of token counts), so the rows
that come back are a few per bucket or bin, never one per sample: the report costs the
same few scans at a thousand results as at a million. The same SQLAlchemy Core statements
run on SQLite and PostgreSQL; only :class:`epoch_s` compiles differently on each.

Expressions that carry bound values (a bucket's origin, a bin's width) are computed in a
subquery and grouped on its column: PostgreSQL does not see two bound copies of one
expression as the same GROUP BY term.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from common.schema import conversations, datasets, prompt_inputs, prompts, results
from common.store import kept_completion_tokens

# Bars across a run's time axis and across a dataset's output lengths: enough to see a
# shape, few enough to stay readable and to keep the page small.
TIME_BUCKETS = 120
LENGTH_BINS = 40
# Errors drawn by name in a dataset's failure panel; the rest are summed as "other".
TOP_ERRORS = 5
OTHER_ERROR = "other"


class epoch_s(FunctionElement[int]):
    """Whole seconds since 1970 (UTC) of a timestamp column or aggregate, on either database.

    SQLite stores the UTC wall time as text, which ``strftime('%s', ...)`` reads;
    PostgreSQL's ``timestamptz`` gives its epoch to ``EXTRACT``."""

    type = sa.BigInteger()
    inherit_cache = True


@compiles(epoch_s, "sqlite")
def _epoch_sqlite(element: epoch_s, compiler: SQLCompiler, **kw: Any) -> str:
    return f"CAST(strftime('%s', {compiler.process(element.clauses, **kw)}) AS INTEGER)"


@compiles(epoch_s, "postgresql")
def _epoch_postgresql(element: epoch_s, compiler: SQLCompiler, **kw: Any) -> str:
    return f"CAST(FLOOR(EXTRACT(EPOCH FROM {compiler.process(element.clauses, **kw)})) AS BIGINT)"


@dataclass(frozen=True)
class TimeAxis:
    """Buckets of ``width_s`` seconds from ``start_s`` (epoch seconds), ``buckets`` of them."""

    start_s: int
    width_s: int
    buckets: int

    @classmethod
    def spanning(cls, first_s: int, last_s: int, buckets: int = TIME_BUCKETS) -> TimeAxis:
        width_s = max(1, -(-(last_s - first_s + 1) // buckets))
        return cls(first_s, width_s, -(-(last_s - first_s + 1) // width_s))

    def bucket(self, column: sa.ColumnElement[Any]) -> sa.ColumnElement[int]:
        return (epoch_s(column) - self.start_s) // self.width_s

    def index(self, moment_s: int) -> int:
        return min(self.buckets - 1, max(0, (moment_s - self.start_s) // self.width_s))


@dataclass(frozen=True)
class ResultSummary:
    """A dataset's stored results: count, token sums, longest output, first and last time."""

    samples: int
    completion_tokens: int
    prompt_tokens: int
    max_completion_tokens: int
    first_s: int
    last_s: int
    kept_completion_tokens: int  # completions of the kept samples (common.kept)


def dataset_rows(engine: Engine) -> list[sa.Row[Any]]:
    q = sa.select(
        datasets.c.name, datasets.c.state, datasets.c.basis, datasets.c.policy,
        datasets.c.budget_tokens, datasets.c.close_reason,
        epoch_s(datasets.c.closed_at).label("closed_s"), datasets.c.used_at_close,
        epoch_s(datasets.c.created_at).label("created_s"),
    ).order_by(datasets.c.name)
    with engine.connect() as conn:
        return list(conn.execute(q))


def result_summaries(engine: Engine) -> dict[str, ResultSummary]:
    q = sa.select(
        results.c.dataset, sa.func.count(), sa.func.sum(results.c.completion_tokens),
        sa.func.sum(results.c.prompt_tokens), sa.func.max(results.c.completion_tokens),
        epoch_s(sa.func.min(results.c.created_at)), epoch_s(sa.func.max(results.c.created_at)),
        sa.func.sum(kept_completion_tokens()),
    ).group_by(results.c.dataset)
    with engine.connect() as conn:
        return {name: ResultSummary(*(int(v or 0) for v in rest))
                for name, *rest in conn.execute(q)}


def max_new_tokens(engine: Engine) -> dict[str, int]:
    """Per dataset, the largest output cap its prompts were given."""
    q = sa.select(prompts.c.dataset, sa.func.max(prompts.c.max_new_tokens)).group_by(
        prompts.c.dataset)
    with engine.connect() as conn:
        return {name: int(cap) for name, cap in conn.execute(q)}


def turns_stored(engine: Engine) -> dict[str, dict[int, int]]:
    """Per dataset regenerated turn by turn: conversations by how many of their turns are
    stored (0 for those with none yet)."""
    stored = (
        sa.select(prompt_inputs.c.dataset, prompt_inputs.c.conversation,
                  sa.func.count().label("n"))
        .join(results, sa.and_(results.c.dataset == prompt_inputs.c.dataset,
                               results.c.sample_id == prompt_inputs.c.sample_id))
        .where(prompt_inputs.c.conversation.is_not(None))
        .group_by(prompt_inputs.c.dataset, prompt_inputs.c.conversation)
        .subquery()
    )
    by_count = sa.select(stored.c.dataset, stored.c.n, sa.func.count()).group_by(
        stored.c.dataset, stored.c.n)
    totals = sa.select(conversations.c.dataset, sa.func.count()).group_by(
        conversations.c.dataset)
    out: dict[str, dict[int, int]] = {}
    with engine.connect() as conn:
        for name, n, count in conn.execute(by_count):
            out.setdefault(name, {})[int(n)] = int(count)
        for name, total in conn.execute(totals):
            counts = out.setdefault(name, {})
            counts[0] = int(total) - sum(counts.values())
    return out


_TROUBLED = sa.or_(prompts.c.error.is_not(None), prompts.c.attempts > 0)


def error_totals(engine: Engine) -> list[tuple[str, str, str, int]]:
    """(dataset, state, error, prompts) of every prompt holding an error: failed ones, and
    queued ones whose last attempt failed (retrying)."""
    q = (sa.select(prompts.c.dataset, prompts.c.state, prompts.c.error, sa.func.count())
         .where(prompts.c.error.is_not(None))
         .group_by(prompts.c.dataset, prompts.c.state, prompts.c.error))
    with engine.connect() as conn:
        return [(d, s, str(e), int(n)) for d, s, e, n in conn.execute(q)]


def trouble_span(engine: Engine) -> tuple[int, int] | None:
    """First and last change (epoch seconds) of a prompt that failed or was retried."""
    q = sa.select(epoch_s(sa.func.min(prompts.c.updated_at)),
                  epoch_s(sa.func.max(prompts.c.updated_at))).where(_TROUBLED)
    with engine.connect() as conn:
        first, last = conn.execute(q).one()
    return None if first is None else (int(first), int(last))


Bucket = tuple[int, int, int, int]  # results, completion, prompt, kept completion tokens


def timeline(engine: Engine, axis: TimeAxis) -> dict[str, dict[int, Bucket]]:
    """Per dataset, per time bucket of ``created_at``: (results, completion, prompt, kept
    completion tokens)."""
    inner = sa.select(results.c.dataset, axis.bucket(results.c.created_at).label("bucket"),
                      results.c.completion_tokens, results.c.prompt_tokens,
                      kept_completion_tokens().label("kept")).subquery()
    q = sa.select(inner.c.dataset, inner.c.bucket, sa.func.count(),
                  sa.func.sum(inner.c.completion_tokens), sa.func.sum(inner.c.prompt_tokens),
                  sa.func.sum(inner.c.kept)).group_by(inner.c.dataset, inner.c.bucket)
    out: dict[str, dict[int, Bucket]] = {}
    with engine.connect() as conn:
        for name, bucket, n, completion, prompt, kept in conn.execute(q):
            out.setdefault(name, {})[int(bucket)] = (int(n), int(completion), int(prompt),
                                                     int(kept or 0))
    return out


def histogram(engine: Engine, bin_widths: dict[str, int]) -> dict[str, dict[str, dict[int, int]]]:
    """Per dataset, per finish reason, per bin of ``bin_widths[dataset]`` output tokens:
    results. Datasets absent from ``bin_widths`` are left out."""
    if not bin_widths:
        return {}
    width = sa.case(bin_widths, value=results.c.dataset)
    inner = (sa.select(results.c.dataset, results.c.finish_reason,
                       (results.c.completion_tokens // width).label("bin"))
             .where(results.c.dataset.in_(list(bin_widths))).subquery())
    q = sa.select(inner.c.dataset, inner.c.finish_reason, inner.c.bin, sa.func.count()
                  ).group_by(inner.c.dataset, inner.c.finish_reason, inner.c.bin)
    out: dict[str, dict[str, dict[int, int]]] = {}
    with engine.connect() as conn:
        for name, reason, bin_, n in conn.execute(q):
            out.setdefault(name, {}).setdefault(reason, {})[int(bin_)] = int(n)
    return out


def failures(
    engine: Engine, axis: TimeAxis, named: Sequence[tuple[str, str]]
) -> dict[str, dict[tuple[str, str], dict[int, int]]]:
    """Per dataset, per (state, error), per time bucket of ``updated_at``: prompts holding an
    error (``failed``, or ``queued`` and retrying). Errors not among the (dataset, error)
    pairs ``named`` are counted as OTHER_ERROR."""
    label = sa.case(*[((prompts.c.dataset == d) & (prompts.c.error == e), e) for d, e in named],
                    else_=sa.literal(OTHER_ERROR)) if named else sa.literal(OTHER_ERROR)
    inner = (sa.select(prompts.c.dataset, prompts.c.state, label.label("error"),
                       axis.bucket(prompts.c.updated_at).label("bucket"))
             .where(prompts.c.error.is_not(None)).subquery())
    q = sa.select(inner.c.dataset, inner.c.state, inner.c.error, inner.c.bucket,
                  sa.func.count()).group_by(inner.c.dataset, inner.c.state, inner.c.error,
                                            inner.c.bucket)
    out: dict[str, dict[tuple[str, str], dict[int, int]]] = {}
    with engine.connect() as conn:
        for name, state, error, bucket, n in conn.execute(q):
            out.setdefault(name, {}).setdefault((state, error), {})[int(bucket)] = int(n)
    return out


def retried_done(engine: Engine, axis: TimeAxis) -> dict[str, dict[int, tuple[int, int]]]:
    """Per dataset, per time bucket of being stored: (prompts done after failed attempts,
    those failed attempts)."""
    inner = (sa.select(prompts.c.dataset, prompts.c.attempts,
                       axis.bucket(prompts.c.updated_at).label("bucket"))
             .where(prompts.c.state == "done", prompts.c.attempts > 0).subquery())
    q = sa.select(inner.c.dataset, inner.c.bucket, sa.func.count(),
                  sa.func.sum(inner.c.attempts)).group_by(inner.c.dataset, inner.c.bucket)
    out: dict[str, dict[int, tuple[int, int]]] = {}
    with engine.connect() as conn:
        for name, bucket, n, attempts in conn.execute(q):
            out.setdefault(name, {})[int(bucket)] = (int(n), int(attempts))
    return out
