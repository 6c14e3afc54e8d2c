"""The chat templater: ids identical to transformers', reasoning detection, load errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from common.errors import ConfigError
from ops import build_tokenizer
from producer.template import BUNDLED_TOKENIZER, ChatTemplater

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hello"}],
    [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "Write a Python function that sums a list of integers."},
    ],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? Explain step by step."},
    ],
    [
        {"role": "user", "content": "Call the tool."},
        {"role": "assistant", "content": '{"name": "search", "arguments": {"q": "x"}}'},
        {"role": "tool", "content": "result: 42"},
    ],
    [{"role": "user", "content": "héllo wörld 你好 🙂\n\tdef f(x):\n    return x ** 2\n"}],
    # Text that looks like markers must tokenize exactly as transformers does it.
    [{"role": "user", "content": "a <think> b </think> c <|im_end|> d"}],
    [{"role": "user", "content": "  leading and trailing spaces  \n\n"}],
]


@pytest.fixture(scope="module")
def templater() -> ChatTemplater:
    return ChatTemplater(str(BUNDLED_TOKENIZER))


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(BUNDLED_TOKENIZER), local_files_only=True)


def _hf_ids(tok: Any, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    ids = (
        out["input_ids"] if hasattr(out, "keys") else out
    )  # transformers 5 returns a BatchEncoding
    return list(ids)


def _copy_tokenizer(dst: Path, chat_template: str | None) -> Path:
    shutil.copytree(BUNDLED_TOKENIZER, dst)
    config_path = dst / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if chat_template is None:
        config.pop("chat_template")
    else:
        config["chat_template"] = chat_template
    config_path.write_text(json.dumps(config))
    return dst


def test_bundled_tokenizer_assets(hf_tokenizer: Any) -> None:
    total = sum(p.stat().st_size for p in BUNDLED_TOKENIZER.iterdir())
    assert total < 500_000
    ids = hf_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [0, 1, 2]
    assert hf_tokenizer.eos_token == "<|im_end|>" and hf_tokenizer.pad_token == "<|endoftext|>"
    assert hf_tokenizer.bos_token is None
    assert hf_tokenizer.model_max_length == 32768
    assert 3900 <= len(hf_tokenizer) <= 4100
    # <think> is one token and survives skip_special_tokens, as with Qwen3.
    think = hf_tokenizer.encode("<think>x</think>", add_special_tokens=False)
    assert len(think) == 3
    assert hf_tokenizer.decode(think, skip_special_tokens=True) == "<think>x</think>"


def test_build_is_deterministic_and_matches_committed_assets(tmp_path: Path) -> None:
    first = build_tokenizer.write(tmp_path / "a")
    second = build_tokenizer.write(tmp_path / "b")
    for a, b in zip(first, second, strict=True):
        assert a.read_bytes() == b.read_bytes()
        assert a.read_bytes() == (BUNDLED_TOKENIZER / a.name).read_bytes(), a.name


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_ids_equal_apply_chat_template(
    templater: ChatTemplater, hf_tokenizer: Any, messages: list[dict[str, str]]
) -> None:
    [ids] = templater.encode_batch([messages])
    assert ids == _hf_ids(hf_tokenizer, messages)
    expected_text = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert templater.render(messages) == expected_text


def test_batch_keeps_order_and_uses_compiled_template(
    templater: ChatTemplater, hf_tokenizer: Any
) -> None:
    batch = templater.encode_batch(CONVERSATIONS * 3)
    assert batch == [_hf_ids(hf_tokenizer, m) for m in CONVERSATIONS * 3]
    assert templater.encode_batch([]) == []
    # The fast renderer, not the per-call fallback, is what the equality above covered.
    assert templater._render != templater._public_render


def test_reasoning_opener_detected(templater: ChatTemplater) -> None:
    assert (templater.reasoning_open, templater.reasoning_close) == ("<think>", "</think>")
    assert templater.render(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n<think>\n")
    [ids] = templater.encode_batch([CONVERSATIONS[0]])
    assert templater.decode(ids[-2:]) == "<think>\n"
    assert templater.eos_token_id == 2
    assert templater.vocab_size == len(templater._tok)


def test_thinking_false_changes_prompt_and_hash(
    templater: ChatTemplater, hf_tokenizer: Any
) -> None:
    off = ChatTemplater(str(BUNDLED_TOKENIZER), {"thinking": False})
    text = off.render(CONVERSATIONS[1])
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off.reasoning_open is None and off.reasoning_close is None
    assert off.template_hash != templater.template_hash
    [ids] = off.encode_batch([CONVERSATIONS[1]])
    assert ids == _hf_ids(hf_tokenizer, CONVERSATIONS[1], thinking=False)
    # thinking=True renders like the default but is a different setting, so a different hash.
    on = ChatTemplater(str(BUNDLED_TOKENIZER), {"thinking": True})
    assert on.render(CONVERSATIONS[1]) == templater.render(CONVERSATIONS[1])
    assert on.template_hash not in (templater.template_hash, off.template_hash)


def test_template_hash_is_stable(templater: ChatTemplater) -> None:
    again = ChatTemplater(str(BUNDLED_TOKENIZER), {})
    assert again.template_hash == templater.template_hash
    assert len(templater.template_hash) == 64
    a = ChatTemplater(str(BUNDLED_TOKENIZER), {"thinking": False, "x": 1})
    b = ChatTemplater(str(BUNDLED_TOKENIZER), {"x": 1, "thinking": False})
    assert a.template_hash == b.template_hash


def test_non_json_kwargs_rejected() -> None:
    with pytest.raises(ConfigError, match="JSON"):
        ChatTemplater(str(BUNDLED_TOKENIZER), {"when": object()})


def test_split_reasoning(templater: ChatTemplater) -> None:
    assert templater.split_reasoning("Let me add.\n</think>\n\nThe answer is 4.") == (
        "Let me add.",
        "The answer is 4.",
    )
    # Cut off while reasoning: everything is reasoning, no answer yet.
    assert templater.split_reasoning("still thinking about") == ("still thinking about", "")
    # Only the first close marker splits; a later one belongs to the answer.
    assert templater.split_reasoning("r</think>a</think>b") == ("r", "a</think>b")
    off = ChatTemplater(str(BUNDLED_TOKENIZER), {"thinking": False})
    assert off.split_reasoning("plain answer</think>") == ("", "plain answer</think>")


def test_decode_skips_special_keeps_think(templater: ChatTemplater) -> None:
    [ids] = templater.encode_batch([CONVERSATIONS[0]])
    assert templater.decode(ids) == "user\nHello\nassistant\n<think>\n"
    assert templater.decode([]) == ""


def test_template_without_reasoning_opener(tmp_path: Path) -> None:
    plain = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    templater = ChatTemplater(str(_copy_tokenizer(tmp_path / "plain", plain)))
    assert templater.reasoning_open is None
    assert templater.split_reasoning("just text") == ("", "just text")
    assert templater.render(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")


def test_missing_tokenizer_path(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "tokenizer"
    with pytest.raises(ConfigError, match="not found") as err:
        ChatTemplater(str(missing))
    assert str(missing) in str(err.value)


def test_directory_without_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("nothing here")
    with pytest.raises(ConfigError, match="no loadable tokenizer files") as err:
        ChatTemplater(str(tmp_path))
    assert str(tmp_path) in str(err.value)


def test_tokenizer_without_chat_template(tmp_path: Path) -> None:
    folder = _copy_tokenizer(tmp_path / "nochat", None)
    with pytest.raises(ConfigError, match="has no chat template"):
        ChatTemplater(str(folder))
