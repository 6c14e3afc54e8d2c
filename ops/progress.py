"""Read-only SQL aggregates behind ``datagen status`` and ``datagen plan``, and the mean
tokens per sample estimated from them.

Everything here is one GROUP BY over the results or prompts table, so the commands stay
cheap while workers write. The time-window sums filter on ``dataset IN (...)`` together
with ``created_at >= bound`` so both SQLite and PostgreSQL can answer them from the index
``ix_results_dataset_created (dataset, created_at)`` instead of scanning every result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from common.budget import cost_on, counts_prompt
from common.schema import prompts, results
from common.store import kept_completion_tokens

RATE_WINDOW_S = 60
PLAN_WINDOW_S = 600
# Fewer results than this say little about a dataset's mean (outputs vary 10x and more).
MIN_OBSERVED = 20


@dataclass(frozen=True)
class ResultSums:
    """Count and token sums of a set of results (all of a dataset's, or a window's)."""

    samples: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    kept_completion_tokens: int = 0  # completions of the samples kept (common.kept)
    not_kept: int = 0  # samples stored but not kept: uncharged on basis "kept"

    def cost(self, basis: str) -> int:
        """Tokens on a budget basis: "output" counts completions, "total" adds prompts,
        "kept" counts kept samples' completions."""
        return cost_on(basis, self.prompt_tokens, self.completion_tokens,
                       self.kept_completion_tokens)

    def mean(self, basis: str) -> float | None:
        return self.cost(basis) / self.samples if self.samples else None


@dataclass(frozen=True)
class Mean:
    """Tokens per sample a dataset is planned with, exact (a Fraction), and its source."""

    cost: Fraction  # on the budget basis
    output: Fraction  # output tokens, what the server's throughput is made of
    source: str


def estimate_mean(
    sums: ResultSums, basis: str, guess: Fraction | int | None, prompt_mean: Fraction
) -> Mean | None:
    """Observed once there are MIN_OBSERVED results, else the guess, else the few there are.

    The guess counts output tokens; on basis "total" the mean prompt length is added.
    """
    n = sums.samples
    if n >= MIN_OBSERVED or (n and guess is None):
        source = "observed" if n >= MIN_OBSERVED else f"observed, n={n}"
        mean = Mean(Fraction(sums.cost(basis), n), Fraction(sums.completion_tokens, n), source)
    elif guess is not None:
        fixed = prompt_mean if counts_prompt(basis) else Fraction(0)
        mean = Mean(Fraction(guess) + fixed, Fraction(guess), "--mean-tokens")
    else:
        return None
    return mean if mean.cost > 0 else None


def utc_bound(engine: Engine, moment: datetime) -> datetime:
    """``moment`` as the column compares it: naive UTC on SQLite, aware UTC elsewhere.

    SQLite stores datetimes as text without an offset (the UTC wall time, see
    ``common.store.as_utc``) and drops any tzinfo of a bound parameter, so an aware value
    in another zone would compare wrongly; PostgreSQL's timestamptz needs the offset.
    """
    aware = moment.astimezone(UTC) if moment.tzinfo else moment.replace(tzinfo=UTC)
    return aware.replace(tzinfo=None) if engine.dialect.name == "sqlite" else aware


def _sums_query(where: Sequence[sa.ColumnElement[bool]]) -> sa.Select[Any]:
    return (
        sa.select(
            results.c.dataset,
            sa.func.count(),
            sa.func.coalesce(sa.func.sum(results.c.completion_tokens), 0),
            sa.func.coalesce(sa.func.sum(results.c.prompt_tokens), 0),
            sa.func.coalesce(sa.func.sum(kept_completion_tokens()), 0),
            sa.func.coalesce(sa.func.sum(sa.case((results.c.kept.is_(sa.false()), 1),
                                                 else_=0)), 0),
        )
        .where(*where)
        .group_by(results.c.dataset)
    )


def _run_sums(engine: Engine, query: sa.Select[Any]) -> dict[str, ResultSums]:
    with engine.connect() as conn:
        return {
            name: ResultSums(int(n), int(completion), int(prompt), int(kept), int(not_kept))
            for name, n, completion, prompt, kept, not_kept in conn.execute(query)
        }


def result_sums(engine: Engine) -> dict[str, ResultSums]:
    """Per dataset: every stored result's count and token sums (SQL is the truth)."""
    return _run_sums(engine, _sums_query(()))


def recent_sums(
    engine: Engine, names: Sequence[str], window_s: float, now: datetime | None = None
) -> dict[str, ResultSums]:
    """Per dataset: results created in the last ``window_s`` seconds before ``now``."""
    if not names:
        return {}
    since = (now or datetime.now(UTC)) - timedelta(seconds=window_s)
    where = (results.c.dataset.in_(list(names)), results.c.created_at >= utc_bound(engine, since))
    return _run_sums(engine, _sums_query(where))


def rate(sums: ResultSums | None, basis: str, window_s: float) -> float:
    """Tokens per second over a window, on the budget basis."""
    return sums.cost(basis) / window_s if sums else 0.0


def prompt_counts(engine: Engine) -> dict[str, dict[str, int]]:
    """Per dataset, prompts per state, in one query (``ix_prompts_dataset_state``)."""
    q = sa.select(prompts.c.dataset, prompts.c.state, sa.func.count()).group_by(
        prompts.c.dataset, prompts.c.state
    )
    counts: dict[str, dict[str, int]] = {}
    with engine.connect() as conn:
        for name, state, n in conn.execute(q):
            counts.setdefault(name, {})[state] = int(n)
    return counts


@dataclass(frozen=True)
class Retrying:
    """A dataset's prompts still queued with a failed attempt recorded: each one waits in
    a worker to be tried again (an unreachable server is retried without end, uncounted,
    so only these figures show it). ``last_error`` is the newest error recorded and
    ``last_error_samples`` how many of them hold that same error."""

    samples: int = 0
    last_error: str | None = None
    last_error_samples: int = 0


def retrying(engine: Engine) -> dict[str, Retrying]:
    """Per dataset, its retrying prompts, in one query (``ix_prompts_dataset_state``).

    A worker records each failed attempt's error on the prompt (``Store.record_attempt``)
    and clears it when the sample is stored, so a queued prompt with an error is one whose
    last attempt failed."""
    q = (
        sa.select(prompts.c.dataset, prompts.c.error, sa.func.count(),
                  sa.func.max(prompts.c.updated_at))
        .where(prompts.c.state == "queued", prompts.c.error.is_not(None))
        .group_by(prompts.c.dataset, prompts.c.error)
    )
    totals: dict[str, int] = {}
    newest: dict[str, tuple[Any, str, int]] = {}
    with engine.connect() as conn:
        for name, error, n, at in conn.execute(q):
            totals[name] = totals.get(name, 0) + int(n)
            if name not in newest or at > newest[name][0]:
                newest[name] = (at, str(error), int(n))
    return {name: Retrying(total, newest[name][1], newest[name][2])
            for name, total in totals.items()}


def mean_prompt_tokens(engine: Engine) -> dict[str, Fraction]:
    """Per dataset, the exact mean length of prompts that can still produce a sample."""
    q = (
        sa.select(prompts.c.dataset, sa.func.sum(prompts.c.prompt_tokens), sa.func.count())
        .where(prompts.c.state.in_(("queued", "done")))
        .group_by(prompts.c.dataset)
    )
    with engine.connect() as conn:
        return {name: Fraction(int(total or 0), int(n)) for name, total, n in conn.execute(q)}
