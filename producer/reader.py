"""Read prompt files: one JSONL file per dataset, streamed line by line.

Prompt files come from many places (chat exports, ShareGPT dumps, agent traces), so a bad
line is counted and reported as ``file:line: reason`` and never stops the rest of the
file. Each line's trailing assistant turns are dropped: that answer is what the target
model regenerates. Every field a chat template reads is kept as read (a line's ``tools``, an
assistant's ``tool_calls`` and ``reasoning_content``, a tool reply's ``tool_call_id`` and
``name``; producer/tools.py checks their shapes), so the prompt rendered is the one written.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from common.errors import InputError
from common.names import validate_dataset_name
from common.schema import prompts
from producer.tools import BadShape, Message, check_tool_replies, tool_calls, tools_list

MAX_LINE_BYTES = 16 * 1024 * 1024
MAX_ID_CHARS: int = prompts.c.sample_id.type.length  # type: ignore[attr-defined]
# A JSON escape of a UTF-16 surrogate: the only way a lone one, which is not text, gets in.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
MAX_PROBLEMS = 1000
_SKIP_CHUNK = 1024 * 1024

# ShareGPT ``from`` values and chat ``role`` values, mapped to chat-template roles.
_ROLES = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "human": "user",
    "gpt": "assistant",
}


# The fields other than role and content a turn keeps, by role (tool_calls: see
# producer/tools.py).
_EXTRA_FIELDS: dict[str, tuple[str, ...]] = {
    "assistant": ("reasoning_content",),
    "tool": ("tool_call_id", "name"),
}


@dataclass(frozen=True)
class PromptRecord:
    dataset: str
    sample_id: str
    messages: tuple[Message, ...]
    source: str  # "file:line"
    tools: list[dict[str, Any]] | None = None  # the line's function schemas, as read
    # The first turn of a conversation regenerated turn by turn (producer/turns.py): the
    # conversation's id, and its messages as read (``messages`` is turn 1's prompt).
    conversation: str | None = None
    original: tuple[Message, ...] | None = None


@dataclass
class ReadReport:
    dataset: str
    files: list[str] = field(default_factory=list)
    read: int = 0  # lines that held a prompt, good or bad; blank lines excluded
    bad: int = 0
    duplicates: int = 0
    problems: list[str] = field(default_factory=list)
    # Problems past MAX_PROBLEMS are only counted: a file of a million bad lines must
    # not hold a million messages in memory.
    problems_omitted: int = 0

    def problem(self, message: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(message)
        else:
            self.problems_omitted += 1


# One line cannot be used; the message is the reason shown after ``file:line:``.
_BadLine = BadShape


def discover(paths: Sequence[str | Path]) -> dict[str, list[Path]]:
    """Map dataset name to its files; files sharing a stem merge into one dataset."""
    if not paths:
        raise InputError("no prompt files given: pass .jsonl files or folders holding them")
    datasets: dict[str, list[Path]] = {}
    seen: set[Path] = set()
    for raw in paths:
        for file in _jsonl_files(Path(raw)):
            name = validate_dataset_name(file.stem, source=str(file))
            key = file.resolve()
            if key not in seen:  # a file named twice would make every line a duplicate
                seen.add(key)
                datasets.setdefault(name, []).append(file)
    return datasets


def _jsonl_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.glob("*.jsonl") if p.is_file())
        if not files:
            raise InputError(f"{path}: folder holds no .jsonl files")
        return files
    if not path.exists():
        raise InputError(f"{path}: no such file or folder")
    if path.suffix != ".jsonl":
        raise InputError(f"{path}: not a .jsonl file (prompt files are JSON Lines)")
    return [path]


def read_dataset(dataset: str, files: Sequence[Path], report: ReadReport) -> Iterator[PromptRecord]:
    """Yield the good prompts of ``files`` in order; count and report everything else."""
    first_seen: dict[str, str] = {}
    for file in files:
        if str(file) not in report.files:
            report.files.append(str(file))
        yield from _read_file(dataset, file, report, first_seen)


def _read_file(
    dataset: str, file: Path, report: ReadReport, first_seen: dict[str, str]
) -> Iterator[PromptRecord]:
    prompts = 0
    try:
        fh = file.open("rb")
    except OSError as exc:
        raise InputError(f"{file}: cannot open ({exc.strerror or exc})") from exc
    with fh:
        for lineno, line in _lines(fh):
            source = f"{file}:{lineno}"
            prompts += 1
            report.read += 1
            try:
                record = _record(dataset, line, source, lineno == 1)
            except _BadLine as exc:
                report.bad += 1
                report.problem(f"{source}: {exc}")
                continue
            first = first_seen.get(record.sample_id)
            if first is None:
                first_seen[record.sample_id] = source
            else:
                report.duplicates += 1
                report.problem(f"{source}: duplicate id {record.sample_id!r} (first at {first})")
                continue
            yield record
    if prompts == 0:
        report.problem(f"{file}: empty file")


def _lines(fh: BinaryIO) -> Iterator[tuple[int, bytes | int]]:
    """Yield (line number, raw line) for non-blank lines, or the byte size of an
    oversized line instead of its bytes, which are skipped without being held."""
    lineno = 0
    while line := fh.readline(MAX_LINE_BYTES + 1):
        lineno += 1
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            yield lineno, len(line) + _skip_rest(fh)
        elif line.strip():
            yield lineno, line


def _skip_rest(fh: BinaryIO) -> int:
    skipped = 0
    while chunk := fh.readline(_SKIP_CHUNK):
        if chunk.endswith(b"\n"):
            return skipped + len(chunk) - 1
        skipped += len(chunk)
    return skipped


def _record(dataset: str, line: bytes | int, source: str, first_line: bool) -> PromptRecord:
    if isinstance(line, int):
        raise _BadLine(f"line is {line} bytes, over the 16 MiB limit")
    obj = _parse(line, first_line)
    messages = _prompt_messages(obj)
    tools = tools_list(obj.get("tools"))
    return PromptRecord(dataset, _sample_id(obj, messages, tools), messages, source, tools)


def _parse(line: bytes, first_line: bool) -> dict[str, Any]:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _BadLine(f"invalid UTF-8 at byte {exc.start}") from None
    if first_line and text.startswith("\ufeff"):
        text = text[1:]  # a byte-order mark left by Windows editors
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _BadLine(f"invalid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise _BadLine(f"not a JSON object (got {type(obj).__name__})")
    if _SURROGATE_ESCAPE.search(text):
        _no_lone_surrogate(obj)
    return obj


def _no_lone_surrogate(obj: Any) -> None:
    """A surrogate escape not paired into one character (``"\\ud800"``) is no Unicode
    text: no tokenizer can encode it, and no database store it."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start:exc.end].encode("unicode_escape").decode()
        raise _BadLine(f"a string holds a lone UTF-16 surrogate ({bad}), which is not "
                       "text") from None


def _prompt_messages(obj: dict[str, Any]) -> tuple[Message, ...]:
    turns = obj.get("messages") if "messages" in obj else obj.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise _BadLine("no 'messages' or 'conversations' list, or it is empty")
    messages = [_message(turn, n) for n, turn in enumerate(turns, start=1)]
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not any(m["role"] == "user" for m in messages):
        raise _BadLine("no user turn")
    check_tool_replies(messages)
    return tuple(messages)


def _message(turn: Any, n: int) -> Message:
    if not isinstance(turn, dict):
        raise _BadLine(f"turn {n} is not an object")
    raw_role = turn["role"] if "role" in turn else turn.get("from")
    role = _ROLES.get(raw_role) if isinstance(raw_role, str) else None
    if role is None:
        raise _BadLine(f"unknown role {raw_role!r} in turn {n}")
    key = "content" if "content" in turn else "value"
    calls = turn.get("tool_calls")
    if calls is not None and role != "assistant":
        raise _BadLine(f"turn {n} is a {role} turn with tool_calls (only assistant turns "
                       "call tools)")
    message: Message = {"role": role}
    if calls and turn.get(key) is None:
        if key in turn:  # a tool-calling turn's null content is kept as read
            message["content"] = None
    else:
        message["content"] = _text(turn.get(key), n)
    if calls is not None:
        message["tool_calls"] = tool_calls(calls, n)
    _extra_fields(turn, role, n, message)
    return message


def _extra_fields(turn: dict[str, Any], role: str, n: int, message: Message) -> None:
    """The other fields chat templates read, kept as read: an assistant's reasoning, and
    a tool reply's call id and function name."""
    for name in _EXTRA_FIELDS.get(role, ()):
        value = turn.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise _BadLine(f"{name} of turn {n} is not a string (got {type(value).__name__})")
        message[name] = value


def _text(content: Any, n: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # OpenAI-style parts; joined with newlines as vLLM and SGLang do for text parts.
        return "\n".join(_text_part(part, n) for part in content)
    raise _BadLine(f"content of turn {n} is not a string (got {type(content).__name__})")


def _text_part(part: Any, n: int) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return str(part["text"])
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise _BadLine(f"content of turn {n} has a non-text part ({kind!r})")


def _sample_id(
    obj: dict[str, Any], messages: tuple[Message, ...], tools: list[dict[str, Any]] | None
) -> str:
    raw = obj.get("id")
    if raw is None:
        return message_hash(messages, tools)
    if isinstance(raw, bool) or not isinstance(raw, str | int):
        raise _BadLine(f"'id' must be a string or an integer (got {type(raw).__name__})")
    sample_id = str(raw)
    if not sample_id:
        raise _BadLine("'id' is empty")
    if "\x00" in sample_id:
        raise _BadLine("'id' holds a NUL character (\\u0000), which no database key can hold")
    if len(sample_id) > MAX_ID_CHARS:
        raise _BadLine(f"'id' is {len(sample_id)} characters long, over the limit of "
                       f"{MAX_ID_CHARS}")
    return sample_id


def message_hash(
    messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None
) -> str:
    """Stable id of a line without one: the same prompt always gets the same id, so a
    re-run resumes it and a repeated prompt counts as a duplicate. A line's tools are part
    of its prompt; a line without tools hashes its messages alone, as it always has."""
    content: Any = list(messages) if tools is None else {"messages": list(messages),
                                                         "tools": list(tools)}
    canonical = json.dumps(content, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "h" + hashlib.sha256(canonical.encode()).hexdigest()[:16]
