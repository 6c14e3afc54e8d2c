"""``datagen plan`` on a dataset regenerated turn by turn (``--turns all``): a sample is a
conversation, its mean the tokens of a complete conversation with every turn counted, and
the turns stored of conversations still in progress are spent on them. The expected
figures are computed here from SQL's rows, grouped by conversation in Python."""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from common.schema import conversations, prompt_inputs, prompts, results
from common.settings import Settings
from common.store import Store
from ops.cli import main
from ops.plan import add_plan_parser, run_plan
from tests.helpers import running_worker, wait_settled

BUDGET = 10_000_000


def _chat(i: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    for t in range(1, 2 + i % 3):  # 1 to 3 assistant turns
        messages += [{"role": "user", "content": f"Question {t} of chat {i}?"},
                     {"role": "assistant", "content": f"Answer {t} of chat {i}."}]
    return {"id": f"c{i}", "messages": messages}


def _write(path: Path, ids: range) -> Path:
    path.write_text("".join(json.dumps(_chat(i)) + "\n" for i in ids), encoding="utf-8")
    return path


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="datagen")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    capsys.readouterr()
    assert run_plan(parser.parse_args(["plan", *argv]), Settings.from_env()) == 0
    return dict(json.loads(capsys.readouterr().out))


def _turns(store: Store, dataset: str) -> dict[str, tuple[int, list[tuple[int, int, int]]]]:
    """conversation -> (its turns, [(turn, prompt tokens, completion tokens) stored]); a
    line of a single turn, a prompt of its own, is a conversation of one turn here."""
    q = sa.select(prompt_inputs.c.sample_id, prompt_inputs.c.conversation,
                  conversations.c.turns, prompt_inputs.c.turn,
                  results.c.prompt_tokens, results.c.completion_tokens).outerjoin(
        conversations, sa.and_(conversations.c.dataset == prompt_inputs.c.dataset,
                               conversations.c.conversation == prompt_inputs.c.conversation)
    ).outerjoin(results, sa.and_(results.c.dataset == prompt_inputs.c.dataset,
                                 results.c.sample_id == prompt_inputs.c.sample_id)
                ).where(prompt_inputs.c.dataset == dataset)
    found: dict[str, tuple[int, list[tuple[int, int, int]]]] = defaultdict(lambda: (0, []))
    with store.engine.connect() as conn:
        for sid, chat, turns, turn, p, c in conn.execute(q):
            unit = chat or sid
            stored = found[unit][1] + ([(turn or 1, p, c)] if c is not None else [])
            found[unit] = (turns or 1, stored)
    return dict(found)


def _unstore_last_turn(store: Store, dataset: str, chats: list[str]) -> None:
    """Put the last stored turn of each chat back in the queue, as if still to run."""
    with store.engine.begin() as conn:
        for chat in chats:
            sid, = conn.execute(sa.select(prompt_inputs.c.sample_id).where(
                prompt_inputs.c.dataset == dataset, prompt_inputs.c.conversation == chat
            ).order_by(prompt_inputs.c.turn.desc()).limit(1)).one()
            conn.execute(results.delete().where(results.c.dataset == dataset,
                                                results.c.sample_id == sid))
            conn.execute(prompts.update().where(prompts.c.dataset == dataset,
                                                prompts.c.sample_id == sid
                                                ).values(state="queued"))


@pytest.mark.parametrize("basis", ["output", "total"])
def test_plan_counts_a_turn_by_turn_dataset_in_conversations(
    settings: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch, basis: str,
) -> None:
    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    path = _write(tmp_path / "talk.jsonl", range(30))
    assert main(["enqueue", str(path), "-q", "--turns", "all", "--budget-basis", basis]) == 0
    with running_worker(settings, concurrency=4):
        wait_settled(Store(settings.database_url), ["talk"], timeout_s=120)
    # 10 conversations not started, and 3 of three turns with their last turn to run.
    assert main(["enqueue", str(_write(path, range(40))), "-q", "--turns", "all",
                 "--budget-basis", basis]) == 0
    store = Store(settings.database_url)
    _unstore_last_turn(store, "talk", ["c2", "c5", "c8"])

    chats = _turns(store, "talk")
    cost = {chat: sum(c + (p if basis == "total" else 0) for _, p, c in stored)
            for chat, (_, stored) in chats.items()}
    complete = [ch for ch, (turns, stored) in chats.items() if len(stored) == turns]
    going = [ch for ch in chats if ch not in complete]
    assert (len(complete), len(going)) == (27, 13)
    mean = Fraction(sum(cost[ch] for ch in complete), len(complete))
    spent = sum(cost[ch] for ch in going)
    assert spent > 0  # the two turns stored of c2, c5 and c8
    used = sum(cost.values())
    remaining = BUDGET - used

    [row] = _plan(capsys, "--json", "--tok-per-s", "930")["datasets"]
    assert row["unit"] == "conversations" and row["mean_source"] == "observed"
    assert (row["done"], row["queued"], row["usable_prompts"]) == (27, 13, 40)
    assert (row["used_tokens"], row["mean_tokens"]) == (used, round(float(mean), 1))
    assert row["samples"] == 27 + math.floor((remaining + spent) / mean)
    assert row["tokens_to_go"] == round(min(Fraction(remaining), 13 * mean - spent))
    assert row["kept_fraction"] == round(float(min(Fraction(1), BUDGET / (40 * mean))), 4)

    capsys.readouterr()
    assert main(["plan", "--tok-per-s", "930"]) == 0
    assert "in conversations (--turns all): talk" in capsys.readouterr().out


def test_plan_guesses_a_conversation_as_its_turns_times_the_guess(
    settings: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    path = _write(tmp_path / "new.jsonl", range(9))  # 1, 2 and 3 turns, three of each
    assert main(["enqueue", str(path), "-q", "--turns", "all"]) == 0
    [row] = _plan(capsys, "--json", "--mean-tokens", "100", "--tok-per-s", "930")["datasets"]
    assert (row["unit"], row["done"], row["queued"]) == ("conversations", 0, 9)
    assert (row["mean_tokens"], row["mean_source"]) == (200.0, "--mean-tokens")
    assert row["tokens_to_go"] == 9 * 200
