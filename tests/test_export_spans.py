"""The model's own earlier answers placed in a conversation's last prompt ids
(ops/export_spans.py), on the project's two test tokenizers: the tokens masked 1 are
exactly an own answer's text as the template renders it, whatever the template drops,
strips or splits into bytes; a line's own assistant message, the user, tool and system
messages and the template's markers stay 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ops.export_spans import SpanError, mask_of, piece_spans, token_ends
from producer.template import BUNDLED_TOKENIZER, ChatTemplater

MESSAGES: list[dict[str, Any]] = [
    {"role": "assistant", "content": "Line-written greeting."},  # before any user: the line's
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Q1 🎉?"},
    {"role": "assistant", "content": "  Ünïcode 🎉 answer \n", "reasoning_content": "Thought 1."},
    {"role": "user", "content": "Q2?"},
    {"role": "assistant", "content": "Second answer.", "reasoning_content": "Thought 2."},
    {"role": "user", "content": "Q3?"},
]


def _masked(templater: ChatTemplater, messages: list[dict[str, Any]]) -> list[str]:
    text, spans = piece_spans(lambda m: templater.render(m, None), messages)
    ids = templater.tokenize([text])[0]
    mask = mask_of(token_ends(ids, templater.text_decoder(), text), spans)
    runs, current = [], []
    for token, bit in [*zip(ids, mask, strict=True), (0, 0)]:
        if bit:
            current.append(token)
        elif current:
            runs.append(templater.decode_all(current))
            current = []
    return runs


def test_a_template_that_drops_earlier_reasoning_masks_the_answers_as_rendered() -> None:
    templater = ChatTemplater(str(BUNDLED_TOKENIZER))
    assert "Thought" not in templater.render(MESSAGES)  # it drops earlier reasoning
    # Split into bytes (the emoji, the accents) and kept with its whitespace as written.
    assert _masked(templater, MESSAGES) == ["  Ünïcode 🎉 answer \n", "Second answer."]


def test_a_template_that_renders_earlier_reasoning_masks_it_too(remote_tokenizer: Path) -> None:
    templater = ChatTemplater(str(remote_tokenizer), trust_remote_code=True)
    assert _masked(templater, MESSAGES) == [
        "Thought 1.", "  Ünïcode 🎉 answer \n", "Thought 2.", "Second answer."]


def test_a_template_that_strips_an_answer_masks_what_it_kept() -> None:
    templater = ChatTemplater(str(BUNDLED_TOKENIZER))
    strip = lambda m: templater.render([{**x, "content": x["content"].strip()} for x in m])  # noqa: E731
    text, spans = piece_spans(strip, MESSAGES)
    assert [text[a:b] for a, b in spans] == ["Ünïcode 🎉 answer", "Second answer."]


def test_a_prompt_that_does_not_decode_back_is_refused() -> None:
    templater = ChatTemplater(str(BUNDLED_TOKENIZER))
    text = templater.render(MESSAGES)
    ids = templater.tokenize([text])[0]
    with pytest.raises(SpanError, match="do not decode back"):
        token_ends(ids[:-1], templater.text_decoder(), text)
    # A template whose text around the answers changes between two renderings.
    calls = iter(range(10))
    with pytest.raises(SpanError, match="differs"):
        piece_spans(lambda m: f"{next(calls)}{templater.render(m)}", MESSAGES)
