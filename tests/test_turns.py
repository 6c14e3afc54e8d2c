"""Every assistant turn regenerated on-policy (``--turns all``), end to end on SQLite and
PostgreSQL: real workers, the simulator over HTTP, the project's test tokenizers. The ids
sent for turn i are the template's rendering of the conversation with the model's own
stored answers to turns < i, built here independently; no line's own answer reaches any
prompt; a budget that closes mid-conversation starts no later turn; a worker killed
mid-run leaves every conversation complete, no turn stored twice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import requests
import sqlalchemy as sa

from common.conversation import first_turn, next_turn, turn_count, turn_starts
from common.conversation_store import conversation_counts
from common.ledger import Ledger
from common.schema import prompt_inputs, results
from common.settings import Settings
from common.store import Store
from common.tokenizer_files import load_tokenizer
from producer.template import BUNDLED_TOKENIZER
from sim.reqlog import input_sha1
from tests.helpers import assert_invariants, enqueue_paths, running_worker, wait_settled

ORIGINAL = "ORIGINAL-ANSWER"


def _conversation(i: int, turns: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"Helper {i}."}]
    for t in range(1, turns + 1):
        messages.append({"role": "user", "content": f"Question {t} of chat {i}?"})
        messages.append({"role": "assistant", "content": f"{ORIGINAL} {i}.{t}",
                         "reasoning_content": f"{ORIGINAL} thought {i}.{t}"})
    if i % 2:
        messages.pop()  # ends on a user turn: its last answer is still to generate
    return {"id": f"c{i}", "messages": messages}


LINES = [_conversation(i, 1 + i % 3) for i in range(8)]


def _write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


# -- the shapes, without services ---------------------------------------------------------

def test_turns_of_a_conversation_and_the_next_turns_prompt() -> None:
    original = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "assistant", "content": "a1 more"},  # one answer in two messages
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "u3"},
    ]
    assert turn_starts(original) == [2, 5, 7]
    assert turn_count(original) == 3
    assert first_turn(original) == original[:2]
    own = {"role": "assistant", "content": "mine"}
    second = next_turn(original, first_turn(original), 1, own)
    assert second == [*original[:2], own, original[4]]
    own2 = {"role": "assistant", "content": "mine 2"}
    assert next_turn(original, second, 2, own2) == [*second, own2, original[6]]
    # An assistant message before any user message is part of the prompt, not a turn.
    assert turn_starts([{"role": "assistant", "content": "hi"},
                        {"role": "user", "content": "u"}]) == [2]


# -- end to end ----------------------------------------------------------------------------

def _reference_ids(hf: Any, line: dict[str, Any], answers: list[str], turn: int) -> list[int]:
    """Turn ``turn``'s ids built here: the line's messages up to that user turn, each
    earlier answer replaced by the stored own answer, reasoning split at ``</think>``."""
    messages: list[dict[str, Any]] = []
    seen = 0
    previous = None
    for message in line["messages"]:
        if message["role"] == "assistant":
            if previous == "assistant":
                continue
            seen += 1
            if seen == turn:
                break
            thought, _, content = answers[seen - 1].partition("</think>")
            own = {"role": "assistant", "content": content.strip(),
                   "reasoning_content": thought.strip()}
            messages.append(own)
        else:
            messages.append(message)
        previous = message["role"]
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                 return_dict=False)
    return list(ids)


def _turn_rows(store: Store, dataset: str) -> dict[str, list[Any]]:
    q = (sa.select(prompt_inputs.c.conversation, prompt_inputs.c.turn, prompt_inputs.c.messages,
                   prompt_inputs.c.input_ids, results.c.output_text)
         .join(results, sa.and_(results.c.dataset == prompt_inputs.c.dataset,
                                results.c.sample_id == prompt_inputs.c.sample_id), isouter=True)
         .where(prompt_inputs.c.dataset == dataset)
         .order_by(prompt_inputs.c.conversation, prompt_inputs.c.turn))
    by: dict[str, list[Any]] = {}
    with store.engine.connect() as conn:
        for row in conn.execute(q):
            by.setdefault(row.conversation, []).append(row)
    return by


def _check_round_trip(store: Store, sim_url: str, hf: Any, dataset: str,
                      lines: list[dict[str, Any]]) -> None:
    sent = {r["input_sha1"] for r in requests.get(f"{sim_url}/sim/requests", timeout=5).json()}
    by = _turn_rows(store, dataset)
    assert set(by) == {line["id"] for line in lines}
    for line in lines:
        rows = by[line["id"]]
        assert [r.turn for r in rows] == list(range(1, 1 + len(line["messages"]) // 2))
        answers = [r.output_text for r in rows]
        assert all(a is not None for a in answers), line["id"]
        for r in rows:
            ids = _reference_ids(hf, line, answers, r.turn)
            assert r.input_ids == ids, (line["id"], r.turn)
            assert input_sha1(r.input_ids) in sent  # what the model was sent
            # No line's own answer reaches a prompt: neither its messages nor its ids.
            assert ORIGINAL not in json.dumps(r.messages)
            assert ORIGINAL not in hf.decode(r.input_ids)


def test_every_turn_is_regenerated_after_the_models_own_answers(
    settings: Settings, store: Store, ledger: Ledger, tmp_path: Path
) -> None:
    path = _write(tmp_path / "talk.jsonl", LINES)
    [summary] = enqueue_paths(settings, [str(path)], max_new_tokens=48, turns="all")
    assert (summary.read, summary.bad, summary.enqueued) == (len(LINES), 0, len(LINES))
    assert store.dataset("talk").turns == "all"
    with running_worker(settings, concurrency=4):
        wait_settled(store, ["talk"])
    assert_invariants(store, ledger, ["talk"])
    turns = sum(len(line["messages"]) // 2 for line in LINES)
    assert store.prompt_counts("talk") == {"done": turns}
    hf = load_tokenizer(str(BUNDLED_TOKENIZER))
    _check_round_trip(store, settings.sglang_urls[0], hf, "talk", LINES)
    counts = conversation_counts(store, "talk", closed=False)
    assert (counts.total, counts.complete, counts.partial) == (len(LINES), len(LINES), 0)

    # A re-run enqueues nothing: every turn is stored, nothing generated again.
    [again] = enqueue_paths(settings, [str(path)], max_new_tokens=48, turns="all")
    assert (again.enqueued, again.already_done) == (0, len(LINES))
