"""The producer's prompt ids, rendered on one thread and tokenized in one Rust batch call on
another, are exactly what transformers' ``apply_chat_template`` gives."""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from producer.template import BUNDLED_TOKENIZER, ChatTemplater

_WORDS = ["alpha", "Beta", "über", "naïve", "数据", "🙂", "x=1;", "  ", "\n", "\t", "'s",
          "don't", "1234567", "<think>", "</think>", "<|im_end|>", "<|im_start|>user", "--",
          "{{ messages }}", "{% if %}", "\\n", '"quoted"', "end."]


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(_WORDS) + rng.choice(["", " ", " ", "\n"])
                   for _ in range(rng.randint(0, 60)))


def _conversation(rng: random.Random) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": _text(rng)}] if rng.random() < 0.3 else []
    for turn in range(rng.randint(1, 3)):
        if turn:
            messages.append({"role": rng.choice(["assistant", "tool"]), "content": _text(rng)})
        messages.append({"role": "user", "content": _text(rng)})
    return messages


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(BUNDLED_TOKENIZER), local_files_only=True)


def _hf_ids(tok: Any, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("kwargs", [{}, {"thinking": False}])
def test_render_then_tokenize_on_another_thread_equals_transformers(
    hf_tokenizer: Any, kwargs: dict[str, Any]
) -> None:
    templater = ChatTemplater(str(BUNDLED_TOKENIZER), kwargs)
    assert templater._render != templater._public_render  # the compiled renderer is tested
    rng = random.Random(11)
    conversations = [_conversation(rng) for _ in range(300)]
    texts = [templater.render(m) for m in conversations]
    assert texts == [hf_tokenizer.apply_chat_template(m, tokenize=False,
                                                      add_generation_prompt=True, **kwargs)
                     for m in conversations]
    with ThreadPoolExecutor(1) as pool:
        ids = pool.submit(templater.tokenize, texts).result()
    assert ids == [_hf_ids(hf_tokenizer, m, **kwargs) for m in conversations]
    assert templater.encode_batch(conversations) == ids
    assert templater.tokenize([]) == []


def test_one_rust_batch_call_per_chunk_with_the_library_pool_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import producer.enqueue  # noqa: F401  (the producer's imports must leave the pool on)

    assert os.environ.get("TOKENIZERS_PARALLELISM", "true").lower() not in ("false", "0", "")
    templater = ChatTemplater(str(BUNDLED_TOKENIZER))
    backend = templater._backend
    calls: list[int] = []
    real = backend.encode_batch_fast

    class Counting:
        def encode_batch_fast(self, texts: list[str], **kw: Any) -> Any:
            calls.append(len(texts))
            return real(texts, **kw)

        encode_batch = encode_batch_fast

    monkeypatch.setattr(templater, "_backend", Counting())
    texts = [templater.render([{"role": "user", "content": f"q{i}"}]) for i in range(100)]
    assert len(templater.tokenize(texts)) == 100
    assert calls == [100]


def test_a_template_error_on_the_fast_path_still_raises() -> None:
    templater = ChatTemplater(str(BUNDLED_TOKENIZER))
    with pytest.raises(Exception, match="unsupported role"):
        templater.render([{"role": "narrator", "content": "x"}])
