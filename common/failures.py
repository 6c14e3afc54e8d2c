"""Failed prompts: the run of identical failures that stops a dataset, and their return.

A permanent error that every sample of a dataset meets (a sampling value the server
refuses, a server that lacks a feature) would otherwise fail the prompts one by one until
none is left. Workers stop the dataset instead once ``Settings.stop_after_failures``
prompts have failed with the same message since its last result: the stop is a close
with the reason ``stopped`` (common/closing.py), so its queue is purged, its reserved
tasks revoked and its remaining prompts left ``queued``. ``datagen retry`` puts failed
prompts back and clears the stop.
"""

from __future__ import annotations

import sqlalchemy as sa

from common.order import rank_key
from common.schema import datasets, prompts, results, utcnow
from common.store import Store

# The close reason of a dataset stopped by its failures (budget and manual are the others).
STOPPED = "stopped"


def streak(store: Store, dataset: str, error: str) -> int:
    """Prompts of ``dataset`` that failed with exactly ``error`` since its last stored result
    and since its terms last changed (an enqueue, a retry, a reopen starts a new count)."""
    last_result = (sa.select(sa.func.max(results.c.created_at))
                   .where(results.c.dataset == dataset).scalar_subquery())
    terms_changed = (sa.select(datasets.c.updated_at)
                     .where(datasets.c.name == dataset).scalar_subquery())
    q = sa.select(sa.func.count()).where(
        prompts.c.dataset == dataset, prompts.c.state == "failed",
        prompts.c.error == error[:4000], prompts.c.updated_at > terms_changed,
        sa.or_(last_result.is_(None), prompts.c.updated_at > last_result))
    with store.engine.connect() as conn:
        return int(conn.scalar(q) or 0)


def requeue_failed(store: Store, dataset: str, containing: str | None = None) -> list[str]:
    """Set the dataset's failed prompts (those whose error contains ``containing``, any
    case) back to queued with no attempts; returns their sample ids, in the dataset's
    publishing order. A prompt with no token ids (a conversation's turn that could not be
    rendered) stays failed: there is nothing to send.

    One UPDATE ... RETURNING: a prompt is returned by one call only, however many run at
    once, so two retries never send it twice.
    """
    where = [prompts.c.dataset == dataset, prompts.c.state == "failed",
             # A later turn that could not be built has no prompt to send again.
             prompts.c.prompt_tokens > 0]
    if containing:
        where.append(sa.func.lower(prompts.c.error).contains(containing.lower(),
                                                              autoescape=True))
    q = (prompts.update().where(*where)
         .values(state="queued", attempts=0, error=None, updated_at=utcnow())
         .returning(prompts.c.sample_id, prompts.c.rank))
    with store.engine.begin() as conn:
        back = conn.execute(q).all()
    return [sid for sid, _ in sorted(back, key=lambda r: rank_key(r.rank, r.sample_id))]


def commonest_error(store: Store, dataset: str) -> tuple[str, int] | None:
    """The error most of the dataset's failed prompts share, and how many share it."""
    n = sa.func.count().label("n")
    q = (sa.select(prompts.c.error, n)
         .where(prompts.c.dataset == dataset, prompts.c.state == "failed")
         .group_by(prompts.c.error).order_by(n.desc()).limit(1))
    with store.engine.connect() as conn:
        row = conn.execute(q).first()
    return None if row is None else (str(row.error or ""), int(row.n))


def unsendable_failures(store: Store, dataset: str) -> int:
    """Failed prompts with no token ids, which ``requeue_failed`` leaves failed."""
    q = sa.select(sa.func.count()).where(prompts.c.dataset == dataset,
                                         prompts.c.state == "failed",
                                         prompts.c.prompt_tokens == 0)
    with store.engine.connect() as conn:
        return int(conn.scalar(q) or 0)
