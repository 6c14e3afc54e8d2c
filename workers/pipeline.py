"""One sample's path: admit → /generate → charge → store. Plain functions, no Celery.

Safe to run twice for the same sample: the ledger charges a sample once and SQL keeps
one result per (dataset, sample_id). The charge comes before the store because under
the abort and exact policies it decides what is stored (nothing, or a cut output).
"""

from __future__ import annotations

import logging
import time
import uuid
from enum import StrEnum
from typing import Any

import redis
from sqlalchemy.exc import OperationalError

from common.closing import after_close
from common.errors import TransientError
from common.ledger import Admission, Charge, ChargeResult
from common.reconcile import reconcile_dataset
from common.sglang_client import Completion
from common.store import DatasetRow, PromptRow
from workers.context import WorkerContext

log = logging.getLogger(__name__)
# Expected output of one request before a dataset has any result (admission estimate).
DEFAULT_EXPECTED_TOKENS = 2048
DB_RETRY_WINDOW_S = 600.0


class Outcome(StrEnum):
    DONE = "done"
    ALREADY_DONE = "already-done"
    DUPLICATE = "duplicate"
    CLOSED = "dropped-closed"
    WAIT = "wait-budget"
    DISCARDED = "discarded"
    FINISHED = "already-finished"
    MISSING = "missing-prompt"


def new_rid(dataset: str) -> str:
    # uuid first: SGLang aborts by rid *prefix*, so no rid may be a prefix of another.
    return f"{uuid.uuid4().hex}-{dataset}"


def sampling_params(ds: DatasetRow, prompt: PromptRow) -> dict[str, Any]:
    params = {k: v for k, v in ds.sampling.items() if k != "max_new_tokens"}
    params["max_new_tokens"] = prompt.max_new_tokens
    return params


def run_sample(ctx: WorkerContext, dataset: str, sample_id: str) -> Outcome:
    prompt = ctx.prompts((dataset, sample_id))
    if prompt is None:
        log.warning("no stored prompt for %s/%s; dropping the message", dataset, sample_id)
        return Outcome.MISSING
    if prompt.state != "queued":
        return _settle_finished(ctx, dataset, prompt)
    rid = new_rid(dataset)
    # Claimed before ADMIT, so the reaper never frees a reservation this process holds.
    ctx.live_rids.add(rid)
    try:
        return _generate(ctx, prompt, rid)
    except BaseException:
        # Whatever failed after ADMIT may have run (an answer lost to a reset connection):
        # free the reservation, or the dataset's admission would count it for good.
        _release_quietly(ctx, dataset, rid)
        raise
    finally:
        ctx.live_rids.discard(rid)


def _generate(ctx: WorkerContext, prompt: PromptRow, rid: str) -> Outcome:
    admission = _admit(ctx, prompt, rid)
    if admission is Admission.CLOSED:
        return Outcome.CLOSED
    if admission is not Admission.ADMITTED:
        return Outcome.WAIT
    ds = ctx.dataset(prompt.dataset)
    server = ctx.client.pick_server()
    completion = ctx.client.generate(server, rid, prompt.input_ids, sampling_params(ds, prompt))
    if completion.finish_type == "abort":
        return _aborted(ctx, prompt.dataset, prompt.sample_id, rid, completion)
    return keep(ctx, ds, prompt.sample_id, completion)


def _release_quietly(ctx: WorkerContext, dataset: str, rid: str) -> None:
    try:
        ctx.ledger.release(dataset, rid)
    except redis.RedisError:
        log.warning("could not release %s's reservation %s; Redis does not answer", dataset, rid)


def _admit(ctx: WorkerContext, prompt: PromptRow, rid: str) -> Admission:
    """Ask the ledger for room; a ledger that lost its terms is rebuilt from SQL first."""
    args = (prompt.dataset, rid, prompt.max_new_tokens, DEFAULT_EXPECTED_TOKENS)
    admission = ctx.ledger.admit(*args)
    if admission is Admission.UNKNOWN:
        reconcile_dataset(ctx.store, ctx.ledger, prompt.dataset)
        admission = ctx.ledger.admit(*args)
    return admission


def keep(ctx: WorkerContext, ds: DatasetRow, sample_id: str, completion: Completion) -> Outcome:
    """Charge the sample, then store what the charge allows."""
    charge = ctx.ledger.charge(
        ds.name, sample_id, completion.rid, completion.prompt_tokens, completion.completion_tokens
    )
    if charge.status is Charge.REFUSED:
        return Outcome.DISCARDED
    row = result_row(ctx, ds, sample_id, completion, charge)
    inserted = with_db_retry(lambda: ctx.results.save(row))
    if charge.status is Charge.DUPLICATE and inserted:
        # Charged before a crash that lost the store: price the result now kept.
        cost = ds.budget.cost(row["prompt_tokens"], row["completion_tokens"])
        ctx.ledger.recharge(ds.name, sample_id, cost)
    if charge.crossed:
        log.info("dataset %s crossed its budget at %d tokens; purged %d queued",
                 ds.name, charge.used_tokens, charge.purged)
        after_close(ds.name, store=ctx.store, ledger=ctx.ledger, app=ctx.app, client=ctx.client)
    return Outcome.DONE if inserted else Outcome.DUPLICATE


def _settle_finished(ctx: WorkerContext, dataset: str, prompt: PromptRow) -> Outcome:
    """A redelivered message whose sample is already settled: only make sure it is counted."""
    if prompt.state == "done":
        ds = ctx.dataset(dataset)
        ctx.ledger.absorb(dataset, ctx.store.result_costs(dataset, ds.budget, [prompt.sample_id]))
        return Outcome.ALREADY_DONE
    return Outcome.FINISHED


def _aborted(
    ctx: WorkerContext, dataset: str, sample_id: str, rid: str, completion: Completion
) -> Outcome:
    ctx.ledger.release(dataset, rid)
    if ctx.ledger.is_closed(dataset):
        log.info("%s/%s aborted after its dataset closed: %d partial tokens not kept",
                 dataset, sample_id, completion.completion_tokens)
        return Outcome.DISCARDED
    message = completion.finish_detail.get("message", "aborted")
    raise TransientError(f"{completion.server}: request aborted by the server ({message})",
                         server=completion.server)


def result_row(
    ctx: WorkerContext, ds: DatasetRow, sample_id: str, c: Completion, charge: ChargeResult
) -> dict[str, Any]:
    ids, text, finish = c.output_ids, c.text, c.finish_type
    if charge.status is Charge.CHARGED and charge.kept_completion_tokens < c.completion_tokens:
        ids = ids[: charge.kept_completion_tokens]
        decode = ctx.decoder(ds.tokenizer)
        text = decode(ids) if decode else ""
        finish = "budget"
    return {
        "dataset": ds.name,
        "sample_id": sample_id,
        "rid": c.rid,
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": len(ids),
        "cached_tokens": c.cached_tokens,
        "reasoning_tokens": min(c.reasoning_tokens, len(ids)),
        "finish_reason": finish,
        "finish_detail": c.finish_detail,
        "output_ids": ids,
        "output_text": text,
        "e2e_latency_s": c.e2e_latency_s,
        "server": c.server,
        "model": ctx.client.model(c.server),
    }


def with_db_retry(fn: Any, window_s: float = DB_RETRY_WINDOW_S) -> Any:
    """Wait out a database restart rather than lose a generated sample."""
    deadline, delay = time.monotonic() + window_s, 0.5
    while True:
        try:
            return fn()
        except OperationalError as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("database unavailable (%s); retrying in %.1fs", exc.orig, delay)
            time.sleep(delay)
            delay = min(delay * 2, 15.0)
