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

import pytest
import redis
import requests
import sqlalchemy as sa

from common.audit import queued_in_redis, requeue_lost
from common.budget import Budget
from common.celery_app import make_celery
from common.conversation import first_turn, next_turn, turn_count, turn_id, turn_starts
from common.conversation_store import conversation_counts, queued_later_turns
from common.errors import ConfigError
from common.keys import dataset_keys
from common.ledger import Ledger
from common.messages import sample_of
from common.publish import Publisher
from common.rows import ResultRow
from common.schema import prompt_inputs, prompts, results
from common.settings import Settings
from common.store import Store
from common.tokenizer_files import load_tokenizer
from ops.cli import main
from producer.plan import plans_from_manifest
from producer.template import BUNDLED_TOKENIZER
from sim.reqlog import input_sha1
from tests.conftest import make_settings
from tests.faultkit import wait_for
from tests.helpers import (
    assert_invariants,
    enqueue_paths,
    history_with_own_answers,
    running_worker,
    turn_rows,
    wait_settled,
)
from workers.context import WorkerContext
from workers.pipeline import Outcome, run_sample
from workers.turns import NextTurns

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


LINES = [_conversation(i, 2 + i % 3) for i in range(8)]  # 2 to 4 turns each


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

def _turns(line: dict[str, Any]) -> int:
    return len(line["messages"]) // 2  # a system message, then a user message a turn


def _answer(output: str) -> str:
    _, found, content = output.partition("</think>")
    return content.strip() if found else ""


def _thought(output: str) -> str:
    return output.partition("</think>")[0].strip()


def _reference_ids(hf: Any, line: dict[str, Any], answers: list[str], turn: int) -> list[int]:
    """Turn ``turn``'s ids built here: the line's messages up to that user turn, each
    earlier answer replaced by the stored own answer, reasoning split at ``</think>``."""
    messages = history_with_own_answers(line["messages"], turn, lambda k, _: {
        "role": "assistant", "content": _answer(answers[k - 1]),
        "reasoning_content": _thought(answers[k - 1])})
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                 return_dict=False)
    return list(ids)


def _check_round_trip(store: Store, sim_url: str, hf: Any, dataset: str,
                      lines: list[dict[str, Any]]) -> None:
    sent = {r["input_sha1"] for r in requests.get(f"{sim_url}/sim/requests", timeout=5).json()}
    by = turn_rows(store, dataset)
    assert set(by) == {line["id"] for line in lines}
    for line in lines:
        rows = by[line["id"]]
        assert [r.turn for r in rows] == list(range(1, 1 + len(rows)))
        answers = [r.output_text for r in rows]
        assert all(a is not None for a in answers), line["id"]
        if len(rows) < _turns(line):  # it ended early, on a turn without an answer
            assert not _answer(answers[-1]), line["id"]
        for r in rows:
            ids = _reference_ids(hf, line, answers, r.turn)
            assert r.input_ids == ids, (line["id"], r.turn)
            assert input_sha1(r.input_ids) in sent  # what the model was sent
            # No line's own answer reaches a prompt: neither its messages nor its ids.
            assert ORIGINAL not in json.dumps(r.messages)
            assert ORIGINAL not in hf.decode(r.input_ids)


def test_every_turn_is_regenerated_after_the_models_own_answers(
    settings: Settings, store: Store, ledger: Ledger, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = _write(tmp_path / "talk.jsonl", LINES)
    [summary] = enqueue_paths(settings, [str(path)], max_new_tokens=400, turns="all")
    assert (summary.read, summary.bad, summary.enqueued) == (len(LINES), 0, len(LINES))
    assert store.dataset("talk").turns == "all"
    with running_worker(settings, concurrency=4):
        wait_settled(store, ["talk"], client=ledger.redis)
    assert_invariants(store, ledger, ["talk"])
    hf = load_tokenizer(str(BUNDLED_TOKENIZER))
    _check_round_trip(store, settings.sglang_urls[0], hf, "talk", LINES)
    by = turn_rows(store, "talk")
    assert store.prompt_counts("talk") == {"done": sum(len(rows) for rows in by.values())}
    complete = sum(len(by[line["id"]]) == _turns(line) for line in LINES)
    assert complete > len(LINES) // 2  # most answers are whole at this cap
    counts = conversation_counts(store, "talk", closed=False)
    assert (counts.total, counts.complete, counts.partial) == (
        len(LINES), complete, len(LINES) - complete)
    # Each later turn takes its conversation's place in the publishing order.
    with store.engine.connect() as conn:
        ranks = conn.execute(sa.select(prompt_inputs.c.conversation, prompts.c.rank).join(
            prompts, sa.and_(prompts.c.dataset == prompt_inputs.c.dataset,
                             prompts.c.sample_id == prompt_inputs.c.sample_id))).all()
    by_conversation: dict[str, set[int | None]] = {}
    for conversation, rank in ranks:
        by_conversation.setdefault(conversation, set()).add(rank)
    assert len(by_conversation) == len(LINES)
    assert all(len(r) == 1 and None not in r for r in by_conversation.values())

    # A re-run enqueues nothing: every turn is stored, nothing generated again.
    [again] = enqueue_paths(settings, [str(path)], max_new_tokens=400, turns="all")
    assert (again.enqueued, again.already_done) == (0, len(LINES))

    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    _check_specforge(store, tmp_path / "export", "talk", LINES)
    _check_specforge_turn_rows(store, tmp_path / "export", tmp_path / "turns", "talk")
    _check_speculators_conversations(store, tmp_path / "speculators", "talk", hf)


def _check_specforge(store: Store, out: Path, dataset: str, lines: list[dict[str, Any]]
                     ) -> None:
    """One SpecForge row per conversation, every answer in it the model's own, split into
    content and reasoning_content; validate agrees with SQL."""
    assert main(["export", "--format", "specforge", "--out", str(out)]) == 0
    rows = [json.loads(x) for x in
            (out / f"{dataset}.specforge.jsonl").read_text().splitlines()]
    by = turn_rows(store, dataset)
    # A conversation that ended on a turn without an answer has no row SpecForge takes.
    assert len(rows) == sum(bool(_answer(by[line["id"]][-1].output_text)) for line in lines)
    for row in rows:
        conversation, _, last = row["id"].partition("#turn")
        turns = by[conversation]
        assert int(last) == len(turns)
        answers = [m for m in row["conversations"] if m["role"] == "assistant"]
        assert len(answers) == len(turns)
        for message, turn in zip(answers, turns, strict=True):
            assert (message["content"], message["reasoning_content"]) == (
                _answer(turn.output_text), _thought(turn.output_text))
        assert ORIGINAL not in json.dumps(row)
    assert main(["validate", str(out)]) == 0


def _expanded(row: dict[str, Any]) -> list[dict[str, Any]]:
    """SpecForge's expand_reasoning_conversations.py on one conversation row, written here
    from its description: an event per assistant turn, ids from #turn0, the earlier
    answers as history without their reasoning (emptied, for SpecForge's checker)."""
    history: list[dict[str, Any]] = []
    events = []
    for message in row["conversations"]:
        if message["role"] != "assistant":
            history.append(message)
            continue
        k = sum(m["role"] == "assistant" for m in history)
        event = {"id": f"{row['id'].partition('#turn')[0]}#turn{k}",
                 "source_id": row["id"].partition("#turn")[0],
                 "assistant_turn_index": k, "status": "success",
                 "conversations": [*history, message]}
        # The row's other fields (the sampling its turns were sent) carry over.
        events.append({**event, **{key: v for key, v in row.items() if key not in event}})
        history.append({**message, "reasoning_content": ""})
    return events


def _check_specforge_turn_rows(store: Store, whole: Path, out: Path, dataset: str) -> None:
    """``--rows turn``: a row per stored turn with an answer, each built from that turn's
    own prompt, equal to expanding the conversation rows; validate agrees with SQL."""
    assert main(["export", "--format", "specforge", "--rows", "turn", "--out", str(out)]) == 0
    rows = {r["id"]: r for r in map(json.loads, (out / f"{dataset}.specforge.jsonl")
                                    .read_text().splitlines())}
    by = turn_rows(store, dataset)
    answered = {(c, t.turn) for c, turns in by.items() for t in turns
                if _answer(t.output_text)}
    assert set(rows) == {f"{c}#turn{turn - 1}" for c, turn in answered}
    conversations = map(json.loads, (whole / f"{dataset}.specforge.jsonl").read_text()
                        .splitlines())
    expanded = [event for row in conversations for event in _expanded(row)]
    assert expanded and all(rows[e["id"]] == e for e in expanded)
    manifest = json.loads((out / "manifest.datagen").read_text())
    assert manifest["rows"] == "turn" and manifest["datasets"][dataset]["exported"] == len(rows)
    assert main(["validate", str(out)]) == 0
    # A turn row whose history no longer holds the model's own earlier answer is caught.
    later = next(r for r in rows.values() if r["assistant_turn_index"] > 0)
    next(m for m in later["conversations"] if m["role"] == "assistant")["content"] += "!"
    (out / f"{dataset}.specforge.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows.values()))
    assert main(["validate", str(out)]) == 1


def _runs(ids: list[int], mask: list[int], bit: int, hf: Any) -> list[str]:
    """The text of each run of ids masked ``bit``, special tokens kept."""
    runs, current = [], []
    for token, value in [*zip(ids, mask, strict=True), (None, 1 - bit)]:
        if value == bit:
            current.append(token)
        elif current:
            runs.append(hf.decode(current, skip_special_tokens=False))
            current = []
    return runs


def _check_speculators_conversations(store: Store, out: Path, dataset: str, hf: Any) -> None:
    """``speculators --rows conversation``: a row per conversation, its last stored turn's
    prompt and output; every token masked 1 in the prompt is the model's own words, in
    order, each earlier answer masked but for a token at its edges; every system and
    user message lies whole in tokens masked 0; validate agrees with SQL."""
    assert main(["export", "--format", "speculators", "--rows", "conversation",
                 "--out", str(out)]) == 0
    rows = {r["id"]: r for r in map(json.loads, (out / f"{dataset}.speculators.jsonl")
                                    .read_text().splitlines())}
    by = {c: [t for t in turns if t.output_ids is not None]
          for c, turns in turn_rows(store, dataset).items()}
    assert set(rows) == {f"{c}#turn{turns[-1].turn}" for c, turns in by.items()}
    for conversation, turns in by.items():
        last, row = turns[-1], rows[f"{conversation}#turn{turns[-1].turn}"]
        assert row["primary_id"] == conversation
        assert row["input_ids"] == last.input_ids + last.output_ids
        prompt_ids, mask = last.input_ids, row["loss_mask"][: len(last.input_ids)]
        assert row["loss_mask"][len(prompt_ids):] == [1] * len(last.output_ids)
        own = [piece for t in turns[:-1]
               for piece in (_thought(t.output_text), _answer(t.output_text)) if piece]
        k = 0
        for text in _runs(prompt_ids, mask, 1, hf):
            while k < len(own) and text not in own[k]:
                k += 1
            assert k < len(own), (conversation, text)  # the model's own words, in order
        masked = "".join(_runs(prompt_ids, mask, 1, hf))
        for t in turns[:-1]:  # each earlier answer masked, but for its edge tokens
            answer = _answer(t.output_text)
            assert answer[12:-12] in masked, (conversation, t.turn)
        zeros = _runs(prompt_ids, mask, 0, hf)
        for message in last.messages:
            if message["role"] != "assistant":
                assert any(message["content"] in z for z in zeros), (conversation, message)
    assert main(["validate", str(out)]) == 0
    # A prompt token masked 1 that is no own answer is caught.
    row = next(iter(rows.values()))
    row["loss_mask"][1] = 1
    (out / f"{dataset}.speculators.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows.values()))
    assert main(["validate", str(out)]) == 1


def test_a_budget_closing_mid_conversation_starts_no_later_turn(
    settings: Settings, store: Store, ledger: Ledger, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    lines = [_conversation(2 * i, 3) for i in range(6)]  # 3 answers each, 18 turns
    path = _write(tmp_path / "short.jsonl", lines)
    enqueue_paths(settings, [str(path)], budget=Budget(300), max_new_tokens=48, turns="all")
    # One task at a time: each request starts after the one before it is stored, so once
    # the crossing turn is stored no request can have been admitted before the close.
    with running_worker(settings, concurrency=1):
        wait_settled(store, ["short"], client=ledger.redis)
    ds = store.dataset("short")
    assert ds.state == "closed" and ds.closed_at is not None
    log = requests.get(f"{settings.sglang_urls[0]}/sim/requests", timeout=5).json()
    assert log and max(r["arrived_ts"] for r in log) <= ds.closed_at.timestamp()
    assert_invariants(store, ledger, ["short"])

    by = turn_rows(store, "short")
    stored = {c: sum(r.output_text is not None for r in rows) for c, rows in by.items()}
    waiting = [r for rows in by.values() for r in rows if r.output_text is None]
    # The turns the stored ones made possible are kept, queued, and were never sent. (Next
    # turns go ahead of new conversations, so some conversations never started.)
    assert any(r.turn > 1 for r in waiting)
    sent = {r["input_sha1"] for r in log}
    assert not any(input_sha1(r.input_ids) in sent for r in waiting)
    partial = sum(0 < n < 3 for n in stored.values())
    counts = conversation_counts(store, "short", closed=True)
    assert partial > 0
    assert (counts.total, counts.complete, counts.partial, counts.in_progress) == (
        6, sum(n == 3 for n in stored.values()), partial, 0)

    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    assert main(["status", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["datasets"]
    assert row["conversations"]["partial"] == partial


def test_workers_killed_mid_conversation_store_every_turn_once(tmp_path: Path) -> None:
    """Two worker processes, one SIGKILLed while it holds turns, replaced at once: every
    conversation ends complete (or partial on a turn without an answer), each turn is
    stored once and its successor made once, and Redis's counters equal SQL's."""
    from tests.faultkit import PrivateRedis, Sim, Workers, held_unacked
    from tests.faultkit_checks import check_run, load_requests, quiesce, settle

    lines = [_conversation(2 * i, 3) for i in range(30)]  # 90 turns
    path = _write(tmp_path / "chats.jsonl", lines)
    with PrivateRedis() as server, Sim(tmp_path / "sim.jsonl", decode_tok_per_s=50,
                                       mean_output_tokens=80, max_running_requests=64) as sim:
        settings = make_settings(f"sqlite:///{tmp_path / 'db.sqlite'}", sim.url,
                                 redis_url=server.url, heartbeat_s=1.0, dead_after_s=5.0,
                                 sweep_s=2.0, sweep_quiet_s=5.0)
        store, ledger = Store(settings.database_url), Ledger(server.client())
        enqueue_paths(settings, [str(path)], max_new_tokens=400, turns="all")
        with Workers(settings, tmp_path / "workers.log") as workers:
            workers.start("ta", 8)
            workers.start("tb", 8)
            # Mid-run: some second turns stored, and the victim holding messages.
            wait_for(lambda: store.prompt_counts("chats").get("done", 0) >= 20, 120,
                     "20 turns stored")
            wait_for(lambda: bool(held_unacked(server.client(), "ta")), 30, "ta holding")
            workers.kill("ta")
            workers.start("tc", 8)
            assert settle(store, ["chats"], 240), workers.text()[-3000:]
            quiesce(ledger, ["chats"])
        check = check_run(store, ledger, ["chats"], entries=load_requests(log_file=sim.log_file))
    check.assert_ok()  # every turn settled once, no duplicate row, counters equal SQL
    by = turn_rows(store, "chats")
    assert set(by) == {line["id"] for line in lines}
    for rows in by.values():
        assert [r.turn for r in rows] == list(range(1, len(rows) + 1))  # each turn once
        assert all(r.output_text is not None for r in rows)
        assert len(rows) == 3 or not _answer(rows[-1].output_text)
    counts = conversation_counts(store, "chats", closed=False)
    assert counts.in_progress == counts.not_started == 0
    assert counts.complete + counts.partial == len(lines)


def test_turns_with_a_code_tokenizer_whose_template_renders_earlier_reasoning(
    sqlite_url: str, code_sim: str, redis_client: redis.Redis, remote_tokenizer: Path,
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The test tokenizer that is Python code renders an earlier answer's reasoning: each
    later turn's ids carry the model's own reasoning, split off its answer, and never the
    line's."""
    requests.post(f"{code_sim}/sim/reset", timeout=5).raise_for_status()
    settings = make_settings(sqlite_url, code_sim, tokenizer=str(remote_tokenizer),
                             trust_remote_code=True)
    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    path = _write(tmp_path / "coded.jsonl", LINES)
    assert main(["enqueue", str(path), "-q", "--turns", "all", "--max-new-tokens", "400"]) == 0
    store, ledger = Store(sqlite_url), Ledger(redis_client)
    with running_worker(settings, concurrency=4):
        wait_settled(store, ["coded"], client=redis_client)
    assert_invariants(store, ledger, ["coded"])
    hf = load_tokenizer(str(remote_tokenizer), trust_remote_code=True)
    _check_round_trip(store, code_sim, hf, "coded", LINES)
    later = [r for rows in turn_rows(store, "coded").values() for r in rows if r.turn > 1]
    assert later and all("<think>" in hf.decode(r.input_ids).partition("<think>")[2]
                         for r in later)
    _check_specforge(store, tmp_path / "export", "coded", LINES)
    _check_speculators_conversations(store, tmp_path / "speculators", "coded", hf)


def test_a_next_turn_stored_but_not_published_is_sent_by_the_sweep_and_by_enqueue(
    settings: Settings, store: Store, ledger: Ledger, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lines = [_conversation(2 * i, 2) for i in range(4)]
    path = _write(tmp_path / "lost.jsonl", lines)
    enqueue_paths(settings, [str(path)], max_new_tokens=400, turns="all")
    # A worker that dies between storing a turn and publishing the next: no publishing.
    monkeypatch.setattr("workers.pipeline.publish_next", lambda *args: False)
    with running_worker(settings, concurrency=4):
        wait_for(lambda: store.prompt_counts("lost").get("done", 0) == len(lines), 60,
                 "first turns stored")
    later = queued_later_turns(store, "lost")
    assert len(later) == sum(bool(_answer(rows[0].output_text))
                             for rows in turn_rows(store, "lost").values())
    assert later and queued_in_redis(ledger.redis, "lost") == set()
    monkeypatch.undo()

    app = make_celery(settings)
    assert requeue_lost(store, ledger.redis, Publisher(app), quiet_for_s=0) == {
        "lost": len(later)}
    # Sent again ahead of new prompts, as when first sent, for the prefix cache.
    ahead = dataset_keys("lost").queue_lists[0]

    def waiting_ahead() -> set[str]:
        return {sample_of(json.loads(raw))[1]  # type: ignore[index]
                for raw in ledger.redis.lrange(ahead, 0, -1)}

    assert queued_in_redis(ledger.redis, "lost") == set(later) == waiting_ahead()
    ledger.redis.delete(*dataset_keys("lost").queue_lists)  # lost again
    [again] = enqueue_paths(settings, [str(path)], max_new_tokens=400, turns="all")
    assert (again.enqueued, again.already_done) == (len(later), len(lines))
    assert queued_in_redis(ledger.redis, "lost") == set(later) == waiting_ahead()
    with running_worker(settings, concurrency=4):
        wait_settled(store, ["lost"], client=ledger.redis)
    assert_invariants(store, ledger, ["lost"])
    assert conversation_counts(store, "lost", closed=False).in_progress == 0


def test_turns_from_a_manifest_and_a_mode_kept_per_dataset(
    settings: Settings, store: Store, tmp_path: Path
) -> None:
    path = _write(tmp_path / "mixed.jsonl", [
        LINES[2],
        {"id": "tooled", "tools": [{"type": "function", "function": {"name": "f"}}],
         "messages": [{"role": "user", "content": "q"}]},
    ])
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'[datasets.mixed]\nfiles = ["{path.name}"]\nturns = "all"\n')
    [plan] = plans_from_manifest(str(manifest), Budget(), {}, 64)
    assert plan.turns == "all"
    manifest.write_text(f'[datasets.mixed]\nfiles = ["{path.name}"]\nturns = "some"\n')
    with pytest.raises(ConfigError, match="turns must be one of last, all"):
        plans_from_manifest(str(manifest), Budget(), {}, 64)

    enqueue_paths(settings, [str(path)], turns="all")
    # Tools offered and none called: no parser needed. A single turn is a prompt of its
    # own, under its own id, as with --turns last.
    assert set(store.prompt_states("mixed")) == {"c2#turn1", "tooled"}
    with pytest.raises(ConfigError, match="--turns all"):
        enqueue_paths(settings, [str(path)], turns="last")

    # The store step looks up the conversation of a turn, not of a single-turn line: a
    # dataset of single turns (the default mode's usual case) costs its groups no query.
    ds = store.dataset("mixed")
    sent: list[str] = []
    sa.event.listen(store.engine, "before_cursor_execute",
                    lambda _c, _cur, statement, *_: sent.append(statement))
    built = NextTurns(store, False).build([(ds, _stored_row("mixed", "tooled"))])
    assert (built, sent) == ({}, [])
    NextTurns(store, False).build([(ds, _stored_row("mixed", "c2#turn1"))])
    assert len(sent) == 1 and "conversations" in sent[0]


def _stored_row(dataset: str, sample_id: str) -> ResultRow:
    return ResultRow(dataset=dataset, sample_id=sample_id, rid=sample_id, prompt_tokens=1,
                     completion_tokens=1, finish_reason="stop", output_ids=[1],
                     output_text="x", server="s", model="m")


def test_a_redelivered_turn_publishes_its_next_and_a_failed_build_keeps_the_result(
    settings: Settings, store: Store, ledger: Ledger, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = _write(tmp_path / "redo.jsonl", [_conversation(0, 2), _conversation(2, 2)])
    enqueue_paths(settings, [str(path)], max_new_tokens=400, turns="all")
    ledger.redis.delete(*dataset_keys("redo").queue_lists)  # the tasks run by hand below
    ctx = WorkerContext.build(settings)
    assert run_sample(ctx, "redo", "c0#turn1") == Outcome.DONE
    # The simulator's output is a function of the prompt: this one has an answer.
    assert _answer(turn_rows(store, "redo")["c0"][0].output_text)
    assert queued_in_redis(ledger.redis, "redo") == {"c0#turn2"}
    # The worker died after the commit, before publishing: the redelivered turn does it.
    ledger.redis.delete(*dataset_keys("redo").queue_lists)
    assert run_sample(ctx, "redo", "c0#turn1") == Outcome.ALREADY_DONE
    assert queued_in_redis(ledger.redis, "redo") == {"c0#turn2"}

    # Building the next turn fails: the turn's result is stored all the same.
    def broken(kept: Any) -> Any:
        raise RuntimeError("no template today")

    monkeypatch.setattr(ctx.next_turns, "build", broken)
    assert run_sample(ctx, "redo", "c2#turn1") == Outcome.DONE
    assert [r.turn for r in turn_rows(store, "redo")["c2"]] == [1]
    assert store.prompt_counts("redo") == {"done": 2, "queued": 1}


def test_an_exact_close_cuts_a_turn_and_gives_it_no_successor(
    settings: Settings, store: Store, ledger: Ledger, tmp_path: Path
) -> None:
    lines = [_conversation(2 * i, 3) for i in range(4)]
    path = _write(tmp_path / "cut.jsonl", lines)
    enqueue_paths(settings, [str(path)], budget=Budget(250, policy="exact"),
                  max_new_tokens=400, turns="all")
    with running_worker(settings, concurrency=1):
        wait_settled(store, ["cut"], client=ledger.redis)
    assert store.dataset("cut").state == "closed"
    assert store.used_tokens("cut", store.dataset("cut").budget) == 250
    assert_invariants(store, ledger, ["cut"])
    with store.engine.connect() as conn:
        cut = conn.execute(sa.select(prompt_inputs.c.conversation, prompt_inputs.c.turn)
                           .join(results, sa.and_(
                               results.c.dataset == prompt_inputs.c.dataset,
                               results.c.sample_id == prompt_inputs.c.sample_id))
                           .where(results.c.dataset == "cut",
                                  results.c.finish_reason == "budget")).one()
    turns = [r.turn for r in turn_rows(store, "cut")[cut.conversation]]
    assert turns[-1] == cut.turn  # nothing made after the cut answer


def test_without_a_mode_a_new_dataset_is_all_and_an_old_one_keeps_its_own(
    settings: Settings, store: Store, tmp_path: Path
) -> None:
    fresh = _write(tmp_path / "fresh.jsonl", LINES[:2])
    enqueue_paths(settings, [str(fresh)], turns=None)
    assert store.dataset("fresh").turns == "all"
    assert set(store.prompt_states("fresh")) == {"c0#turn1", "c1#turn1"}
    old = _write(tmp_path / "old.jsonl", LINES[:2])
    enqueue_paths(settings, [str(old)], turns="last")
    [summary] = enqueue_paths(settings, [str(old)], turns=None)  # not refused: still last
    assert store.dataset("old").turns == "last" and summary.enqueued == 0


def test_a_next_turn_is_queued_ahead_of_the_new_conversations(
    settings: Settings, store: Store, ledger: Ledger, tmp_path: Path,
) -> None:
    # Published right after its turn is stored, a next turn goes to the list a worker pops
    # first, so it is sent while its prefix is still in the server's prefix cache.
    lines = [_conversation(2 * i, 2) for i in range(4)]
    enqueue_paths(settings, [str(_write(tmp_path / "ahead.jsonl", lines))],
                  max_new_tokens=400, turns="all")
    ahead, later = dataset_keys("ahead").queue_lists[:2]
    assert ledger.redis.llen(ahead) == 0 and ledger.redis.llen(later) == len(lines)
    ctx = WorkerContext.build(settings)
    for line in lines:
        assert run_sample(ctx, "ahead", turn_id(line["id"], 1)) is Outcome.DONE
    answered = [c for c, rows in turn_rows(store, "ahead").items()
                if _answer(rows[0].output_text)]
    assert answered  # turns with a next one, or the test proves nothing
    waiting = [sample_of(json.loads(raw)) for raw in ledger.redis.lrange(ahead, 0, -1)]
    assert sorted(waiting) == sorted(("ahead", turn_id(c, 2)) for c in answered)
    # The first turns' own messages were not consumed here: still behind, in their list.
    assert ledger.redis.llen(later) == len(lines)
