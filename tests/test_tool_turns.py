"""Tool-calling turns regenerated turn by turn, on SQLite and PostgreSQL: ``datagen
enqueue --turns all --tool-call-parser datagen`` with the remote-code test tokenizer, a
real worker, the simulator over HTTP (its outputs call the tools a prompt's ``<<call>>``
directives ask for; its ``/parse_function_call`` parses them).

Each turn's ids equal a reference rendering built here from the stored own answers, the
model's own calls (with the line's call ids) and the line's tool results; results are
spliced only after calls that match the line's; a mismatch ends the conversation with its
reason in SQL and in ``status``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from common.conversation import TOOLS_DIFFER
from common.conversation_store import conversation_counts
from common.ledger import Ledger
from common.settings import Settings
from common.store import Store
from common.tokenizer_files import load_tokenizer
from ops.cli import main
from sim.reqlog import input_sha1
from sim.toolcalls import parse_calls
from tests.conftest import make_settings
from tests.helpers import (
    assert_invariants,
    history_with_own_answers,
    running_worker,
    turn_rows,
    wait_settled,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {}}}
TOOLS = [WEATHER, SEARCH]


def _call(call_id: str, name: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": {"city": "Oslo"}}}


def _tool(call_id: str, name: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


def _agent(i: int) -> dict[str, Any]:
    """Calls that the model repeats: get_weather; an answer; get_weather and search."""
    return {"id": f"a{i}", "tools": TOOLS, "messages": [
        {"role": "user", "content": f"Weather {i}? <<call get_weather>>"},
        {"role": "assistant", "content": None, "tool_calls": [_call(f"w{i}", "get_weather")]},
        _tool(f"w{i}", "get_weather", f"RESULT-a{i}-sun"),
        {"role": "assistant", "content": "LINE-ANSWER sunny."},
        {"role": "user", "content": "And tomorrow? <<call get_weather,search>>"},
        {"role": "assistant", "content": "Two calls.", "tool_calls": [
            _call(f"x{i}", "get_weather"), _call(f"y{i}", "search")]},
        _tool(f"x{i}", "get_weather", f"RESULT-a{i}-rain"),
        _tool(f"y{i}", "search", f"RESULT-a{i}-found"),
        {"role": "assistant", "content": "LINE-ANSWER rain."},
    ]}


def _differing(i: int, directive: str) -> dict[str, Any]:
    """The line calls get_weather; the model calls what the directive says (or nothing)."""
    return {"id": f"d{i}", "tools": TOOLS, "messages": [
        {"role": "user", "content": f"Look {i} up. {directive}"},
        {"role": "assistant", "content": None, "tool_calls": [_call(f"z{i}", "get_weather")]},
        _tool(f"z{i}", "get_weather", f"RESULT-d{i}-never"),
        {"role": "assistant", "content": "LINE-ANSWER done."},
    ]}


AGENTS = [_agent(i) for i in range(3)]
DIFFERING = [_differing(0, "<<call search>>"), _differing(1, ""),
             _differing(2, "<<call get_weather,search>>")]


def _write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture
def tool_env(db_url: str, code_sim: str, remote_tokenizer: Path, redis_client: redis.Redis,
             monkeypatch: pytest.MonkeyPatch) -> Settings:
    del redis_client  # flushed for each test: another test's store left no ledgers in it
    requests.post(f"{code_sim}/sim/reset", timeout=5).raise_for_status()
    settings = make_settings(db_url, code_sim, tokenizer=str(remote_tokenizer),
                             trust_remote_code=True)
    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    return settings


def _own(hf: Any, output_ids: list[int], originals: list[dict[str, Any]]) -> dict[str, Any]:
    """The reference history message of a stored output: reasoning split at ``</think>``,
    calls parsed from the text with its markers and given the line's call ids."""
    text = hf.decode(output_ids[:-1], skip_special_tokens=False)  # EOS off
    normal, calls = parse_calls(text, TOOLS) if originals else (text, [])
    thought, _, answer = normal.partition("</think>")
    own: dict[str, Any] = {"role": "assistant", "content": answer.strip(),
                           "reasoning_content": thought.strip()}
    if originals:
        assert [c.name for c in calls] == [o["function"]["name"] for o in originals]
        own["tool_calls"] = [{"id": o["id"], "type": "function", "function": {
            "name": c.name, "arguments": c.parameters}} for c, o in zip(calls, originals,
                                                                         strict=True)]
    return own


def _reference(hf: Any, line: dict[str, Any], outputs: list[list[int]], turn: int) -> list[int]:
    """Turn ``turn``'s ids: the line up to that turn, each earlier answer of the line
    replaced by the model's own (with its calls), the line's tool results kept."""
    messages = history_with_own_answers(line["messages"], turn, lambda k, original: _own(
        hf, outputs[k - 1], original.get("tool_calls") or []))
    return list(hf.apply_chat_template(messages, tools=line["tools"], tokenize=True,
                                       add_generation_prompt=True, return_dict=False))


def test_tool_turns_splice_the_lines_results_after_matching_calls(
    tool_env: Settings, remote_tokenizer: Path, redis_client: redis.Redis, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = _write(tmp_path / "agents.jsonl", AGENTS + DIFFERING)
    assert main(["enqueue", str(path), "-q", "--trust-remote-code", "--turns", "all",
                 "--tool-call-parser", "datagen", "--max-new-tokens", "1000"]) == 0
    store, ledger = Store(tool_env.database_url), Ledger(redis_client)
    with running_worker(tool_env, concurrency=4):
        wait_settled(store, ["agents"], client=redis_client)
    assert_invariants(store, ledger, ["agents"])
    hf = load_tokenizer(str(remote_tokenizer), trust_remote_code=True)
    log = requests.get(f"{tool_env.sglang_urls[0]}/sim/requests", timeout=5).json()
    sent = {r["input_sha1"] for r in log}
    by = turn_rows(store, "agents")

    for line in AGENTS:  # every turn: 4 of them, the model's calls matching the line's
        rows = by[line["id"]]
        assert [(r.turn, r.state) for r in rows] == [(t, "done") for t in range(1, 5)]
        outputs = [list(r.output_ids) for r in rows]
        for r in rows:
            assert list(r.input_ids) == _reference(hf, line, outputs, r.turn), (line["id"], r.turn)
            assert input_sha1(list(r.input_ids)) in sent
            assert "LINE-ANSWER" not in hf.decode(list(r.input_ids))
        # The results follow the model's own calls, under the line's call ids.
        second = hf.decode(list(rows[1].input_ids), skip_special_tokens=False)
        assert f"<|call|>w{line['id'][1:]}:get_weather<|args|>" in second
        assert f"RESULT-{line['id']}-sun" in second

    for line in DIFFERING:  # ends at turn 1: turn 2 skipped with the reason, never sent
        first, cut = by[line["id"]]
        assert (first.state, cut.state, cut.output_ids) == ("done", "skipped", None)
        assert cut.error.startswith(f"{TOOLS_DIFFER}: the model called ")
        assert "the line called [get_weather]" in cut.error
    assert "no tool" in by["d1"][1].error and "[get_weather, search]" in by["d2"][1].error
    for r in log:  # no result of a differing call reached the model
        assert not any(input_sha1(list(row.input_ids)) == r["input_sha1"]
                       for line in DIFFERING for row in by[line["id"]][1:])
    counts = conversation_counts(store, "agents", closed=False)
    assert (counts.complete, counts.partial, counts.tools_differ) == (3, 3, 3)

    capsys.readouterr()
    assert main(["status", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["datasets"]
    assert row["conversations"]["tools_differ"] == 3
    _check_specforge_tool_calls(hf, by, tmp_path)
    _check_speculators_tool_conversations(hf, by, tmp_path / "speculators")


def _exported(out: Path, *flags: str) -> dict[str, dict[str, Any]]:
    assert main(["export", "--format", "specforge", *flags, "--out", str(out)]) == 0
    assert main(["validate", str(out)]) == 0  # SpecForge's rules, tool turns included
    return {r["id"]: r for r in map(json.loads, (out / "agents.specforge.jsonl")
                                    .read_text().splitlines())}


def _check_specforge_tool_calls(hf: Any, by: dict[str, list[Any]], tmp_path: Path) -> None:
    """SpecForge rows: each answer that called tools carries the model's own calls under
    the line's call ids, its text as ``content``, the line's tool results after it; a
    turn whose calls were not the line's is left out, and said why."""
    rows = _exported(tmp_path / "conversations")
    assert set(rows) == {f"{line['id']}#turn4" for line in AGENTS}
    for line in AGENTS:
        outputs = [list(r.output_ids) for r in by[line["id"]]]
        originals = [m.get("tool_calls") or [] for m in line["messages"]
                     if m["role"] == "assistant"]
        want = [_own(hf, out, calls) for out, calls in zip(outputs, originals, strict=True)]
        got = [m for m in rows[f"{line['id']}#turn4"]["conversations"]
               if m["role"] == "assistant"]
        assert [m.get("tool_calls") for m in got] == [w.get("tool_calls") for w in want]
        assert [m["content"] for m in got] == [w["content"] for w in want]
        roles = [m["role"] for m in rows[f"{line['id']}#turn4"]["conversations"]]
        assert roles == ["user", "assistant", "tool", "assistant", "user", "assistant",
                         "tool", "tool", "assistant"]
    manifest = json.loads((tmp_path / "conversations" / "manifest.datagen").read_text())
    assert manifest["datasets"]["agents"]["left_out"]["tool_calls_differ"] == len(DIFFERING)
    # A row per turn: a turn that called tools ends its row with its own calls.
    turns = _exported(tmp_path / "turns", "--rows", "turn")
    assert set(turns) == {f"{line['id']}#turn{k}" for line in AGENTS for k in range(4)}
    for line in AGENTS:
        last = turns[f"{line['id']}#turn2"]["conversations"][-1]
        assert [c["function"]["name"] for c in last["tool_calls"]] == ["get_weather", "search"]
        assert [c["id"] for c in last["tool_calls"]] == [f"x{line['id'][1:]}",
                                                         f"y{line['id'][1:]}"]


def test_tool_calls_without_a_parser_are_refused_under_turns_all(
    tool_env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    path = _write(tmp_path / "refused.jsonl", AGENTS[:1])
    assert main(["enqueue", str(path), "-q", "--trust-remote-code", "--turns", "all"]) == 2
    err = capsys.readouterr().err
    assert "--tool-call-parser" in err and "--turns last" in err
    assert not Store(tool_env.database_url).prompt_counts("refused")
    # --turns last takes it as before: its last turn only, after the line's own turns.
    assert main(["enqueue", str(path), "-q", "--trust-remote-code", "--turns", "last"]) == 0


def test_a_budget_closing_mid_agent_starts_no_later_turn(
    tool_env: Settings, redis_client: redis.Redis, tmp_path: Path,
) -> None:
    path = _write(tmp_path / "short.jsonl", AGENTS)
    assert main(["enqueue", str(path), "-q", "--trust-remote-code", "--turns", "all",
                 "--tool-call-parser", "datagen", "--max-new-tokens", "1000",
                 "--budget-tokens", "200"]) == 0
    store, ledger = Store(tool_env.database_url), Ledger(redis_client)
    with running_worker(tool_env, concurrency=1):
        wait_settled(store, ["short"], client=redis_client)
    ds = store.dataset("short")
    assert ds.state == "closed" and ds.closed_at is not None
    log = requests.get(f"{tool_env.sglang_urls[0]}/sim/requests", timeout=5).json()
    assert log and max(r["arrived_ts"] for r in log) <= ds.closed_at.timestamp()
    assert_invariants(store, ledger, ["short"])
    counts = conversation_counts(store, "short", closed=True)
    assert counts.partial > 0 and counts.in_progress == 0


def test_the_agentic_example_runs_turn_by_turn(
    sqlite_url: str, code_sim: str, remote_tokenizer: Path, redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """examples/agentic/tools.jsonl, as the README runs it: its directives have the model
    repeat the line's calls, but for every fourth line, whose directive differs."""
    requests.post(f"{code_sim}/sim/reset", timeout=5).raise_for_status()
    settings = make_settings(sqlite_url, code_sim, tokenizer=str(remote_tokenizer),
                             trust_remote_code=True)
    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    example = Path(__file__).resolve().parents[1] / "examples" / "agentic" / "tools.jsonl"
    assert main(["enqueue", str(example), "-q", "--trust-remote-code", "--turns", "all",
                 "--tool-call-parser", "datagen", "--max-new-tokens", "1000"]) == 0
    store = Store(sqlite_url)
    with running_worker(settings, concurrency=4):
        wait_settled(store, ["tools"], client=redis_client)
    assert_invariants(store, Ledger(redis_client), ["tools"])
    counts = conversation_counts(store, "tools", closed=False)
    assert (counts.total, counts.complete, counts.tools_differ) == (10, 8, 2)


def _check_speculators_tool_conversations(hf: Any, by: dict[str, list[Any]], out: Path) -> None:
    """speculators ``--rows conversation`` of tool conversations: what is masked 1 in the
    prompt is the model's own text and reasoning, never a call as the template renders
    it nor a tool result; validate agrees with SQL."""
    assert main(["export", "--format", "speculators", "--rows", "conversation",
                 "--out", str(out)]) == 0
    assert main(["validate", str(out)]) == 0
    rows = {r["id"]: r for r in map(json.loads, (out / "agents.speculators.jsonl")
                                    .read_text().splitlines())}
    for line in AGENTS:
        stored = by[line["id"]]
        row = rows[f"{line['id']}#turn4"]
        prompt = list(stored[-1].input_ids)
        mask = row["loss_mask"][: len(prompt)]
        own = [_own(hf, list(r.output_ids), []) for r in stored[:-1]]
        pieces = [p for o in own for p in (o["reasoning_content"], o["content"]) if p]
        runs, current = [], []
        for token, bit in [*zip(prompt, mask, strict=True), (0, 0)]:
            if bit:
                current.append(token)
            elif current:
                runs.append(hf.decode(current, skip_special_tokens=False))
                current = []
        assert runs and all(any(run in p for p in pieces) for run in runs), runs
        assert not any("RESULT-" in run or "<|call|>" in run for run in runs)
