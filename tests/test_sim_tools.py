"""The simulator's tool calls and reasoning over HTTP: ``/parse_function_call`` and
``/separate_reasoning`` on hand-written texts, and outputs that call tools when a prompt in
the remote-code test tokenizer's format asks for them, parsed back by those endpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import requests

from common.tokenizer_files import load_tokenizer
from sim.toolcalls import call_block

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {}}}
CALL = '<|call|>c1:get_weather<|args|>{"city": "Oslo"}<|/call|>'


def _post(url: str, path: str, body: Any) -> requests.Response:
    return requests.post(f"{url}{path}", json=body, timeout=10)


@pytest.mark.parametrize(("text", "tools", "normal", "calls"), [
    ("Let me look.", [WEATHER], "Let me look.", []),
    (f"why</think>Looking.<|calls|>{CALL}<|/calls|>", [WEATHER], "why</think>Looking.",
     [{"tool_index": 0, "name": "get_weather", "parameters": '{"city": "Oslo"}'}]),
    (f"<|calls|>{CALL}<|call|>x:search<|args|>{{}}<|/call|><|/calls|>", [WEATHER, SEARCH], "",
     [{"tool_index": 0, "name": "get_weather", "parameters": '{"city": "Oslo"}'},
      {"tool_index": 1, "name": "search", "parameters": "{}"}]),
    # A call to a function the request does not offer is dropped, as SGLang drops it.
    (f"A<|calls|>{CALL}<|/calls|>", [SEARCH], f"A<|calls|>{CALL}<|/calls|>", []),
    # A call cut before its end is no call.
    ('A<|calls|><|call|>c1:get_weather<|args|>{"ci', [WEATHER],
     'A<|calls|><|call|>c1:get_weather<|args|>{"ci', []),
])
def test_parse_function_call_answers_as_sglang(code_sim: str, text: str, tools: list[Any],
                                               normal: str, calls: list[Any]) -> None:
    resp = _post(code_sim, "/parse_function_call",
                 {"text": text, "tools": tools, "tool_call_parser": "datagen"})
    assert resp.status_code == 200
    assert resp.json() == {"normal_text": normal, "calls": calls}


@pytest.mark.parametrize(("text", "reasoning", "answer"), [
    ("I think so.</think> Yes.", "I think so.", "Yes."),
    ("<think>Hm.</think>No", "Hm.", "No"),
    ("Still thinking", "Still thinking", ""),  # cut off while reasoning
])
def test_separate_reasoning_answers_as_sglang(code_sim: str, text: str, reasoning: str,
                                              answer: str) -> None:
    resp = _post(code_sim, "/separate_reasoning", {"text": text, "reasoning_parser": "datagen"})
    assert resp.status_code == 200
    assert resp.json() == {"text": answer, "reasoning_text": reasoning}


def test_model_info_names_the_parsers_the_endpoints_accept(code_sim: str) -> None:
    info = requests.get(code_sim + "/model_info", timeout=5).json()
    resp = _post(code_sim, "/separate_reasoning",
                 {"text": "a</think>b", "reasoning_parser": info["reasoning_parser"]})
    assert resp.status_code == 200 and resp.json()["text"] == "b"
    resp = _post(code_sim, "/parse_function_call",
                 {"text": "x", "tools": [], "tool_call_parser": info["tool_call_parser"]})
    assert resp.status_code == 200 and resp.json()["normal_text"] == "x"


def test_unknown_parsers_and_bad_bodies_fail_as_in_sglang(code_sim: str) -> None:
    resp = _post(code_sim, "/parse_function_call",
                 {"text": "x", "tools": [], "tool_call_parser": "kimi_k2"})
    assert (resp.status_code, resp.text) == (500, "Internal Server Error")
    resp = _post(code_sim, "/separate_reasoning", {"text": "x", "reasoning_parser": "qwen3"})
    assert resp.status_code == 500
    resp = _post(code_sim, "/parse_function_call", {"text": "x", "tool_call_parser": "datagen"})
    assert resp.status_code == 400 and "tools" in resp.json()["message"]


def _prompt(hf: Any, messages: list[dict[str, Any]], tools: list[Any] | None) -> list[int]:
    ids = hf.apply_chat_template(messages, tools=tools, tokenize=True,
                                 add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _generate(url: str, ids: list[int], max_new: int = 400) -> dict[str, Any]:
    resp = _post(url, "/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": max_new}})
    resp.raise_for_status()
    return dict(resp.json())


def _parsed(url: str, hf: Any, out: dict[str, Any], tools: list[Any]) -> dict[str, Any]:
    text = hf.decode(out["output_ids"][:-1], skip_special_tokens=False)
    resp = _post(url, "/parse_function_call",
                 {"text": text, "tools": tools, "tool_call_parser": "datagen"})
    return dict(resp.json())


def test_outputs_call_the_tools_a_prompt_asks_for_round_by_round(
        code_sim: str, remote_tokenizer: Path) -> None:
    hf = load_tokenizer(str(remote_tokenizer), trust_remote_code=True)
    user = {"role": "user", "content": "Plan. <<call get_weather,search>> <<call search>>"}
    tools = [WEATHER, SEARCH]
    first = _generate(code_sim, _prompt(hf, [user], tools))
    assert first["meta_info"]["finish_reason"]["type"] == "stop"
    parsed = _parsed(code_sim, hf, first, tools)
    assert [c["name"] for c in parsed["calls"]] == ["get_weather", "search"]
    assert all(json.loads(c["parameters"]) for c in parsed["calls"])
    reasoning = _post(code_sim, "/separate_reasoning",
                      {"text": parsed["normal_text"], "reasoning_parser": "datagen"}).json()
    assert reasoning["reasoning_text"]  # reasoning, then the answer, then the calls
    again = _generate(code_sim, _prompt(hf, [user], tools))
    assert again["output_ids"] == first["output_ids"]  # deterministic per prompt
    calls = [{"id": f"k{i}", "type": "function",
              "function": {"name": c["name"], "arguments": c["parameters"]}}
             for i, c in enumerate(parsed["calls"])]
    history: list[dict[str, Any]] = [
        user, {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "k0", "content": "sun"},
        {"role": "tool", "tool_call_id": "k1", "content": "found"}]
    second = _parsed(code_sim, hf, _generate(code_sim, _prompt(hf, history, tools)), tools)
    assert [c["name"] for c in second["calls"]] == ["search"]
    history += [{"role": "assistant", "content": "", "tool_calls": calls[1:]},
                {"role": "tool", "tool_call_id": "k1", "content": "more"}]
    third = _generate(code_sim, _prompt(hf, history, tools))
    assert _parsed(code_sim, hf, third, tools)["calls"] == []  # past the last directive


def test_no_calls_without_tools_or_a_directive_and_a_cap_cuts_them(
        code_sim: str, remote_tokenizer: Path) -> None:
    hf = load_tokenizer(str(remote_tokenizer), trust_remote_code=True)
    asked = {"role": "user", "content": "Go <<call get_weather>>"}
    for messages, tools in (([asked], None), ([{"role": "user", "content": "Go"}], [WEATHER])):
        out = _generate(code_sim, _prompt(hf, messages, tools))
        assert "<|calls|>" not in hf.decode(out["output_ids"], skip_special_tokens=False)
    full = _generate(code_sim, _prompt(hf, [asked], [WEATHER]))
    n = len(full["output_ids"])
    cut = _generate(code_sim, _prompt(hf, [asked], [WEATHER]), max_new=n - 3)
    assert cut["output_ids"] == full["output_ids"][: n - 3]  # prefix-stable
    assert cut["meta_info"]["finish_reason"]["type"] == "length"
    assert _parsed(code_sim, hf, cut | {"output_ids": cut["output_ids"] + [0]},
                   [WEATHER])["calls"] == []


def test_the_call_block_is_what_the_template_renders(remote_tokenizer: Path) -> None:
    hf = load_tokenizer(str(remote_tokenizer), trust_remote_code=True)
    block = call_block(["get_weather"], b"\x01\x02\x03\x04")
    arguments = json.loads(block.split("<|args|>")[1].split("<|/call|>")[0])
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "sim0", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]}
    rendered = hf.apply_chat_template([{"role": "user", "content": "q"}, message],
                                      tokenize=False, add_generation_prompt=False)
    assert block in rendered


def test_a_tool_call_parse_goes_to_another_server_when_one_is_down(code_sim: str) -> None:
    # The parse of a turn's calls is asked of the server that generated the turn; one
    # that went down since must not end the conversation while another can parse.
    from common.errors import ServerUnreachable
    from common.sglang_client import SGLangClient
    from ops.localredis import free_port
    from workers.tool_turns import parse_on_fleet

    down = f"http://127.0.0.1:{free_port()}"
    client = SGLangClient((down, code_sim), connect_timeout_s=1.0)
    asked: list[str] = []

    def parse_at(server: str, text: str, tools: list[Any]) -> tuple[str, list[Any]]:
        asked.append(server)
        return client.parse_function_call(server, text, tools, "datagen")

    parse = parse_on_fleet(parse_at, down, client.urls, pauses_s=())
    normal, calls = parse(f"Looking.<|calls|>{CALL}<|/calls|>", [WEATHER])
    assert (normal, [c["name"] for c in calls]) == ("Looking.", ["get_weather"])
    assert asked == [down, code_sim]

    asked.clear()
    alone = parse_on_fleet(parse_at, down, (down,), pauses_s=(0.01,))
    with pytest.raises(ServerUnreachable):
        alone(f"<|calls|>{CALL}<|/calls|>", [WEATHER])
    assert asked == [down, down]

    # Past its deadline, no further attempt starts: a server that hangs until its read
    # timeout holds the turn's store once, not once per attempt.
    asked.clear()
    late = parse_on_fleet(parse_at, down, (down,), pauses_s=(0.01, 0.01), deadline_s=0.0)
    with pytest.raises(ServerUnreachable):
        late(f"<|calls|>{CALL}<|/calls|>", [WEATHER])
    assert asked == [down]
