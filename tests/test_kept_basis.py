"""The ``kept`` budget basis end to end, on both databases and the simulator: samples cut
while reasoning are stored but not charged, the Redis counter equals SQL's sum of the kept
samples' completions, the budget closes on kept tokens, and SpecForge leaves out exactly
the samples not charged (one definition of kept: common/kept.py), each sample judged by
the reasoning block its own drawn template arguments opened."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from common.budget import Budget
from common.ledger import Ledger
from common.schema import prompt_inputs, results
from common.settings import Settings
from common.store import Store
from ops import progress
from ops.export import add_export_parser, run_export
from ops.validate import add_validate_parser, run_validate
from producer.mixes import parse_mix_flags
from producer.plan import Draws
from tests.helpers import assert_invariants, enqueue_paths, write_dataset
from workers.context import WorkerContext
from workers.pipeline import Outcome, run_sample

# The simulator's outputs close their reasoning about 60% in, over a lognormal length of
# mean 60: a cap of 24 tokens cuts a good share of them before </think>.
MAX_NEW_TOKENS = 24


def run_dataset(settings: Settings, tmp_path: Path, name: str, n: int,
                budget: Budget, draws: Draws | None = None) -> list[Outcome]:
    enqueue_paths(settings, [str(write_dataset(tmp_path, name, n))], budget=budget,
                  max_new_tokens=MAX_NEW_TOKENS, draws=draws)
    ctx = WorkerContext.build(settings)
    ids = [f"{name}-{i}" for i in range(n)]
    outcomes: list[Outcome] = []
    # Admission may say wait near the budget (a task would be retried): run those again,
    # as the retries would, until each sample is settled or its dataset closed.
    for _ in range(n):
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda sid: run_sample(ctx, name, sid), ids))
        outcomes += got
        ids = [sid for sid, o in zip(ids, got, strict=True) if o is Outcome.WAIT]
        if not ids:
            break
    return outcomes


def stored_rows(store: Store, name: str) -> list[sa.Row[tuple[str, int, str, str, bool]]]:
    q = sa.select(results.c.sample_id, results.c.completion_tokens, results.c.finish_reason,
                  results.c.output_text, results.c.kept).where(results.c.dataset == name)
    with store.engine.connect() as conn:
        return list(conn.execute(q))


def test_samples_cut_while_reasoning_are_stored_but_not_charged(
    settings: Settings, store: Store, ledger: Ledger, tmp_path: Path
) -> None:
    assert set(run_dataset(settings, tmp_path, "kb", 40, Budget(10**9, basis="kept"))) <= {
        Outcome.DONE, Outcome.WAIT}
    assert store.dataset("kb").reasoning_open == "<think>"
    rows = stored_rows(store, "kb")
    assert len(rows) == 40
    cut = [r for r in rows if not r.kept]
    kept = [r for r in rows if r.kept]
    assert cut and kept  # both kinds, or the test proves nothing
    assert all("</think>" not in r.output_text and r.finish_reason == "length" for r in cut)
    assert all("</think>" in r.output_text for r in kept)
    kept_tokens = sum(r.completion_tokens for r in kept)
    assert ledger.state("kb").used_tokens == kept_tokens == store.used_tokens(
        "kb", store.dataset("kb").budget)
    assert ledger.state("kb").samples == 40
    sums = progress.result_sums(store.engine)["kb"]
    assert (sums.not_kept, sums.cost("kept")) == (len(cut), kept_tokens)
    assert_invariants(store, ledger, ["kb"])
    # The export leaves out as cut exactly the samples the budget did not charge.
    left, _ = _specforge(settings, tmp_path / "out", "kb")
    assert left.get("cut_while_reasoning", 0) == len(cut)


def test_the_budget_closes_on_kept_tokens(
    settings: Settings, store: Store, ledger: Ledger, tmp_path: Path
) -> None:
    budget = Budget(200, basis="kept")
    outcomes = run_dataset(settings, tmp_path, "kc", 60, budget)
    state = ledger.state("kc")
    assert state.state == "closed" and state.close_reason == "budget"
    rows = stored_rows(store, "kc")
    kept_tokens = sum(r.completion_tokens for r in rows if r.kept)
    assert state.used_tokens == kept_tokens == store.used_tokens("kc", budget) >= 200
    # Without the uncharged samples the counter is below what output tokens would show;
    # each kept sample before the crossing left the counter under the budget.
    assert sum(r.completion_tokens for r in rows) > kept_tokens
    assert kept_tokens - max(r.completion_tokens for r in rows if r.kept) < 200
    assert Outcome.CLOSED in outcomes and len(rows) < 60
    assert_invariants(store, ledger, ["kc"])


def test_a_sample_drawn_without_reasoning_is_kept_whole(
    settings: Settings, store: Store, ledger: Ledger, tmp_path: Path
) -> None:
    """``thinking=false`` renders a prompt whose reasoning block is already closed: the
    sample's whole output is its answer, kept and charged however it ends. The
    ``thinking=true`` samples of the same dataset are judged as before."""
    draws = Draws(parse_mix_flags(["thinking=true:1,false:1"]))
    budget = Budget(10**9, basis="kept")
    assert set(run_dataset(settings, tmp_path, "km", 60, budget, draws)) <= {
        Outcome.DONE, Outcome.WAIT}
    ds = store.dataset("km")
    assert ds.reasoning_opens == {'{"thinking": false}': None, '{"thinking": true}': "<think>"}
    thinking = _drawn_thinking(store, "km")
    rows = stored_rows(store, "km")
    on = [r for r in rows if thinking[r.sample_id]]
    off = [r for r in rows if not thinking[r.sample_id]]
    # Outputs of each draw that never write </think>, or the test proves nothing.
    cut_on = [r for r in on if "</think>" not in r.output_text]
    whole_off = [r for r in off if "</think>" not in r.output_text]
    assert len(rows) == 60 and cut_on and whole_off
    assert all(r.kept for r in off)
    assert all(r.kept == ("</think>" in r.output_text) for r in on)
    kept_tokens = sum(r.completion_tokens for r in rows if r.kept)
    assert ledger.state("km").used_tokens == kept_tokens == store.used_tokens("km", budget)
    assert progress.result_sums(store.engine)["km"].not_kept == len(cut_on)
    assert_invariants(store, ledger, ["km"])

    left, exported = _specforge(settings, tmp_path / "out", "km")
    assert left.get("cut_while_reasoning", 0) == len(cut_on)
    for r in whole_off:
        record = exported[r.sample_id]
        assert record["chat_template_kwargs"] == {"thinking": False}
        assert record["conversations"][-1] == {"role": "assistant",
                                               "content": r.output_text,
                                               "reasoning_content": ""}
    split_on = [r for r in on if r.sample_id in exported]
    assert split_on
    for r in split_on:
        reasoning, _, answer = r.output_text.partition("</think>")
        last = exported[r.sample_id]["conversations"][-1]
        assert (last["reasoning_content"], last["content"]) == (reasoning.strip(),
                                                               answer.strip())
    # validate rebuilds every row and checks it with each row's own reasoning flags.
    assert run_validate(_args(add_validate_parser, "validate", str(tmp_path / "out")),
                        settings) == 0


def _drawn_thinking(store: Store, name: str) -> dict[str, bool]:
    """sample_id -> the ``thinking`` its prompt was rendered with."""
    q = sa.select(prompt_inputs.c.sample_id, prompt_inputs.c.template_kwargs) \
        .where(prompt_inputs.c.dataset == name)
    with store.engine.connect() as conn:
        return {sid: bool(kwargs["thinking"]) for sid, kwargs in conn.execute(q)}


def _args(add: Callable[[Any], Any], *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(list(argv))


def _specforge(settings: Settings, out: Path, name: str
               ) -> tuple[dict[str, int], dict[str, dict[str, Any]]]:
    """A SpecForge export's left-out counts for the dataset, and its rows by id."""
    args = _args(add_export_parser, "export", "--format", "specforge", "--out", str(out),
                 "--allow-empty")
    assert run_export(args, settings) == 0
    doc = json.loads((out / "manifest.datagen").read_text())
    with (out / f"{name}.specforge.jsonl").open() as fh:
        rows = [json.loads(line) for line in fh]
    return dict(doc["datasets"][name]["left_out"]), {r["id"]: r for r in rows}
