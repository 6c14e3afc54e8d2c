"""The tokenizer class of datagen's remote-code test tokenizer (ops/build_remote_tokenizer.py).

It is never imported by datagen: the build copies this file beside the tokenizer's files, and
transformers loads it from there, as it loads the class a model such as Kimi K2 ships
beside its ``tiktoken.model``, only with ``trust_remote_code=True``. It is a slow
(pure Python) tokenizer over ``tiktoken`` ranks; token strings spell a token's bytes one
printable character per byte, so every string round-trips.
"""

from __future__ import annotations

import os
from typing import Any

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}
# Words with their leading space, numbers by up to three digits, runs of punctuation,
# whitespace: the pieces no token crosses.
PATTERN = r" ?\p{L}+| ?\p{N}{1,3}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def byte_names() -> dict[int, str]:
    """One printable character for each byte: printable Latin-1 bytes stand for
    themselves, the others take the characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    names = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in names:
            names[b] = chr(0x100 + extra)
            extra += 1
    return names


class DatagenTikTokenizer(PreTrainedTokenizer):
    """tiktoken ranks; special tokens are the config's added tokens, after the ranks."""

    vocab_files_names = VOCAB_FILES_NAMES

    def __init__(self, vocab_file: str, **kwargs: Any) -> None:
        ranks = load_tiktoken_bpe(vocab_file)
        self.encoding = tiktoken.Encoding(
            name=os.path.basename(os.path.dirname(os.path.abspath(vocab_file))),
            pat_str=PATTERN, mergeable_ranks=ranks, special_tokens={})
        self._to_name = byte_names()
        self._to_byte = {name: b for b, name in self._to_name.items()}
        self._ids = {self._name(token): rank for token, rank in ranks.items()}
        self._names = {rank: name for name, rank in self._ids.items()}
        super().__init__(**kwargs)

    def _name(self, token: bytes) -> str:
        return "".join(self._to_name[b] for b in token)

    @property
    def vocab_size(self) -> int:
        return len(self._ids)

    def get_vocab(self) -> dict[str, int]:
        return {**self._ids, **self.added_tokens_encoder}

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [self._names[i] for i in self.encoding.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self._ids[token]

    def _convert_id_to_token(self, index: int) -> str:
        return self._names[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        # Added tokens are printable ASCII, which spells itself.
        data = bytes(self._to_byte[c] for c in "".join(tokens))
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(  # type: ignore[override]
        self, conversation: Any, tools: list[dict[str, Any]] | None = None,
        tokenize: bool = False, add_generation_prompt: bool = True, **kwargs: Any,
    ) -> Any:
        # Tool schemas are rendered with their keys sorted, whatever order a line gives
        # them in; other defaults than the base class's, as such classes have.
        return super().apply_chat_template(
            conversation, tools=_sorted_keys(tools), tokenize=tokenize,
            add_generation_prompt=add_generation_prompt, **kwargs)

    def save_vocabulary(self, save_directory: str,
                        filename_prefix: str | None = None) -> tuple[str, ...]:
        raise NotImplementedError("the test tokenizer is built by ops/build_remote_tokenizer.py")


def _sorted_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted_keys(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(v) for v in value]
    return value
