"""Tool conversations end to end, on SQLite and PostgreSQL: ``datagen enqueue`` with a
tokenizer whose class is Python code, a real worker, the simulator over HTTP; the tools
stored with the prompt, the ids the model's own ``apply_chat_template`` gives, and the
tools on the exported SpecForge rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
import sqlalchemy as sa

from common.ledger import Ledger
from common.schema import prompt_inputs
from common.settings import Settings
from common.store import Store
from common.tokenizer_files import load_tokenizer
from ops.cli import main
from sim.reqlog import input_sha1
from tests.conftest import make_settings
from tests.helpers import assert_invariants, enqueue_paths, running_worker, wait_settled

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {}}}


def _line(i: int) -> dict[str, Any]:
    user = {"role": "user", "content": f"Weather in city {i}?"}
    if i % 3 == 0:  # tools offered, none called yet
        return {"id": f"t{i}", "messages": [user], "tools": [WEATHER, SEARCH]}
    arguments: Any = {"city": f"c{i}"} if i % 2 else json.dumps({"city": f"c{i}"})
    call = {"id": f"call_{i}", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}
    return {"id": f"t{i}", "tools": [WEATHER], "messages": [
        user,
        {"role": "assistant", "content": None, "reasoning_content": "Ask the tool.",
         "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{i}", "name": "get_weather", "content": "sun"},
    ]}


LINES = [_line(i) for i in range(9)]
BAD = {"id": "bad", "messages": [{"role": "user", "content": "q"},
                                 {"role": "tool", "tool_call_id": "nope", "content": "x"}]}


def _write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture
def code_env(db_url: str, code_sim: str, redis_client: redis.Redis, remote_tokenizer: Path,
             monkeypatch: pytest.MonkeyPatch) -> Settings:
    requests.post(f"{code_sim}/sim/reset", timeout=5).raise_for_status()
    settings = make_settings(db_url, code_sim, tokenizer=str(remote_tokenizer))
    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    return settings


def test_tool_conversations_end_to_end_with_a_code_tokenizer(
    code_env: Settings, remote_tokenizer: Path, redis_client: redis.Redis, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = _write(tmp_path / "tools.jsonl", [*LINES[:4], BAD, *LINES[4:]])
    assert main(["enqueue", str(path), "-q"]) == 2  # the folder's code is not run unasked
    assert "--trust-remote-code" in capsys.readouterr().err
    assert main(["enqueue", str(path), "-q", "--trust-remote-code", "--turns", "last",
                 "--max-new-tokens", "64"]) == 0
    err = capsys.readouterr().err
    assert f"{path}:5: turn 2 answers tool call 'nope', which no earlier" in err
    store, ledger = Store(code_env.database_url), Ledger(redis_client)
    with running_worker(code_env.replace(trust_remote_code=True), concurrency=4):
        wait_settled(store, ["tools"])
    assert store.prompt_counts("tools") == {"done": len(LINES)}
    assert_invariants(store, ledger, ["tools"])

    with store.engine.connect() as conn:
        stored = {r.sample_id: r for r in conn.execute(sa.select(prompt_inputs))}
    hf = load_tokenizer(str(remote_tokenizer), trust_remote_code=True)
    sent = {r["input_sha1"] for r in
            requests.get(f"{code_env.sglang_urls[0]}/sim/requests", timeout=5).json()}
    for line in LINES:
        row = stored[line["id"]]
        assert (row.messages, row.tools) == (line["messages"], line["tools"])
        ids = hf.apply_chat_template(line["messages"], tools=line["tools"], tokenize=True,
                                     add_generation_prompt=True, return_dict=False)
        assert row.input_ids == list(ids)
        assert input_sha1(row.input_ids) in sent  # what the model was sent

    out = tmp_path / "export"
    assert main(["export", "--format", "specforge", "--out", str(out)]) == 0
    rows = [json.loads(x) for x in (out / "tools.specforge.jsonl").read_text().splitlines()]
    by_id = {line["id"]: line for line in LINES}
    assert rows, "no row exported"
    for row in rows:
        # Only prompts without tool turns pass SpecForge's checker; they keep their tools.
        assert row["tools"] == by_id[row["id"]]["tools"]
        assert row["conversations"][:-1] == by_id[row["id"]]["messages"]


def test_a_line_the_template_cannot_render_is_a_bad_line(
    settings: Settings, store: Store, tmp_path: Path
) -> None:
    # The bundled template renders no tool call (its turns need content): that line is
    # reported and skipped, the others are stored with their tools.
    path = _write(tmp_path / "mixed.jsonl", [LINES[0], LINES[1], LINES[3]])
    [summary] = enqueue_paths(settings, [str(path)])
    assert (summary.read, summary.bad, summary.enqueued) == (3, 1, 2)
    [problem] = summary.problems
    assert problem.startswith(f"{path}:2: the chat template cannot render it: ")
    with store.engine.connect() as conn:
        rows = conn.execute(sa.select(prompt_inputs.c.sample_id, prompt_inputs.c.tools))
        tools = {sample_id: value for sample_id, value in rows}
    assert tools == {"t0": [WEATHER, SEARCH], "t3": [WEATHER, SEARCH]}
