"""The two steps of a sample's path that a worker's tasks take together.

Before the request: the prompt read and the admission. After it: the charge and the
store. Each task that reaches a step joins the others waiting there (``GroupCall``) and
one of them does the step for all: one SELECT and one batched ADMIT script, then one
batched CHARGE script and one commit. A batched script runs the single script's body
once per call, in order, so the ledger decides exactly what it would for the same calls
made singly; what the group saves is the round trips and per-command work, and the
thread hand-offs each blocking call costs a process of many threads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.db import UNAVAILABLE
from common.kept import is_kept
from common.ledger import Admission, AdmitArgs, Charge, ChargeArgs, ChargeResult, Ledger
from common.rows import NewPrompt, ResultRow
from common.sglang_client import Completion
from common.store import DatasetRow, PromptRow, Store
from workers.results import commit_rows

log = logging.getLogger(__name__)
# Expected output of one request before a dataset has any result (admission estimate).
DEFAULT_EXPECTED_TOKENS = 2048

AdmitItem = tuple[str, str, str]  # dataset, sample_id, rid
Admitted = tuple[PromptRow | None, Admission | None]
# dataset, sample_id, its completion, the marker closing its reasoning (common.kept
# ``sample_closer``: its own draw's)
SettleItem = tuple[DatasetRow, str, Completion, str | None]
Decoder = Callable[[Sequence[int]], str]
# Builds a sample's row from its charge and its reasoning closer (the worker's
# ``WorkerContext.result_row``).
RowBuilder = Callable[[DatasetRow, str, Completion, ChargeResult, str | None], ResultRow]
# The prompts kept rows make possible, by row key (workers/turns.py ``NextTurns.build``).
FollowBuilder = Callable[[list[tuple[DatasetRow, ResultRow]]],
                         dict[tuple[str, str], NewPrompt]]


@dataclass(frozen=True)
class Settled:
    """A sample's charge, and what became of its row."""

    charge: ChargeResult
    row: ResultRow | None  # None: the charge refused the sample, nothing to store
    inserted: bool = False
    error: BaseException | None = None  # the store's error; the charge stands
    then: NewPrompt | None = None  # the prompt stored with the row: the next turn, if any


def admit_group(store: Store, ledger: Ledger, items: list[AdmitItem]) -> list[Admitted]:
    """Each item's prompt, and for a prompt still queued the ledger's admission."""
    prompts = store.prompts([(dataset, sample_id) for dataset, sample_id, _ in items])
    queued = [(i, AdmitArgs(p.dataset, rid, p.max_new_tokens, DEFAULT_EXPECTED_TOKENS))
              for i, (p, (_, _, rid)) in enumerate(zip(prompts, items, strict=True))
              if p is not None and p.state == "queued"]
    admissions: list[Admission | None] = [None] * len(items)
    # Asked even when no prompt is queued: the same answer says whether this Redis is still
    # paired with this worker's database, before the message of a prompt that is missing
    # or settled here is dropped or its result counted in a ledger.
    granted = ledger.admit_many([a for _, a in queued], store.store_id)
    for (i, _), admission in zip(queued, granted, strict=True):
        admissions[i] = admission
    return list(zip(prompts, admissions, strict=True))


def settle_group(store: Store, ledger: Ledger, build_row: RowBuilder,
                 items: list[SettleItem], follow: FollowBuilder | None = None,
                 ) -> list[Settled]:
    """Charge every sample, then store in one commit what each charge allows, with the
    prompts the kept rows make possible (``follow``: a conversation's next turns)."""
    # Charged only while this Redis is still paired with this worker's database: a
    # request sent before another run took it must not count in that run's budget.
    charges = ledger.charge_many([
        ChargeArgs(ds.name, sample_id, c.rid, c.prompt_tokens, c.completion_tokens,
                   is_kept(c.finish_type, c.text, closer))
        for ds, sample_id, c, closer in items], store.store_id)
    rows: dict[int, ResultRow] = {}
    failed: dict[int, Exception] = {}
    for i, ((ds, sample_id, c, closer), charge) in enumerate(zip(items, charges, strict=True)):
        if charge.status is not Charge.REFUSED:
            try:
                rows[i] = build_row(ds, sample_id, c, charge, closer)
            except Exception as exc:  # this sample's own fault: the others are stored
                failed[i] = exc
    then: dict[tuple[str, str], NewPrompt] = {}
    try:
        then = _follows(follow, [(items[i][0], row) for i, row in rows.items()])
        stored = dict(zip(rows, commit_rows(store, list(rows.values()), then), strict=True))
    except UNAVAILABLE as exc:
        stored = dict.fromkeys(rows, exc)  # each task waits the database out for its row
    settled = []
    for i, charge in enumerate(charges):
        outcome = stored.get(i, failed.get(i))
        row = rows.get(i)
        follows = then.get(row.key) if row is not None else None
        if isinstance(outcome, BaseException):
            settled.append(Settled(charge, row, error=outcome, then=follows))
        else:
            settled.append(Settled(charge, row, inserted=bool(outcome), then=follows))
    return settled


def _follows(follow: FollowBuilder | None, kept: list[tuple[DatasetRow, ResultRow]]
             ) -> dict[tuple[str, str], NewPrompt]:
    """The prompts the kept rows make possible. A failure to build them other than the
    database being away (which every task waits out, building its own again) must not
    cost the group its results, charged already: they are stored without, and logged."""
    if follow is None or not kept:
        return {}
    try:
        return follow(kept)
    except UNAVAILABLE:
        raise
    except Exception:
        log.exception("next turns of %d stored rows not built; their conversations end "
                      "there", len(kept))
        return {}


def result_row(ds: DatasetRow, sample_id: str, c: Completion, charge: ChargeResult,
               closer: str | None, *, model: str,
               decoder: Callable[[str], Decoder | None]) -> ResultRow:
    """The row to keep: the output as charged; one cut to the budget (``exact``) is
    re-decoded with ``decoder(tokenizer)``, loaded only then. ``closer``: the marker
    closing the sample's reasoning, for whether the exports keep it (common.kept)."""
    ids, text, finish = c.output_ids, c.text, c.finish_type
    if charge.status is Charge.CHARGED and charge.kept_completion_tokens < c.completion_tokens:
        ids = ids[: charge.kept_completion_tokens]
        decode = decoder(ds.tokenizer)
        text = decode(ids) if decode else ""
        finish = "budget"
    return ResultRow(
        dataset=ds.name,
        sample_id=sample_id,
        rid=c.rid,
        prompt_tokens=c.prompt_tokens,
        completion_tokens=len(ids),
        cached_tokens=c.cached_tokens,
        reasoning_tokens=min(c.reasoning_tokens, len(ids)),
        finish_reason=finish,
        finish_detail=c.finish_detail,
        output_ids=ids,
        output_text=text,
        e2e_latency_s=c.e2e_latency_s,
        server=c.server,
        model=model,
        sampling=c.sampling_params,
        kept=is_kept(finish, text, closer),
    )
