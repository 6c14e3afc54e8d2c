"""Reading prompt files: every accepted shape, every bad-line reason, discovery errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.errors import InputError
from producer import reader
from producer.reader import PromptRecord, ReadReport, discover, message_hash, read_dataset

USER_ASSISTANT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def _write(path: Path, *lines: Any) -> Path:
    """Write lines: dicts as JSON, str and bytes verbatim."""
    with path.open("wb") as fh:
        for line in lines:
            if isinstance(line, bytes):
                fh.write(line + b"\n")
            elif isinstance(line, str):
                fh.write(line.encode() + b"\n")
            else:
                fh.write(json.dumps(line).encode() + b"\n")
    return path


def _read(*files: Path, dataset: str = "ds") -> tuple[list[PromptRecord], ReadReport]:
    report = ReadReport(dataset=dataset, files=[str(f) for f in files])
    return list(read_dataset(dataset, files, report)), report


def _one_bad(tmp_path: Path, line: Any) -> str:
    """Read ``line`` after a good one; return the problem reported for it."""
    path = _write(tmp_path / "ds.jsonl", {"id": "ok", "messages": USER_ASSISTANT}, line)
    records, report = _read(path)
    assert [r.sample_id for r in records] == ["ok"]
    assert (report.read, report.bad, report.duplicates) == (2, 1, 0)
    [problem] = report.problems
    assert problem.startswith(f"{path}:2: ")
    return problem.removeprefix(f"{path}:2: ")


# ---- accepted shapes ------------------------------------------------------------------


def test_messages_shape(tmp_path: Path) -> None:
    path = _write(tmp_path / "chat.jsonl", {"id": "a1", "messages": USER_ASSISTANT})
    [record], report = _read(path, dataset="chat")
    assert record == PromptRecord("chat", "a1", ({"role": "user", "content": "hi"},), f"{path}:1")
    assert (report.read, report.bad, report.duplicates, report.problems) == (1, 0, 0, [])


def test_conversations_with_roles(tmp_path: Path) -> None:
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]
    [record], _ = _read(_write(tmp_path / "ds.jsonl", {"id": 7, "conversations": turns}))
    assert record.sample_id == "7"  # integer ids become their decimal string
    assert record.messages == tuple(turns)


def test_sharegpt_shape(tmp_path: Path) -> None:
    turns = [
        {"from": "system", "value": "sys"},
        {"from": "human", "value": "q1"},
        {"from": "gpt", "value": "a1"},
        {"from": "user", "value": "q2"},
        {"from": "tool", "value": "t"},
        {"from": "gpt", "value": "final"},
    ]
    [record], _ = _read(_write(tmp_path / "ds.jsonl", {"id": "s", "conversations": turns}))
    assert [m["role"] for m in record.messages] == ["system", "user", "assistant", "user", "tool"]
    assert [m["content"] for m in record.messages] == ["sys", "q1", "a1", "q2", "t"]


def test_text_parts_are_joined(tmp_path: Path) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    line = {"id": "p", "messages": [{"role": "user", "content": parts}]}
    [record], _ = _read(_write(tmp_path / "ds.jsonl", line))
    assert record.messages == ({"role": "user", "content": "first\nsecond"},)


def test_trailing_assistant_turns_dropped(tmp_path: Path) -> None:
    turns = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
        {"role": "assistant", "content": "a3"},
    ]
    [record], _ = _read(_write(tmp_path / "ds.jsonl", {"id": "t", "messages": turns}))
    assert record.messages == tuple(turns[:3])
    assert record.messages[-1]["role"] == "user"


def test_blank_lines_skipped_silently(tmp_path: Path) -> None:
    path = _write(tmp_path / "ds.jsonl", "", {"id": "x", "messages": USER_ASSISTANT}, "   \t", "")
    [record], report = _read(path)
    assert record.source == f"{path}:2"
    assert (report.read, report.bad, report.problems) == (1, 0, [])


def test_byte_order_mark_on_first_line(tmp_path: Path) -> None:
    line = b"\xef\xbb\xbf" + json.dumps({"id": "bom", "messages": USER_ASSISTANT}).encode()
    [record], report = _read(_write(tmp_path / "ds.jsonl", line))
    assert record.sample_id == "bom" and report.bad == 0


# ---- sample ids -----------------------------------------------------------------------


def test_hash_ids_are_stable_and_shape_independent(tmp_path: Path) -> None:
    as_messages = {"messages": [{"role": "user", "content": "héllo"}]}
    as_sharegpt = {
        "conversations": [{"from": "human", "value": "héllo"}, {"from": "gpt", "value": "x"}]
    }
    [first], _ = _read(_write(tmp_path / "a.jsonl", as_messages))
    [second], _ = _read(_write(tmp_path / "b.jsonl", as_sharegpt))
    assert first.sample_id == second.sample_id == message_hash(list(first.messages))
    # Literal values pin the recipe: changing it would orphan every hash id already stored.
    assert first.sample_id == "h532a996701783aab"
    assert message_hash([{"role": "user", "content": "hi"}]) == "h4e79873118cd9be7"
    assert message_hash([{"content": "hi", "role": "user"}]) == "h4e79873118cd9be7"


def test_duplicate_ids_first_wins(tmp_path: Path) -> None:
    a = _write(
        tmp_path / "ds.jsonl",
        {"id": "same", "messages": [{"role": "user", "content": "one"}]},
        {"id": "same", "messages": [{"role": "user", "content": "two"}]},
    )
    (tmp_path / "more").mkdir()
    b = _write(tmp_path / "more" / "ds.jsonl", {"id": "same", "messages": USER_ASSISTANT})
    records, report = _read(a, b)
    assert [r.messages[0]["content"] for r in records] == ["one"]
    assert (report.read, report.bad, report.duplicates) == (3, 0, 2)
    assert report.problems == [
        f"{a}:2: duplicate id 'same' (first at {a}:1)",
        f"{b}:1: duplicate id 'same' (first at {a}:1)",
    ]


def test_repeated_prompt_without_id_is_duplicate(tmp_path: Path) -> None:
    line = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    other = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]}
    records, report = _read(_write(tmp_path / "ds.jsonl", line, other))
    assert len(records) == 1 and report.duplicates == 1


# ---- bad lines ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "invalid JSON: "),
        ("[1, 2]", "not a JSON object (got list)"),
        ('"text"', "not a JSON object (got str)"),
        ({"id": "x"}, "no 'messages' or 'conversations' list, or it is empty"),
        ({"id": "x", "messages": []}, "no 'messages' or 'conversations' list, or it is empty"),
        ({"messages": ["hi"]}, "turn 1 is not an object"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "x"}]},
            "unknown role 'robot' in turn 2",
        ),
        ({"conversations": [{"from": "bing", "value": "x"}]}, "unknown role 'bing' in turn 1"),
        ({"messages": [{"content": "no role"}]}, "unknown role None in turn 1"),
        ({"messages": [{"role": "system", "content": "s"}]}, "no user turn"),
        ({"messages": [{"role": "assistant", "content": "a"}]}, "no user turn"),
        (
            {"messages": [{"role": "user", "content": 5}]},
            "content of turn 1 is not a string (got int)",
        ),
        ({"messages": [{"role": "user"}]}, "content of turn 1 is not a string (got NoneType)"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "content of turn 1 has a non-text part ('image_url')",
        ),
        (
            {"id": 1.5, "messages": USER_ASSISTANT},
            "'id' must be a string or an integer (got float)",
        ),
        (
            {"id": True, "messages": USER_ASSISTANT},
            "'id' must be a string or an integer (got bool)",
        ),
        ({"id": "", "messages": USER_ASSISTANT}, "'id' is empty"),
    ],
)
def test_bad_line_reasons(tmp_path: Path, line: Any, reason: str) -> None:
    assert _one_bad(tmp_path, line).startswith(reason)


def test_invalid_utf8_reports_byte_offset(tmp_path: Path) -> None:
    line = b'{"messages": [{"role": "user", "content": "caf\xe9"}]}'
    offset = line.index(b"\xe9")
    assert _one_bad(tmp_path, line) == f"invalid UTF-8 at byte {offset}"


def test_invalid_json_message_is_kept(tmp_path: Path) -> None:
    assert _one_bad(tmp_path, '{"id": 1,}').startswith("invalid JSON: Expecting property name")


def test_deeply_nested_json_is_bad_not_a_crash(tmp_path: Path) -> None:
    assert _one_bad(tmp_path, "[" * 200_000 + "]" * 200_000).startswith("invalid JSON")


def test_oversized_line_is_skipped_and_the_rest_is_read(tmp_path: Path) -> None:
    size = 20 * 1024 * 1024
    path = tmp_path / "ds.jsonl"
    with path.open("wb") as fh:
        fh.write(json.dumps({"id": "before", "messages": USER_ASSISTANT}).encode() + b"\n")
        huge = b'{"id": "huge", "messages": "' + b"x" * size + b'"}'
        fh.write(huge + b"\n")
        fh.write(json.dumps({"id": "after", "messages": USER_ASSISTANT}).encode() + b"\n")
    records, report = _read(path)
    assert [r.sample_id for r in records] == ["before", "after"]
    assert report.problems == [f"{path}:2: line is {len(huge)} bytes, over the 16 MiB limit"]
    assert report.bad == 1 and report.read == 3


def test_line_at_the_limit_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader, "MAX_LINE_BYTES", 100)
    fits = json.dumps({"id": "f", "messages": [{"role": "user", "content": "x"}]})
    fits = fits[:-1] + " " * (100 - len(fits)) + "}"
    assert len(fits) == 100
    path = _write(tmp_path / "ds.jsonl", fits, fits.replace('"f"', '"g"') + " ")
    records, report = _read(path)
    assert [r.sample_id for r in records] == ["f"]
    assert report.problems == [f"{path}:2: line is 101 bytes, over the 16 MiB limit"]


def test_oversized_last_line_without_newline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reader, "MAX_LINE_BYTES", 10)
    path = tmp_path / "ds.jsonl"
    path.write_bytes(b"y" * 25)
    records, report = _read(path)
    assert records == []
    assert report.problems == [f"{path}:1: line is 25 bytes, over the 16 MiB limit"]


def test_one_bad_line_never_loses_the_rest(tmp_path: Path) -> None:
    lines = [{"id": i, "messages": USER_ASSISTANT} if i % 3 else "garbage" for i in range(30)]
    records, report = _read(_write(tmp_path / "ds.jsonl", *lines))
    assert len(records) == 20 and report.bad == 10 and report.read == 30


def test_problems_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader, "MAX_PROBLEMS", 5)
    records, report = _read(_write(tmp_path / "ds.jsonl", *["nope"] * 12))
    assert records == [] and report.bad == 12
    assert len(report.problems) == 5 and report.problems_omitted == 7


def test_empty_file_is_a_problem_not_an_error(tmp_path: Path) -> None:
    empty = tmp_path / "ds.jsonl"
    empty.write_bytes(b"")
    blank = _write(tmp_path / "blank.jsonl", "", "  ")
    records, report = _read(empty, blank)
    assert records == []
    assert report.problems == [f"{empty}: empty file", f"{blank}: empty file"]
    assert report.read == 0


def test_reading_streams(tmp_path: Path) -> None:
    path = _write(tmp_path / "ds.jsonl", *[{"id": i, "messages": USER_ASSISTANT} for i in range(5)])
    report = ReadReport("ds", [str(path)])
    stream = read_dataset("ds", [path], report)
    assert next(stream).sample_id == "0"
    assert report.read == 1  # nothing past the first line has been read yet


# ---- discover -------------------------------------------------------------------------


def test_discover_files_and_folders(tmp_path: Path) -> None:
    folder = tmp_path / "prompts"
    folder.mkdir()
    for name in ("b2.jsonl", "a1.jsonl", "notes.txt"):
        (folder / name).write_text("")
    (folder / "nested").mkdir()
    (folder / "nested" / "deep.jsonl").write_text("")
    other = tmp_path / "extra"
    other.mkdir()
    extra = other / "a1.jsonl"
    extra.write_text("")
    found = discover([folder, str(extra), folder / "a1.jsonl"])
    assert found == {"a1": [folder / "a1.jsonl", extra], "b2": [folder / "b2.jsonl"]}


def test_discover_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no prompt files given"):
        discover([])
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(InputError, match="no such file or folder") as err:
        discover([missing])
    assert str(missing) in str(err.value)
    (tmp_path / "data.json").write_text("{}")
    with pytest.raises(InputError, match=r"not a \.jsonl file"):
        discover([tmp_path / "data.json"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match=r"folder holds no \.jsonl files") as err:
        discover([empty])
    assert str(empty) in str(err.value)


@pytest.mark.parametrize(
    "stem", ["my data", "b@d", "back\\slash", "a:b", ".hidden", "x" * 101, "naïve"]
)
def test_discover_rejects_bad_dataset_names(tmp_path: Path, stem: str) -> None:
    path = tmp_path / f"{stem}.jsonl"
    path.write_text("")
    with pytest.raises(InputError, match="is not allowed") as err:
        discover([path])
    assert str(path) in str(err.value)


def test_discover_rejects_bad_names_inside_folders(tmp_path: Path) -> None:
    (tmp_path / "ok.jsonl").write_text("")
    (tmp_path / "bad name.jsonl").write_text("")
    with pytest.raises(InputError, match="'bad name'"):
        discover([tmp_path])
