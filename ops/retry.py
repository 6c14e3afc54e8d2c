"""``datagen retry NAME``: send a dataset's failed prompts again, and clear its stop.

The order keeps a crash at any point harmless: the sampling is fixed first; the failed
prompts are set back to queued in one UPDATE that hands each to one caller only; then a
stopped dataset is reopened, and only then are messages published. A prompt queued in
SQL without a message (a crash before the publish) goes out with the next retry of the
stopped dataset, or with the workers' sweep.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from common.audit import lost_queued, queued_in_redis
from common.celery_app import make_celery
from common.errors import ConfigError
from common.failures import STOPPED, requeue_failed, unsendable_failures
from common.ledger import Ledger
from common.publish import Publisher
from common.reconcile import reconcile_dataset
from common.sampling_rules import add_sampling_flags, sampling_flags
from common.services import connect
from common.settings import Settings
from common.store import DatasetRow, Store

# How long retry waits for a stopped dataset's requests in flight (each answered with the
# error that stopped it, at once) and its messages workers hold (dropped by the revoke).
INFLIGHT_WAIT_S = 60.0


def add_retry_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("retry", help="send a dataset's failed prompts again; clears a stop")
    r.add_argument("name")
    r.add_argument("--error", metavar="TEXT",
                   help="only the prompts whose error contains TEXT (any case)")
    add_sampling_flags(r, help="set the dataset's sampling first")


def run_retry(args: argparse.Namespace, settings: Settings) -> int:
    # Checked before anything changes: a value SGLang refuses would fail them all again.
    fixed = sampling_flags(args)
    store, ledger = connect(settings)
    ds = store.dataset(args.name)
    mixed = sorted(set(fixed) & set(ds.mixtures.choices))
    if mixed:
        # Its samples draw the key: a fixed value would never be sent.
        raise ConfigError(f"dataset {ds.name} draws {', '.join(mixed)} from a mixture "
                          f"({ds.mixtures.describe()}); retry cannot fix it")
    reconcile_dataset(store, ledger, ds.name)  # a Redis that lost the ledger learns the stop
    if fixed:
        store.set_sampling(ds.name, {**ds.sampling, **fixed})
    stopped = is_stopped(ds, ledger)
    if stopped:
        wait_for_inflight(ledger, ds.name)
    back = requeue_failed(store, ds.name, args.error)
    if not back and not stopped:
        print(f"{ds.name}: {_sampling_note(fixed)}no failed prompts{_matching(args.error)}; "
              "nothing to retry")
        _note_unsendable(store, ds.name)
        return 0
    wait_for_workers_terms(store, ds.name)
    if stopped:
        store.record_reopen(ds.name, ds.budget.tokens)
        ledger.reopen(ds.name, ds.budget.tokens)
        reconcile_dataset(store, ledger, ds.name)  # closes it again if its budget is spent
    sent = _send(settings, store, ledger, ds.name, back, stopped)
    print(_report(ds, fixed, len(back), stopped, sent, ledger.state(ds.name).close_reason))
    _note_unsendable(store, ds.name)
    return 0


def _note_unsendable(store: Store, name: str) -> None:
    left = unsendable_failures(store, name)
    if left:
        print(f"{name}: {left} failed turns could not be built (no prompt to send); they stay "
              "failed: `SELECT sample_id, error FROM prompts WHERE state = 'failed' AND "
              "prompt_tokens = 0` lists them")


def is_stopped(ds: DatasetRow, ledger: Ledger) -> bool:
    # Either side: a worker that died between the ledger's close and SQL's record of it
    # leaves only the ledger knowing.
    return STOPPED in (ds.close_reason, ledger.state(ds.name).close_reason)


def wait_for_inflight(ledger: Ledger, name: str, timeout_s: float = INFLIGHT_WAIT_S) -> None:
    """Let what a stop left with the workers end first: requests in flight, each failing
    (or succeeding) on its own, and messages they had reserved, which the stop's revoke
    drops. A prompt that failed after this command's reset would stay failed, and one
    whose message was still held would not be sent again."""
    deadline, told = time.monotonic() + timeout_s, False
    while time.monotonic() < deadline:
        inflight = ledger.state(name).inflight
        held = queued_in_redis(ledger.redis, name)
        if not inflight and not held:
            return
        if not told:
            print(f"{name}: waiting for {inflight} requests in flight and {len(held)} "
                  "messages held by workers to end", file=sys.stderr)
            told = True
        time.sleep(0.5)


def wait_for_workers_terms(store: Store, name: str) -> None:
    """Wait until every worker has re-read the dataset's row changed in the last seconds
    (a sampling fixed by this command or by ``datagen enqueue``): a prompt sent before
    would be generated with the old values, and fail again."""
    from workers.context import DATASET_STALE_S

    changed = store.terms_changed_at(name)
    if changed is None:
        return
    left = changed.timestamp() + DATASET_STALE_S - time.time()
    if left > 0:
        time.sleep(min(left, DATASET_STALE_S))


def _send(settings: Settings, store: Store, ledger: Ledger, name: str, back: list[str],
          stopped: bool) -> int | None:
    """Publish the prompts to run again; None while the dataset stays closed."""
    if ledger.is_closed(name):
        return None
    to_send = back
    if stopped:
        # The stop purged the queue: every queued prompt Redis does not hold goes out.
        to_send = lost_queued(store, ledger.redis, name)
    publisher = Publisher(make_celery(settings))
    publisher.publish_all(name, store.dataset(name).stamp, to_send)
    publisher.announce([name])
    return len(to_send)


def _sampling_note(fixed: dict[str, Any]) -> str:
    if not fixed:
        return ""
    return "sampling now " + ", ".join(f"{k}={v}" for k, v in fixed.items()) + "; "


def _matching(error: str | None) -> str:
    return f" whose error contains {error!r}" if error else ""


def _report(ds: DatasetRow, fixed: dict[str, Any], back: int, stopped: bool,
            sent: int | None, close_reason: str | None) -> str:
    parts = [f"{ds.name}: {back:,} failed prompts back to queued, attempts reset"]
    if fixed:
        parts.append(_sampling_note(fixed).removesuffix("; "))
    if stopped and sent is not None:
        parts.append("no longer stopped")
    if sent is None:
        parts.append(f"the dataset is closed ({close_reason or 'manual'}): they go out with "
                     f"`datagen reopen {ds.name} --budget-tokens N`")
    else:
        parts.append(f"{sent:,} prompts enqueued")
    return "; ".join(parts)
