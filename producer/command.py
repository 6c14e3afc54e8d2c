"""``datagen enqueue``: parse flags, connect, run the Enqueuer, print the summary."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from common.budget import Budget, parse_budget_tokens
from common.celery_app import make_celery
from common.console import make_console
from common.errors import ConfigError
from common.order import OrderRequest
from common.progress_bar import ProgressBar
from common.sampling_rules import sampling_flags
from common.services import connect
from common.settings import Settings
from producer.enqueue import DatasetSummary, Enqueuer, Limits
from producer.mixes import parse_mix_flags
from producer.plan import (
    DEFAULT_SAMPLING,
    DatasetPlan,
    Draws,
    plans_from_manifest,
    plans_from_paths,
)
from producer.template import BUNDLED_TOKENIZER, ChatTemplater

MAX_PROBLEMS_SHOWN = 20


def count_lines(path: Path) -> int:
    """Lines in a file, for the progress bar's total, at disk speed."""
    with open(path, "rb") as fh:
        return sum(block.count(b"\n") for block in iter(lambda: fh.read(1 << 20), b""))


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    # Checked here, before anything is stored: a value SGLang refuses fails every sample.
    return {**DEFAULT_SAMPLING, **sampling_flags(args)}


def _template_kwargs(raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--chat-template-kwargs is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError("--chat-template-kwargs must be a JSON object, e.g. {\"thinking\": true}")
    return value


def build_plans(args: argparse.Namespace, settings: Settings) -> list[DatasetPlan]:
    tokens = parse_budget_tokens(args.budget_tokens or settings.default_budget_tokens)
    budget = Budget(tokens, args.budget_basis, args.policy)
    if args.max_new_tokens <= 0 or args.max_seq_len <= 1:
        raise ConfigError("--max-new-tokens and --max-seq-len must be positive")
    order = OrderRequest(args.order, args.seed, settings.default_seed)
    draws = Draws(parse_mix_flags(getattr(args, "mix", None)),
                  getattr(args, "generations", None))
    if args.manifest:
        return plans_from_manifest(args.manifest, budget, _sampling(args), args.max_new_tokens,
                                   args.turns, order, draws, args.tool_call_parser)
    if not args.paths:
        raise ConfigError("give prompt files or folders, or --manifest FILE")
    return plans_from_paths(args.paths, budget, _sampling(args), args.max_new_tokens,
                            args.turns, order, draws, args.tool_call_parser)


def run_enqueue(args: argparse.Namespace, settings: Settings) -> int:
    plans = build_plans(args, settings)
    tokenizer = args.tokenizer or settings.tokenizer or str(BUNDLED_TOKENIZER)
    trust = bool(args.trust_remote_code or settings.trust_remote_code)
    templater = ChatTemplater(tokenizer, _template_kwargs(args.chat_template_kwargs), trust)
    store, ledger = connect(settings)
    app = make_celery(settings)
    # Counted in prompts made: each line makes one per generation.
    total = sum(count_lines(f) * (p.generations or 1) for p in plans for f in p.files)
    started = time.monotonic()
    with ProgressBar("enqueue", "lines", total, quiet=args.quiet,
                     every_s=settings.progress_every_s) as bar:
        enqueuer = Enqueuer(store, ledger, app, templater, Limits(args.max_seq_len),
                            progress=bar.advance)
        summaries = enqueuer.run(plans)
        bar.complete()
    elapsed = time.monotonic() - started
    print_summary(summaries, elapsed)
    return 0


def print_summary(summaries: list[DatasetSummary], elapsed_s: float) -> None:
    for s in summaries:
        for problem in s.problems[:MAX_PROBLEMS_SHOWN]:
            print(problem, file=sys.stderr)
        for note in s.notes:
            print(f"{s.name}: {note}", file=sys.stderr)
        hidden = s.bad + s.duplicates - min(len(s.problems), MAX_PROBLEMS_SHOWN)
        if hidden > 0:
            print(f"{s.name}: ... and {hidden} more problems", file=sys.stderr)
    table = Table(title="datagen enqueue", title_justify="left")
    cols = ("dataset", "read", "bad", "duplicate", "skipped", "enqueued", "already queued",
            "already done", "failed before", "state")
    for col in cols:
        table.add_column(col, justify="left" if col == "dataset" else "right")
    for s in summaries:
        table.add_row(s.name, *(f"{n:,}" for n in (
            s.read, s.bad, s.duplicates, s.skipped, s.enqueued, s.already_queued,
            s.already_done, s.failed_before)), "closed" if s.closed else "open")
    make_console().print(table)
    read = sum(s.read for s in summaries)
    rate = read / elapsed_s if elapsed_s > 0 else 0.0
    print(f"{read:,} prompts read in {elapsed_s:.1f}s ({rate:,.0f}/s); "
          f"{sum(s.enqueued for s in summaries):,} enqueued")
