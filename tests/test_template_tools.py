"""Prompts with tools and tool calls get exactly the ids of ``apply_chat_template(messages,
tools=..., tokenize=True, add_generation_prompt=True)``, on the bundled fast tokenizer (with
a template that uses tools) and on a tokenizer whose class is Python code; that tokenizer
loads only with trust_remote_code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from common.errors import ConfigError
from common.tokenizer_files import code_class, load_tokenizer
from producer.template import BUNDLED_TOKENIZER, ChatTemplater
from sim.vocab import TokenizerVocab
from workers.context import _load_decoder

# A test-only ChatML template that renders tools, tool calls (arguments as given), tool
# replies and earlier reasoning; the bundled one ignores tools.
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{%- if message.content is string %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{%- if call.function.arguments is string %}{{- call.function.arguments }}"
    "{%- else %}{{- call.function.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city, today.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "description": "Ville, 都市"}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}


def _calling(*calls: tuple[str, str, Any], **fields: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": None, **fields, "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
        for cid, name, args in calls]}


CASES: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ([{"role": "user", "content": "Weather in Paris?"}], [WEATHER]),
    ([{"role": "system", "content": "Use tools."}, {"role": "user", "content": "héllo 🙂"}],
     [WEATHER, SEARCH]),
    ([{"role": "user", "content": "Weather in Paris?"},
      _calling(("c1", "get_weather", '{"city": "Paris"}'), reasoning_content="Look it up."),
      {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny, 21°C"}],
     [WEATHER]),
    ([{"role": "user", "content": "Paris and Rome"},
      _calling(("a", "get_weather", {"city": "Paris"}), ("b", "get_weather", {"city": "Rome"})),
      {"role": "tool", "tool_call_id": "a", "content": "sun"},
      {"role": "tool", "tool_call_id": "b", "content": "rain <|im_end|> <think>"},
      {"role": "assistant", "content": "Sun, then rain.", "reasoning_content": "Both known."},
      {"role": "user", "content": "Thanks; search for umbrellas."}],
     [WEATHER, SEARCH]),
    ([{"role": "user", "content": "No tools here."}], None),
]


def _hf_ids(tok: Any, messages: list[dict[str, Any]], tools: Any) -> list[int]:
    out = tok.apply_chat_template(messages, tools=tools, tokenize=True,
                                  add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def tools_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled tokenizer with TOOLS_TEMPLATE as its chat template."""
    folder = tmp_path_factory.mktemp("tok") / "tools"
    shutil.copytree(BUNDLED_TOKENIZER, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _assert_ids_equal_transformers(templater: ChatTemplater, hf: Any) -> None:
    conversations = [messages for messages, _ in CASES]
    tools = [t for _, t in CASES]
    expected = [_hf_ids(hf, messages, t) for messages, t in CASES]
    assert templater.encode_batch(conversations, tools) == expected
    texts = [templater.render(messages, t) for messages, t in CASES]
    assert templater.tokenize(texts) == expected
    assert texts == [hf.apply_chat_template(m, tools=t, tokenize=False,
                                            add_generation_prompt=True) for m, t in CASES]


def test_fast_tokenizer_with_tools_equals_transformers(tools_tokenizer: Path) -> None:
    templater = ChatTemplater(str(tools_tokenizer))
    # Both shortcuts pass the probes with tools and tool calls, so they are what is tested.
    assert templater._render != templater._public_render
    assert templater._backend is not None
    _assert_ids_equal_transformers(templater, load_tokenizer(str(tools_tokenizer)))
    text = templater.render(*CASES[2])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "# Tools\n" + json.dumps(WEATHER, ensure_ascii=False) in text


def test_a_template_without_tools_still_builds_and_ignores_them() -> None:
    templater = ChatTemplater(str(BUNDLED_TOKENIZER))  # renders no tool call: those probes skip
    assert templater._render != templater._public_render
    plain = [{"role": "user", "content": "Hi"}]
    assert templater.render(plain, [WEATHER]) == templater.render(plain)


def test_code_tokenizer_is_refused_without_trust(remote_tokenizer: Path) -> None:
    assert code_class(remote_tokenizer) == "tokenization_datagen.DatagenTikTokenizer"
    assert not (remote_tokenizer / "tokenizer.json").exists()
    with pytest.raises(ConfigError) as refused:
        ChatTemplater(str(remote_tokenizer))
    message = str(refused.value)
    assert "--trust-remote-code" in message and "runs that code" in message
    assert "tokenization_datagen.DatagenTikTokenizer" in message


def test_code_tokenizer_with_trust_equals_transformers(remote_tokenizer: Path) -> None:
    templater = ChatTemplater(str(remote_tokenizer), trust_remote_code=True)
    hf = load_tokenizer(str(remote_tokenizer), trust_remote_code=True)
    assert type(hf).__name__ == "DatagenTikTokenizer"
    # Its class rewrites tools before rendering (it sorts their keys), which the compiled
    # renderer cannot know: the probe with tools shows it, and the public path is used.
    assert templater._render == templater._public_render
    assert templater._backend is None  # a Python tokenizer: no Rust batch call
    _assert_ids_equal_transformers(templater, hf)
    assert templater.reasoning_open == "<think>"
    assert templater.eos_token_id == hf.convert_tokens_to_ids("<|end|>")
    assert templater.vocab_size == len(hf)


def test_the_build_is_deterministic(remote_tokenizer: Path, tmp_path: Path) -> None:
    from ops.build_remote_tokenizer import write

    again = write(tmp_path / "again")
    assert [p.read_bytes() for p in again] == [
        (remote_tokenizer / p.name).read_bytes() for p in again]
    assert sum(p.stat().st_size for p in again) < 64 * 1024


def test_simulator_and_worker_decoder_need_trust_for_code(remote_tokenizer: Path) -> None:
    with pytest.raises(ValueError, match="--trust-remote-code"):
        TokenizerVocab(str(remote_tokenizer))
    vocab = TokenizerVocab(str(remote_tokenizer), trust_remote_code=True)
    hf = load_tokenizer(str(remote_tokenizer), trust_remote_code=True)
    assert vocab.eos_id == hf.convert_tokens_to_ids("<|end|>")
    assert vocab.think_id == hf.convert_tokens_to_ids("</think>")
    ids = vocab.content_ids(b"seed", 20)
    assert vocab.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert _load_decoder(str(remote_tokenizer), trust_remote_code=False) is None
    decode = _load_decoder(str(remote_tokenizer), trust_remote_code=True)
    assert decode is not None and decode(ids) == vocab.decode(ids)


def test_the_setting_and_the_flag() -> None:
    from common.settings import Settings
    from ops.cli import build_parser

    assert Settings().trust_remote_code is False
    assert Settings.from_env({"DATAGEN_TRUST_REMOTE_CODE": "1"}).trust_remote_code is True
    trusted = Settings(trust_remote_code=True)
    assert Settings.from_env(trusted.to_env()) == trusted  # a child process gets it too
    parser = build_parser()
    assert parser.parse_args(["enqueue", "x.jsonl", "--trust-remote-code"]).trust_remote_code
    assert parser.parse_args(["enqueue", "x.jsonl"]).trust_remote_code is None


def test_specforge_rows_keep_every_prompt_field_and_the_tools() -> None:
    from datetime import UTC, datetime

    from common.budget import Budget
    from common.store import DatasetRow
    from ops.export_record import LeftOut
    from ops.export_rows import ExportRow
    from ops.export_specforge import SpecForgeBuilder, _prompt_turn

    ds = DatasetRow("d", Budget(), {}, 4096, "/no/such/tokenizer", "h", reasoning_open=None)
    builder = SpecForgeBuilder(ds)

    def row(messages: list[dict[str, Any]], tools: Any) -> ExportRow:
        return ExportRow(1, "d", "s1", "rid", 2, 1, 0, 0, "stop", None, [7], "Sunny.", None,
                         "srv", "m", datetime.now(UTC), messages, [1, 2], 16, tools)

    earlier = [{"role": "user", "content": "q"},
               {"role": "assistant", "content": "a", "reasoning_content": "r"},
               {"role": "user", "content": "q2"}]
    record = builder.build(row(earlier, [WEATHER]))
    assert isinstance(record, LeftOut)  # non-reasoning data with an earlier reasoning
    plain = builder.build(row(earlier[:1], [WEATHER]))
    assert isinstance(plain, dict) and plain["tools"] == [WEATHER]
    assert plain["conversations"] == [{"role": "user", "content": "q"}, {
        "role": "assistant", "content": "Sunny.", "reasoning_content": ""}]
    assert "tools" not in builder.build(row(earlier[:1], None))
    calls = CASES[2][0]
    left = builder.build(row(calls, [WEATHER]))
    assert isinstance(left, LeftOut) and left.reason == "prompt_breaks_checker"
    assert _prompt_turn(calls[1]) == {"role": "assistant", "content": None,
                                      "reasoning_content": "Look it up.",
                                      "tool_calls": calls[1]["tool_calls"]}
    assert _prompt_turn(calls[2]) == calls[2]
