"""``datagen plan``: how many samples each budget buys, and how long the rest will take.

    datagen plan [--mean-tokens N] [--tok-per-s N] [--json]

Per dataset, from SQL alone (no Redis), in tokens on the dataset's budget basis:

  mean      tokens per sample: the observed mean of the dataset's stored results once it
            has at least 20; before that the --mean-tokens guess (output tokens; on basis
            "total" the dataset's mean prompt length is added); without a guess, the few
            results there are; with neither, unknown. The "mean from" column says which.
  samples   done + remaining budget // mean: the samples the budget holds (under drain the
            sample that crosses the budget adds one more).
  keeps     budget / (usable prompts × mean), at most 100%: the share of the dataset the
            budget is expected to keep. Below 100% the publishing order decides which
            samples those are: shuffled, a uniform random subset (common/order.py).
  prompts   "enough" when the prompts that can still give a sample (done + queued; skipped
            and failed ones never will) cover those samples, else "short by N".
  to go     min(remaining budget, queued prompts × mean): tokens still to generate; 0 for
            a closed dataset, which generates nothing more.
  unit      "conversations" for a dataset regenerated turn by turn (``--turns all``): a
            sample is then a conversation. done counts complete conversations, the usable
            ones add those in progress, and mean is the tokens of a complete conversation,
            every turn counted (before 20 are complete, --mean-tokens × the conversations'
            mean turns). The turns already stored of conversations in progress are spent
            on them: samples = done + (remaining + those tokens) // mean, and to go
            = min(remaining, in progress × mean − those tokens).
  hours     output tokens to go / throughput / 3600. The throughput is --tok-per-s, else
            the output tokens stored over the last 10 minutes by all datasets / 600 (it
            fills up over a run's first 10 minutes; pass --tok-per-s until then). Datasets
            share the server, so the total is everyone's tokens to go over that one
            throughput, and a dataset's hours are its share of it.

Example: B2 of the reference run before it starts, 14,714 prompts and a 10M budget, with
``--mean-tokens 4100 --tok-per-s 930``:

    samples = 10,000,000 // 4,100 = 2,439          (2,439 × 4,100 = 9,999,900)
    keeps   = 10,000,000 / (14,714 × 4,100) = 16.6%
    prompts = 14,714 ≥ 2,439                       enough
    to go   = min(10,000,000, 14,714 × 4,100 = 60,327,400) = 10,000,000
    hours   = 10,000,000 / 930 / 3,600 = 2.99
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

from rich import box
from rich.table import Table

from common.budget import cost_on
from common.console import make_console
from common.conversation_store import conversation_counts, conversation_tokens, single_turns
from common.settings import Settings
from common.store import DatasetRow, Store
from ops import progress
from ops.argtypes import number, whole
from ops.progress import MIN_OBSERVED, PLAN_WINDOW_S, Mean, ResultSums, estimate_mean


@dataclass(frozen=True)
class DatasetPlan:
    name: str
    state: str
    basis: str
    budget_tokens: int
    used_tokens: int
    done: int
    queued: int
    usable_prompts: int
    # None when the dataset has no mean to plan with (no results and no --mean-tokens).
    mean_tokens: float | None = None
    mean_source: str | None = None
    samples: int | None = None
    # The share of the usable prompts the whole budget is expected to keep, 0 to 1.
    kept_fraction: float | None = None
    short_by: int | None = None
    tokens_to_go: int | None = None
    output_tokens_to_go: int | None = None
    hours: float | None = None
    unit: str = "samples"  # "conversations" for a --turns all dataset


@dataclass(frozen=True)
class Progress:
    """What a dataset has done, in its unit (samples, or conversations)."""

    done: int = 0
    queued: int = 0  # prompts queued, or conversations in progress
    # Tokens (on the basis) already stored for the queued units: turns of conversations
    # in progress. 0 for samples, which are stored whole.
    spent_on_queued: int = 0
    unit: str = "samples"


@dataclass(frozen=True)
class PlanTotal:
    samples: int
    tokens_to_go: int
    output_tokens_to_go: int
    tok_per_s: float | None
    tok_per_s_source: str | None
    hours: float | None
    left_out: list[str]


def hours_at(output_tokens: int, tok_per_s: float | None) -> float | None:
    return output_tokens / tok_per_s / 3600 if tok_per_s else None


def plan_dataset(
    ds: DatasetRow, did: Progress, used: int, mean: Mean | None, tok_per_s: float | None
) -> DatasetPlan:
    closed = ds.state == "closed"
    remaining = 0 if closed else max(0, ds.budget.tokens - used)
    spent = 0 if closed else did.spent_on_queued
    terms: dict[str, Any] = {
        "name": ds.name, "state": ds.state, "basis": ds.budget.basis,
        "budget_tokens": ds.budget.tokens, "used_tokens": used, "done": did.done,
        "queued": did.queued, "usable_prompts": did.done + did.queued, "unit": did.unit,
    }
    if mean is None:
        return DatasetPlan(**terms)
    samples = did.done + math.floor((remaining + spent) / mean.cost)
    queued = 0 if closed else did.queued
    to_go = min(Fraction(remaining), max(Fraction(0), queued * mean.cost - spent))
    out_to_go = round(to_go * mean.output / mean.cost)
    return DatasetPlan(
        **terms, mean_tokens=round(float(mean.cost), 1), mean_source=mean.source,
        samples=samples,
        kept_fraction=kept_fraction(ds.budget.tokens, did.done + did.queued, mean.cost),
        short_by=max(0, samples - did.done - did.queued), tokens_to_go=round(to_go),
        output_tokens_to_go=out_to_go, hours=hours_at(out_to_go, tok_per_s),
    )


def kept_fraction(budget_tokens: int, prompts: int, mean_cost: Fraction) -> float | None:
    """budget / (prompts × mean tokens a sample), at most 1, to 4 decimals; None without
    prompts."""
    if prompts <= 0 or mean_cost <= 0:
        return None
    return round(float(min(Fraction(1), budget_tokens / (prompts * mean_cost))), 4)


def throughput(store: Store, names: list[str], given: float | None) -> tuple[float | None, str]:
    """--tok-per-s when given, else the output tokens stored in the last 10 minutes / 600."""
    if given:
        return given, "--tok-per-s"
    recent = progress.recent_sums(store.engine, names, PLAN_WINDOW_S)
    rate = sum(s.completion_tokens for s in recent.values()) / PLAN_WINDOW_S
    return (rate, "observed, last 10 min") if rate else (None, "")


def plan_total(rows: list[DatasetPlan], rate: float | None, source: str) -> PlanTotal:
    """Datasets share the server: their tokens to go add up over one throughput."""
    planned = [r for r in rows if r.mean_source is not None]
    out_to_go = sum(r.output_tokens_to_go or 0 for r in planned)
    return PlanTotal(
        samples=sum(r.samples or 0 for r in planned),
        tokens_to_go=sum(r.tokens_to_go or 0 for r in planned),
        output_tokens_to_go=out_to_go,
        tok_per_s=round(rate, 1) if rate else None,
        tok_per_s_source=source or None,
        hours=hours_at(out_to_go, rate),
        left_out=[r.name for r in rows if r.mean_source is None],
    )


def build_plan(
    store: Store, mean_guess: int | None, tok_per_s: float | None
) -> tuple[list[DatasetPlan], PlanTotal]:
    dsets = store.datasets()
    rate, source = throughput(store, [d.name for d in dsets], tok_per_s)
    counts, sums = progress.prompt_counts(store.engine), progress.result_sums(store.engine)
    prompt_means = progress.mean_prompt_tokens(store.engine)
    rows = []
    for ds in dsets:
        s, basis = sums.get(ds.name, ResultSums()), ds.budget.basis
        prompt_mean = prompt_means.get(ds.name, Fraction(0))
        if ds.turns == "all":
            did, mean = _in_conversations(store, ds, mean_guess, prompt_mean)
        else:
            c = counts.get(ds.name, {})
            did = Progress(c.get("done", 0), c.get("queued", 0))
            mean = estimate_mean(s, basis, mean_guess, prompt_mean)
        rows.append(plan_dataset(ds, did, s.cost(basis), mean, rate))
    return rows, plan_total(rows, rate, source)


def _in_conversations(store: Store, ds: DatasetRow, guess: int | None, prompt_mean: Fraction
                      ) -> tuple[Progress, Mean | None]:
    """A --turns all dataset's progress and mean, a conversation a sample (a line of a
    single turn is a conversation of one)."""
    chats = conversation_counts(store, ds.name, closed=ds.state == "closed")
    tokens, one = conversation_tokens(store, ds.name), single_turns(store, ds.name)
    basis = ds.budget.basis
    whole = ResultSums(tokens.complete + one.done,
                       tokens.complete_completion_tokens + one.completion_tokens,
                       tokens.complete_prompt_tokens + one.prompt_tokens,
                       tokens.complete_kept_tokens + one.kept_completion_tokens)
    spent = cost_on(basis, tokens.open_prompt_tokens, tokens.open_completion_tokens,
                    tokens.open_kept_tokens)
    units = tokens.conversations + one.prompts
    turns = Fraction(tokens.turns + one.prompts, units) if units else Fraction(0)
    mean = estimate_mean(whole, basis, None if guess is None else guess * turns,
                         prompt_mean * turns)
    return Progress(chats.complete + one.done, chats.in_progress + one.queued, spent,
                    "conversations"), mean


def _num(n: int | float | None, fmt: str = ",") -> str:
    return "—" if n is None else format(n, fmt)


def _prompts_cell(r: DatasetPlan) -> str:
    if r.short_by is None:
        return "—"
    if r.state == "closed":
        return "closed"
    return "enough" if r.short_by == 0 else f"short by {r.short_by:,}"


COLUMNS = ("dataset", "state", "basis", "budget", "used", "done", "mean\ntok", "mean from",
           "samples\nat budget", "usable\nprompts", "keeps", "prompts", "tokens\nto go", "hours")
LEFT = ("dataset", "state", "basis", "mean from", "prompts")


def render(rows: list[DatasetPlan], total: PlanTotal) -> Table:
    table = Table(title="datagen plan", title_justify="left", box=box.SIMPLE_HEAD,
                  show_edge=False, collapse_padding=True)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in LEFT else "right",
                         no_wrap=col != "dataset", overflow="fold")
    for i, r in enumerate(rows):
        table.add_row(
            r.name, r.state, r.basis, f"{r.budget_tokens:,}", f"{r.used_tokens:,}",
            f"{r.done:,}", _num(r.mean_tokens, ",.0f"), r.mean_source or "—", _num(r.samples),
            f"{r.usable_prompts:,}", _num(r.kept_fraction, ".1%"), _prompts_cell(r),
            _num(r.tokens_to_go), _num(r.hours, ",.2f"),
            end_section=i == len(rows) - 1,
        )
    table.add_row("total", "", "", "", "", "", "", "", f"{total.samples:,}", "", "", "",
                  f"{total.tokens_to_go:,}", _num(total.hours, ",.2f"))
    return table


def notes(rows: list[DatasetPlan], total: PlanTotal) -> list[str]:
    """What the numbers rest on, and how to fill in what is missing."""
    lines = []
    chats = [r.name for r in rows if r.unit == "conversations"]
    if chats:
        lines.append(f"in conversations (--turns all): {', '.join(chats)}; done counts "
                     "complete ones, mean is a complete conversation's tokens, every turn")
    if total.tok_per_s is None:
        lines.append("hours: no result stored in the last 10 minutes; pass --tok-per-s N "
                     "(the reference 8-GPU server does ~930) to estimate them")
    else:
        lines.append(f"throughput: {total.tok_per_s:,.1f} output tok/s ({total.tok_per_s_source})"
                     "; the total's hours spread it over every dataset's tokens to go")
    if total.left_out:
        lines.append(f"not planned (no results yet): {', '.join(total.left_out)}; "
                     "pass --mean-tokens N to plan them with a guess")
    return lines


def as_json(rows: list[DatasetPlan], total: PlanTotal) -> dict[str, Any]:
    """Hours to 3 decimals; everything else as computed."""
    def hours(h: float | None) -> dict[str, float | None]:
        return {"hours": None if h is None else round(h, 3)}
    return {"datasets": [asdict(r) | hours(r.hours) for r in rows],
            "total": asdict(total) | hours(total.hours)}


def add_plan_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="samples each budget buys, tokens and hours still to go")
    p.add_argument("--mean-tokens", type=whole(1), metavar="N",
                   help=f"output tokens per sample for datasets with < {MIN_OBSERVED} results")
    p.add_argument("--tok-per-s", type=number(0, inclusive=False), metavar="N",
                   help="server output tokens/s (default: observed over the last 10 minutes)")
    p.add_argument("--json", action="store_true")
    return p


def run_plan(args: argparse.Namespace, settings: Settings) -> int:
    store = Store(settings.database_url, settings.db_connections)
    rows, total = build_plan(store, args.mean_tokens, args.tok_per_s)
    if args.json:
        print(json.dumps(as_json(rows, total), indent=2))
        return 0
    console = make_console()
    console.print(render(rows, total))
    for line in notes(rows, total):
        console.print(line, highlight=False)
    return 0
