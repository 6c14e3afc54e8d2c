"""The rows an export reads from SQL: each stored result joined with its prompt, streamed.

Export and validate both read through here, so both see the same rows in the same order.
Memory stays flat in the number of results: rows come off a server-side cursor
(``yield_per``, which implies ``stream_results`` on PostgreSQL) a batch at a time, and
callers consume them one by one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from common.schema import prompt_inputs, prompts, results
from common.store import Store, as_utc
from ops.export_text import OriginalText

BATCH_ROWS = 1000
# Lookups by sample id stay under SQLite's historical 999 bound-parameter limit.
LOOKUP_CHUNK = 500


@dataclass(frozen=True)
class ExportRow:
    """One stored result, with the prompt it answered (None when the prompt row is gone)."""

    id: int
    dataset: str
    sample_id: str
    rid: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    finish_reason: str
    finish_detail: Any
    output_ids: list[int]
    output_text: str
    e2e_latency_s: float | None
    server: str
    model: str
    created_at: datetime
    messages: list[dict[str, Any]] | None
    input_ids: list[int] | None
    max_new_tokens: int | None
    tools: list[dict[str, Any]] | None = None  # the prompt's function schemas, if any
    conversation: str | None = None  # a turn of this conversation (``--turns all``)
    turn: int | None = None
    sampling: dict[str, Any] | None = None  # the sampling_params sent; None if not stored
    template_kwargs: dict[str, Any] | None = None  # chat template arguments drawn
    kept: bool | None = None  # an answer the exports keep (common.kept); None: stored before
    # The turn's own answer as its successor's prompt stores it (with the tool calls the
    # server parsed from it), when that prompt was built; read only when asked for.
    answer: dict[str, Any] | None = None
    next_error: str | None = None  # why its successor was not built, if it was not


RESULT_COLUMNS: tuple[str, ...] = tuple(c.name for c in results.columns)
_NEXT_INPUTS = prompt_inputs.alias("next_inputs")
_NEXT_PROMPTS = prompts.alias("next_prompts")


def _with_answers(q: sa.Select[Any]) -> sa.Select[Any]:
    """``q`` with each turn's successor: its prompt messages (which hold the turn's own
    answer) and its error."""
    nxt, nxt_p = _NEXT_INPUTS, _NEXT_PROMPTS
    return q.add_columns(nxt.c.messages.label("next_messages"),
                         nxt_p.c.error.label("next_error")).outerjoin(
        nxt, sa.and_(nxt.c.dataset == results.c.dataset,
                     nxt.c.conversation == prompt_inputs.c.conversation,
                     nxt.c.turn == prompt_inputs.c.turn + 1),
    ).outerjoin(nxt_p, sa.and_(nxt_p.c.dataset == nxt.c.dataset,
                               nxt_p.c.sample_id == nxt.c.sample_id))


def _select(answers: bool = False) -> sa.Select[Any]:
    """Results with their prompts; ``answers``: and each turn's own answer as stored."""
    # LEFT JOINs: a result whose prompt rows are missing must still be seen and accounted.
    q = sa.select(
        results,
        prompt_inputs.c.messages,
        prompt_inputs.c.input_ids,
        prompts.c.max_new_tokens,
        prompt_inputs.c.tools,
        prompt_inputs.c.conversation,
        prompt_inputs.c.turn,
        prompt_inputs.c.template_kwargs,
    ).select_from(
        results.outerjoin(
            prompt_inputs,
            sa.and_(prompt_inputs.c.dataset == results.c.dataset,
                    prompt_inputs.c.sample_id == results.c.sample_id),
        ).outerjoin(
            prompts,
            sa.and_(prompts.c.dataset == results.c.dataset,
                    prompts.c.sample_id == results.c.sample_id),
        )
    )
    return _with_answers(q) if answers else q


def _row(r: sa.Row[Any]) -> ExportRow:
    values = r._asdict()
    values["created_at"] = as_utc(values["created_at"])
    following = values.pop("next_messages", None)
    prompt = values["messages"]
    if following and prompt is not None and len(following) > len(prompt):
        values["answer"] = following[len(prompt)]  # common.conversation.next_turn
    return ExportRow(**values)


def snapshot_id(store: Store, dataset: str) -> int:
    """The newest result id of ``dataset`` now: the export reads up to it and no further,
    so results stored while it runs neither half-appear nor upset validate later."""
    q = sa.select(sa.func.max(results.c.id)).where(results.c.dataset == dataset)
    with store.engine.connect() as conn:
        return int(conn.scalar(q) or 0)


def count_results(store: Store, dataset: str, upto_id: int) -> int:
    q = sa.select(sa.func.count()).where(results.c.dataset == dataset, results.c.id <= upto_id)
    with store.engine.connect() as conn:
        return int(conn.scalar(q) or 0)


def result_counts(store: Store) -> dict[str, int]:
    """Results per dataset, in one GROUP BY over the (dataset, sample_id) index: the total
    a progress bar counts towards before any row is read."""
    q = sa.select(results.c.dataset, sa.func.count()).group_by(results.c.dataset)
    with store.engine.connect() as conn:
        return {name: int(n) for name, n in conn.execute(q)}


def iter_rows(store: Store, dataset: str, upto_id: int, answers: bool = False
              ) -> Iterator[ExportRow]:
    """Every result of ``dataset`` up to ``upto_id``, oldest first, streamed in batches;
    ``answers``: with each turn's own answer as stored (``ExportRow.answer``)."""
    q = (
        _select(answers)
        .where(results.c.dataset == dataset, results.c.id <= upto_id)
        .order_by(results.c.id)
    )
    original = OriginalText(store, dataset)
    with store.engine.connect() as conn:
        stream = conn.execution_options(yield_per=BATCH_ROWS).execute(q)
        for r in stream:
            yield original(_row(r))


def lookup_rows(store: Store, dataset: str, sample_ids: Sequence[str], answers: bool = False
                ) -> dict[str, ExportRow]:
    """The results of these sample ids (those stored), keyed by sample id."""
    found: dict[str, ExportRow] = {}
    original = OriginalText(store, dataset)
    unique = list(dict.fromkeys(sample_ids))
    with store.engine.connect() as conn:
        for start in range(0, len(unique), LOOKUP_CHUNK):
            chunk = unique[start : start + LOOKUP_CHUNK]
            q = _select(answers).where(results.c.dataset == dataset,
                                       results.c.sample_id.in_(chunk))
            for r in conn.execute(q):
                row = original(_row(r))
                found[row.sample_id] = row
    return found
