"""``datagen purge`` and ``datagen reopen``: close a dataset by hand, or give it more room."""

from __future__ import annotations

import argparse

from common.budget import parse_budget_tokens
from common.celery_app import make_celery
from common.closing import after_close
from common.errors import ConfigError
from common.publish import Publisher
from common.services import connect
from common.settings import Settings
from common.sglang_client import SGLangClient


def run_purge(args: argparse.Namespace, settings: Settings) -> int:
    store, ledger = connect(settings)
    ds = store.dataset(args.name)
    result = ledger.close(ds.name, "manual")
    client = SGLangClient(settings.sglang_urls, connect_timeout_s=settings.connect_timeout_s)
    after_close(ds.name, store=store, ledger=ledger, app=make_celery(settings), client=client)
    state = ledger.state(ds.name)
    verb = "closed" if result.closed_now else "was already closed"
    fate = "finish and are kept" if ds.budget.policy == "drain" else "were aborted"
    print(f"{ds.name}: {verb}; removed {result.purged:,} queued messages; reserved tasks "
          f"revoked; {state.inflight} requests in flight {fate}; "
          f"{state.used_tokens:,} of {ds.budget.tokens:,} tokens used")
    return 0


def run_reopen(args: argparse.Namespace, settings: Settings) -> int:
    store, ledger = connect(settings)
    ds = store.dataset(args.name)
    budget = parse_budget_tokens(args.budget_tokens)
    used = store.used_tokens(ds.name, ds.budget)
    if budget <= used:
        raise ConfigError(
            f"{ds.name} has used {used:,} tokens; a budget of {budget:,} leaves no room"
        )
    store.record_reopen(ds.name, budget)
    ledger.reopen(ds.name, budget)
    stamp = store.dataset(ds.name).stamp
    remaining = store.sample_ids(ds.name, "queued")
    publisher = Publisher(make_celery(settings))
    publisher.publish_all(ds.name, stamp, remaining)
    publisher.announce([ds.name])
    print(f"{ds.name}: reopened with a budget of {budget:,} tokens ({used:,} used); "
          f"{len(remaining):,} prompts enqueued")
    return 0
