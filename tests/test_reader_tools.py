"""Reading conversations with tools: every field a chat template reads is kept as read;
malformed tool shapes are bad lines with their reason; hashed ids include the tools."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from producer.reader import PromptRecord, ReadReport, message_hash, read_dataset

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
USER = {"role": "user", "content": "Weather in Paris?"}


def _call(arguments: Any, call_id: str = "call_1", name: str = "get_weather") -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _calling(*calls: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": list(calls), **fields}


def _reply(content: str = "sunny", **fields: Any) -> dict[str, Any]:
    return {"role": "tool", "content": content, **fields}


def _read_lines(tmp_path: Path, *lines: Any) -> tuple[list[PromptRecord], ReadReport, Path]:
    path = tmp_path / "ds.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    report = ReadReport(dataset="ds", files=[str(path)])
    return list(read_dataset("ds", [path], report)), report, path


# ---- good shapes: kept exactly as read -------------------------------------------------

GOOD = {
    "tools_on_a_plain_prompt": ({"messages": [USER], "tools": TOOLS}, [USER]),
    "arguments_as_a_json_string": (
        {"messages": [USER, _calling(_call('{"city": "Paris"}')),
                      _reply(tool_call_id="call_1", name="get_weather")], "tools": TOOLS},
        None),
    "arguments_as_an_object": (
        {"messages": [USER, _calling(_call({"city": "Paris"})), _reply(tool_call_id="call_1")],
         "tools": TOOLS},
        None),
    "reasoning_and_content_beside_the_calls": (
        {"messages": [USER, {"role": "assistant", "content": "Let me look.",
                             "reasoning_content": "A tool knows.",
                             "tool_calls": [_call("{}")]},
                      _reply(tool_call_id="call_1")]},
        None),
    "two_calls_answered_by_id": (
        {"messages": [USER, _calling(_call('{"city": "Paris"}'), _call("{}", "call_2")),
                      _reply("a", tool_call_id="call_1"), _reply("b", tool_call_id="call_2")],
         "tools": TOOLS},
        None),
    "reply_by_function_name_alone": (
        {"messages": [USER, _calling({"function": {"name": "get_weather", "arguments": "{}"}}),
                      _reply(name="get_weather")]},
        None),
    "calling_turn_without_content": (
        {"messages": [USER, {"role": "assistant", "tool_calls": [_call("{}")]},
                      _reply(tool_call_id="call_1")]},
        None),
    "reasoning_of_an_earlier_turn": (
        {"messages": [USER, {"role": "assistant", "content": "4", "reasoning_content": "2+2"},
                      {"role": "user", "content": "again"}]},
        None),
}


@pytest.mark.parametrize("name", list(GOOD))
def test_good_shapes_are_kept_as_read(tmp_path: Path, name: str) -> None:
    line, expected = GOOD[name]
    [record], report, _ = _read_lines(tmp_path, {"id": name, **line})
    assert (report.bad, report.problems) == (0, [])
    assert list(record.messages) == (line["messages"] if expected is None else expected)
    assert record.tools == line.get("tools")


def test_a_trailing_calling_turn_is_dropped_like_any_answer(tmp_path: Path) -> None:
    [record], _, _ = _read_lines(tmp_path, {"messages": [USER, _calling(_call("{}"))]})
    assert list(record.messages) == [USER]


def test_fields_no_template_reads_are_dropped_as_before(tmp_path: Path) -> None:
    line = {"messages": [{"role": "user", "content": "q", "weight": 1, "name": "ann"},
                         {"role": "tool", "content": "t", "reasoning_content": "x"}]}
    [record], _, _ = _read_lines(tmp_path, line)
    assert list(record.messages) == [{"role": "user", "content": "q"},
                                     {"role": "tool", "content": "t"}]


def test_sharegpt_values_and_text_parts_still_apply_beside_tool_fields(tmp_path: Path) -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    line = {"conversations": [{"from": "human", "value": parts},
                              {"from": "gpt", "value": None, "tool_calls": [_call("{}")]},
                              {"from": "tool", "value": "r", "tool_call_id": "call_1"}]}
    [record], _, _ = _read_lines(tmp_path, line)
    assert list(record.messages) == [
        {"role": "user", "content": "one\ntwo"},
        {"role": "assistant", "content": None, "tool_calls": [_call("{}")]},
        {"role": "tool", "content": "r", "tool_call_id": "call_1"},
    ]


# ---- bad shapes: file:line: reason -----------------------------------------------------

BAD = [
    ({"messages": [USER], "tools": "get_weather"},
     "'tools' is not a list of function schemas (got str)"),
    ({"messages": [USER], "tools": ["get_weather"]}, "tool 1 in 'tools' is not an object"),
    ({"messages": [USER], "tools": [{"type": "function", "function": {"parameters": {}}}]},
     "tool 1 in 'tools' has no function name"),
    ({"messages": [USER, {"role": "assistant", "content": None, "tool_calls": {"id": "c"}},
                   _reply()]},
     "tool_calls of turn 2 is not a list (got dict)"),
    ({"messages": [USER, {"role": "assistant", "content": None, "tool_calls": "call it"},
                   _reply()]},
     "tool_calls of turn 2 is not a list (got str)"),
    ({"messages": [USER, _calling(_call("{city: Paris}")), _reply(tool_call_id="call_1")]},
     "arguments of tool call 1 of turn 2 are not JSON: "),
    ({"messages": [USER, _calling(_call("[1, 2]")), _reply(tool_call_id="call_1")]},
     "arguments of tool call 1 of turn 2 are not a JSON object (got list)"),
    ({"messages": [USER, _calling(_call(7)), _reply(tool_call_id="call_1")]},
     "arguments of tool call 1 of turn 2 are not a JSON object (got int)"),
    ({"messages": [USER, _calling({"id": "c", "function": {"name": "f"}}), _reply()]},
     "tool call 1 of turn 2 has no arguments"),
    ({"messages": [USER, _calling({"id": "c", "function": {"arguments": "{}"}}), _reply()]},
     "tool call 1 of turn 2 has no function name"),
    ({"messages": [USER, _calling({"type": "code", "function": {}}), _reply()]},
     "tool call 1 of turn 2 has type 'code' (only 'function' is known)"),
    ({"messages": [USER, _calling(["not", "a", "call"]), _reply()]},
     "tool call 1 of turn 2 is not an object"),
    ({"messages": [USER, _calling({**_call("{}"), "id": 3}), _reply()]},
     "tool call 1 of turn 2 has an id that is not a string"),
    ({"messages": [USER, _reply(tool_call_id="call_1")]},
     "turn 2 answers tool call 'call_1', which no earlier assistant turn made"),
    ({"messages": [USER, _calling(_call("{}")), _reply(tool_call_id="call_9")]},
     "turn 3 answers tool call 'call_9', which no earlier assistant turn made"),
    ({"messages": [USER, _calling(_call("{}")), _reply(tool_call_id="call_1", name="search")]},
     "turn 3 answers tool call 'call_1' as 'search', but that call was to 'get_weather'"),
    ({"messages": [USER, _reply(name="get_weather")]},
     "turn 2 answers function 'get_weather', which no earlier assistant turn called"),
    ({"messages": [USER, {"role": "user", "content": "x", "tool_calls": [_call("{}")]}]},
     "turn 2 is a user turn with tool_calls (only assistant turns call tools)"),
    ({"messages": [USER, {"role": "assistant", "content": None}, USER]},
     "content of turn 2 is not a string (got NoneType)"),
    ({"messages": [USER, {"role": "assistant", "content": None, "tool_calls": []}, USER]},
     "content of turn 2 is not a string (got NoneType)"),
    ({"messages": [USER, {"role": "assistant", "content": "a", "reasoning_content": 5}, USER]},
     "reasoning_content of turn 2 is not a string (got int)"),
    ({"messages": [USER, _calling(_call("{}")), _reply(tool_call_id=1)]},
     "tool_call_id of turn 3 is not a string (got int)"),
]


@pytest.mark.parametrize(("line", "reason"), BAD, ids=[reason for _, reason in BAD])
def test_bad_shapes_are_bad_lines_with_a_reason(tmp_path: Path, line: Any, reason: str) -> None:
    good = {"id": "ok", "messages": [USER], "tools": TOOLS}
    records, report, path = _read_lines(tmp_path, good, line, good | {"id": "after"})
    assert [r.sample_id for r in records] == ["ok", "after"]  # the rest of the file is read
    assert (report.read, report.bad) == (3, 1)
    [problem] = report.problems
    assert problem.startswith(f"{path}:2: {reason}")


# ---- sample ids --------------------------------------------------------------------------


def test_two_lines_differing_only_in_tools_get_different_ids(tmp_path: Path) -> None:
    other = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "name": "get_time"}}]
    lines = ({"messages": [USER]}, {"messages": [USER], "tools": TOOLS},
             {"messages": [USER], "tools": other})
    records, report, _ = _read_lines(tmp_path, *lines)
    assert report.duplicates == 0
    assert len({r.sample_id for r in records}) == 3
    assert records[1].sample_id == message_hash([USER], TOOLS)
    # Without tools the recipe is the one every stored hash id was made with.
    assert records[0].sample_id == message_hash([USER])
    assert message_hash([{"role": "user", "content": "hi"}]) == "h4e79873118cd9be7"


def test_the_same_tool_line_twice_is_a_duplicate(tmp_path: Path) -> None:
    line = {"messages": [USER, _calling(_call("{}")), _reply(tool_call_id="call_1")],
            "tools": TOOLS}
    records, report, _ = _read_lines(tmp_path, line, line)
    assert len(records) == 1 and report.duplicates == 1


def test_tool_calls_are_part_of_the_hashed_id(tmp_path: Path) -> None:
    a = {"messages": [USER, _calling(_call('{"city": "Paris"}')), _reply(tool_call_id="call_1")]}
    b = {"messages": [USER, _calling(_call('{"city": "Rome"}')), _reply(tool_call_id="call_1")]}
    records, report, _ = _read_lines(tmp_path, a, b)
    assert report.duplicates == 0 and records[0].sample_id != records[1].sample_id
