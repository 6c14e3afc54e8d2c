"""One sample's path: admit → /generate → charge → store. Plain functions, no Celery.

Safe to run twice for the same sample: the ledger charges a sample once and SQL keeps
one result per (dataset, sample_id). The charge comes before the store because under
the abort and exact policies it decides what is stored (nothing, or a cut output).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from enum import StrEnum
from typing import Any, TypeVar

import redis
import sqlalchemy as sa

from common.closing import after_close
from common.db import UNAVAILABLE
from common.draws import draw_id, seed_of
from common.errors import TransientError, UnstorableResult
from common.kept import sample_closer
from common.ledger import Admission, Charge
from common.reconcile import reconcile_dataset
from common.rids import new_rid
from common.rows import NewPrompt, ResultRow
from common.sglang_client import Completion
from common.store import DatasetRow, PromptRow
from workers.context import WorkerContext
from workers.gate import GateTimeout
from workers.inflight import give_back
from workers.steps import DEFAULT_EXPECTED_TOKENS
from workers.turns import publish_next, publish_stored_next

log = logging.getLogger(__name__)
OUTAGE_WINDOW_S = 600.0
T = TypeVar("T")


class Outcome(StrEnum):
    DONE = "done"
    ALREADY_DONE = "already-done"
    DUPLICATE = "duplicate"
    CLOSED = "dropped-closed"
    WAIT = "wait-budget"
    GATED = "wait-gate"
    DISCARDED = "discarded"
    FINISHED = "already-finished"
    MISSING = "missing-prompt"


def _draw(ds: DatasetRow, prompt: PromptRow) -> tuple[int, str]:
    """What the prompt's draws are keyed by (common/draws.py): a pure function, so a
    redelivery draws the same, and the same the producer rendered the prompt with."""
    return seed_of(ds.order.seed), draw_id(prompt.sample_id, prompt.conversation)


def sampling_params(ds: DatasetRow, prompt: PromptRow) -> dict[str, Any]:
    """What the request sends: the dataset's sampling, the values drawn for the prompt
    and its cap."""
    params = {k: v for k, v in ds.sampling.items() if k != "max_new_tokens"}
    if ds.mixtures:
        params.update(ds.mixtures.sampling(*_draw(ds, prompt)))
    params["max_new_tokens"] = prompt.max_new_tokens
    return params


def reasoning_closer(ds: DatasetRow, prompt: PromptRow) -> str | None:
    """The marker closing the prompt's reasoning block: its own template draw's."""
    drawn = ds.mixtures.template(*_draw(ds, prompt)) if ds.mixtures.template_keys else None
    return sample_closer(ds, drawn)


def run_sample(ctx: WorkerContext, dataset: str, sample_id: str) -> Outcome:
    """Run one sample: its prompt read and admission, request, charge and store."""
    if ctx.gate is None:
        return _run_at(ctx, dataset, sample_id, ctx.client.pick_server(), _nothing)
    # Under concurrency auto, a place at a server first: a task that waits for one holds
    # no admission against the budget. The place is given back once the answer is in.
    try:
        with ctx.gate.slot(ctx.client.pick_server) as slot:
            return _run_at(ctx, dataset, sample_id, slot.server, slot.release)
    except GateTimeout:
        return Outcome.GATED


def _nothing() -> None:
    return None


def _run_at(ctx: WorkerContext, dataset: str, sample_id: str, server: str,
            answered: Callable[[], None]) -> Outcome:
    # The server is chosen before the rid, which names it for the aborts of a close.
    rid = new_rid(dataset, server)
    # Claimed before ADMIT (which comes with the prompt read), so the reaper never frees a
    # reservation this process holds.
    ctx.live_rids.add(rid)
    try:
        prompt, admission = ctx.admissions((dataset, sample_id, rid))
        if prompt is None:
            log.warning("no stored prompt for %s/%s; dropping the message", dataset, sample_id)
            return Outcome.MISSING
        if prompt.state != "queued" or admission is None:
            return _settle_finished(ctx, dataset, prompt)
        return _generate(ctx, prompt, server, rid, admission, answered)
    except BaseException:
        # Whatever failed after ADMIT may have run (an answer lost to a reset connection):
        # free the reservation, or the dataset's admission would count it for good.
        give_back(ctx.ledger, ctx.live_rids, [(dataset, rid)])
        raise
    finally:
        ctx.live_rids.discard(rid)


def _generate(ctx: WorkerContext, prompt: PromptRow, server: str, rid: str,
              admission: Admission, answered: Callable[[], None]) -> Outcome:
    if admission is Admission.UNKNOWN:
        # The ledger lost its terms (Redis restarted): rebuild them from SQL, then ask again.
        reconcile_dataset(ctx.store, ctx.ledger, prompt.dataset)
        admission = ctx.ledger.admit(prompt.dataset, rid, prompt.max_new_tokens,
                                     DEFAULT_EXPECTED_TOKENS, ctx.store.store_id)
    if admission is Admission.CLOSED:
        return Outcome.CLOSED
    if admission is not Admission.ADMITTED:
        return Outcome.WAIT
    ds = ctx.dataset(prompt.dataset)
    # A streamed request's started mark (workers/started.py) goes with the rid's inflight
    # entry, in the charge or the release.
    streamed = ds.budget.streams_requests
    on_start = functools.partial(ctx.started.mark, ds.name, rid) if streamed else None
    try:
        with ctx.metrics.request(prompt.dataset):
            completion = ctx.client.generate(server, rid, prompt.input_ids,
                                             sampling_params(ds, prompt), on_start)
    finally:
        if streamed:
            ctx.started.forget(rid)
    answered()  # the server is done with it: its place goes to the next request now
    if completion.finish_type == "abort":
        return _aborted(ctx, prompt.dataset, prompt.sample_id, rid, completion)
    return keep(ctx, ds, prompt.sample_id, completion, reasoning_closer(ds, prompt))


def keep(ctx: WorkerContext, ds: DatasetRow, sample_id: str, completion: Completion,
         closer: str | None) -> Outcome:
    """Charge the sample, then store what the charge allows (``closer``: the marker closing
    its reasoning, for whether it is kept)."""
    settled = ctx.settlements((ds, sample_id, completion, closer))
    charge, row, then = settled.charge, settled.row, settled.then
    if charge.status is Charge.REFUSED:
        ctx.metrics.discarded.labels(ds.name).inc()
        return Outcome.DISCARDED
    if row is not None and isinstance(settled.error, UNAVAILABLE):
        # Charged, but the database was away: store this row alone once it is back.
        inserted, then = _save_alone(ctx, ds, row, then)
    elif settled.error is not None:
        raise unstorable(settled.error) from settled.error
    else:
        inserted = settled.inserted
    if inserted and row is not None:
        ctx.metrics.stored(row)
    if charge.status is Charge.DUPLICATE and inserted and row is not None:
        # Charged before a crash that lost the store: price the result now kept.
        cost = ds.budget.cost(row.prompt_tokens, row.completion_tokens, row.kept)
        ctx.ledger.recharge(ds.name, sample_id, cost, ctx.store.store_id)
    if inserted and then is not None and then.state == "queued":
        publish_next(ctx.publisher, ctx.ledger, ds, then.sample_id)
    if charge.crossed:
        log.info("dataset %s crossed its budget at %d tokens; purged %d queued",
                 ds.name, charge.used_tokens, charge.purged)
        ctx.metrics.closes.labels(ds.name, "budget").inc()
        # Only this task knows the crossing: a retry of it would find its sample done and
        # leave the close unrecorded in SQL and its aborts unsent, so it waits out a
        # database or Redis restart here.
        wait_out_outage(lambda: after_close(ds.name, store=ctx.store, ledger=ctx.ledger,
                                          app=ctx.app, client=ctx.client),
                      retry_on=(*UNAVAILABLE, redis.RedisError))
    return Outcome.DONE if inserted else Outcome.DUPLICATE


def _save_alone(ctx: WorkerContext, ds: DatasetRow, row: ResultRow,
                then: NewPrompt | None) -> tuple[bool, NewPrompt | None]:
    """Store a row alone, with its next turn (built now if the database was away when its
    group built them)."""
    def save() -> tuple[bool, NewPrompt | None]:
        follow = then or ctx.next_turns.build([(ds, row)]).get(row.key)
        return ctx.results.save(row, follow), follow

    try:
        return wait_out_outage(save)
    except UNAVAILABLE:
        raise
    except Exception as exc:
        raise unstorable(exc) from exc


def unstorable(exc: BaseException) -> UnstorableResult:
    """The sample's own failure for an error storing its row (or building it): the same
    row would fail again, so its message must not come back for ever."""
    if not isinstance(exc, sa.exc.SQLAlchemyError):  # the row could not even be built
        return UnstorableResult(str(exc))
    cause = exc.orig if isinstance(exc, sa.exc.StatementError) and exc.orig else exc
    first = (str(cause).strip().splitlines() or [""])[0]  # not SQLAlchemy's SQL and values
    return UnstorableResult(f"the result could not be stored: {type(cause).__name__}: "
                            f"{first}")


def _settle_finished(ctx: WorkerContext, dataset: str, prompt: PromptRow) -> Outcome:
    """A redelivered message whose sample is already settled: only make sure it is counted."""
    if prompt.state == "done":
        ds = ctx.dataset(dataset)
        ctx.ledger.absorb(dataset, ctx.store.result_costs(dataset, ds.budget, [prompt.sample_id]))
        if ds.turns == "all":
            publish_stored_next(ctx.store, ctx.publisher, ctx.ledger, ds, prompt.sample_id)
        return Outcome.ALREADY_DONE
    return Outcome.FINISHED


def _aborted(
    ctx: WorkerContext, dataset: str, sample_id: str, rid: str, completion: Completion
) -> Outcome:
    ctx.ledger.release(dataset, rid)
    if ctx.ledger.is_closed(dataset):
        log.info("%s/%s aborted after its dataset closed: %d partial tokens not kept",
                 dataset, sample_id, completion.completion_tokens)
        ctx.metrics.discarded.labels(dataset).inc()
        return Outcome.DISCARDED
    message = completion.finish_detail.get("message", "aborted")
    raise TransientError(f"{completion.server}: request aborted by the server ({message})",
                         server=completion.server)


def wait_out_outage(fn: Callable[[], T], window_s: float = OUTAGE_WINDOW_S,
                    retry_on: tuple[type[Exception], ...] = UNAVAILABLE,
                    failing: Callable[[], str] | None = None) -> T:
    """Call ``fn`` until it gets past a database restart (or the other outages ``retry_on``
    names), for up to ``window_s``, rather than lose a generated sample. ``failing`` says
    in the log what did not go through (by default: Redis, or the database, unavailable);
    it is called only if something failed."""
    deadline, delay = time.monotonic() + window_s, 0.5
    while True:
        try:
            return fn()
        except retry_on as exc:
            if time.monotonic() > deadline:
                raise
            what = failing() if failing else (
                "Redis unavailable" if isinstance(exc, redis.RedisError)
                else "database unavailable")
            # SQLAlchemy's errors carry the driver's as .orig, Celery's Reject its cause
            # as .reason.
            cause = getattr(exc, "orig", None) or getattr(exc, "reason", None) or exc
            log.warning("%s (%s); retrying in %.1fs", what, cause, delay)
            time.sleep(delay)
            delay = min(delay * 2, 15.0)
