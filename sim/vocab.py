"""Vocabularies the simulator draws output ids from.

`PlainVocab` needs nothing and is very cheap (ids in [10, 32000), EOS 2, `</think>` 3,
text "t<id> ... </think> t<id> ..."): it models a reasoning model like the tokenizer mode
does, so a reasoning export can split its outputs whatever tokenizer the prompts used.
`TokenizerVocab` uses a real `tokenizers` file so that clients which decode, count or parse
reasoning see realistic ids: only ordinary (non-added, printable) tokens are drawn, EOS and
`</think>` come from the tokenizer itself.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from pathlib import Path
from typing import Any

from sim.toolcalls import CALLS_OPEN, TOOLS_OPEN, call_block, planned_calls

PLAIN_EOS_ID = 2
PLAIN_THINK_ID = 3
PLAIN_THINK_TEXT = "</think>"
PLAIN_NUL_ID = 4  # decodes to the byte 0, as a byte-level vocabulary's token for it does
PLAIN_LOW, PLAIN_HIGH = 10, 32000
_EOS_FALLBACKS = ("<|im_end|>", "<|endoftext|>", "</s>", "<eos>")


def _stream_words(seed: bytes, n: int, typecode: str) -> array[int]:
    """n unsigned words from SHAKE-128(seed); prefix-stable across n."""
    words: array[int] = array(typecode)
    words.frombytes(hashlib.shake_128(seed).digest(n * words.itemsize))
    if sys.byteorder == "big":  # keep outputs identical on every machine
        words.byteswap()
    return words


class PlainVocab:
    """Synthetic vocabulary: no tokenizer needed, decoding is a string join."""

    eos_id: int = PLAIN_EOS_ID
    think_id: int | None = PLAIN_THINK_ID
    # No template, so no prompt opens a block: every output reasons (see OutputModel).
    think_open_id: int | None = None
    nul_id: int | None = PLAIN_NUL_ID

    def call_ids(self, input_ids: list[int], seed: bytes) -> list[int]:
        """No tool calls: the plain vocabulary has no format for them."""
        return []

    def content_ids(self, seed: bytes, n: int) -> list[int]:
        """n ids in [PLAIN_LOW, PLAIN_HIGH)."""
        span = PLAIN_HIGH - PLAIN_LOW
        return [PLAIN_LOW + w % span for w in _stream_words(seed, n, "H")]

    def decode(self, ids: list[int]) -> str:
        """Space-joined "t<id>" words and `</think>`; EOS is special and skipped, like
        SGLang's detokenizer (`</think>` is not special in reasoning tokenizers: it stays)."""
        return " ".join(_plain_word(i) for i in ids if i != PLAIN_EOS_ID)


def _plain_word(token_id: int) -> str:
    if token_id == PLAIN_THINK_ID:
        return PLAIN_THINK_TEXT
    if token_id == PLAIN_NUL_ID:
        return "\x00"
    return f"t{token_id}"


class _CodeTokenizer:
    """The `tokenizers.Tokenizer` methods TokenizerVocab uses, over a tokenizer whose class
    is Python code beside its files (no tokenizer.json), loaded with transformers."""

    def __init__(self, directory: str) -> None:
        from common.tokenizer_files import load_tokenizer

        self.hf: Any = load_tokenizer(directory, trust_remote_code=True)
        self.vocab: dict[str, int] = self.hf.get_vocab()

    def token_to_id(self, token: str) -> int | None:
        return self.vocab.get(token)

    def get_added_tokens_decoder(self) -> dict[int, Any]:
        return dict(self.hf.added_tokens_decoder)

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return len(self.hf)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=skip_special_tokens))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        return [self.decode(ids) for ids in batch]


def _open_tokenizer(root: Path, trust_remote_code: bool) -> Any:
    path = root / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer  # imported lazily: only this mode needs it

        return Tokenizer.from_file(str(path))
    from common.tokenizer_files import code_class

    code = code_class(root)
    if code is None:
        raise ValueError(f"{root}: no tokenizer.json")
    if not trust_remote_code:
        raise ValueError(f"{root}: its tokenizer is Python code ({code}), and loading it runs "
                         "that code: pass --trust-remote-code if you trust it")
    return _CodeTokenizer(str(root))


class TokenizerVocab:
    """A real tokenizer directory (tokenizer.json + tokenizer_config.json), or with
    ``trust_remote_code`` one whose class is Python code beside its files."""

    def __init__(self, directory: str, trust_remote_code: bool = False) -> None:
        root = Path(directory)
        self.tokenizer = _open_tokenizer(root, trust_remote_code)
        self.eos_id = self._find_eos(root)
        self.think_id: int | None = self.tokenizer.token_to_id("</think>")
        self.think_open_id: int | None = self.tokenizer.token_to_id("<think>")
        # Prompts offering tools in the remote-code test tokenizer's format can be answered
        # with tool calls (sim/toolcalls.py); other tokenizers never call tools.
        self.tools_id: int | None = (self.tokenizer.token_to_id(TOOLS_OPEN)
                                     if self.tokenizer.token_to_id(CALLS_OPEN) is not None
                                     else None)
        self.nul_id: int | None = None
        self.pool = self._ordinary_ids()
        if not self.pool:
            raise ValueError(f"{directory}: tokenizer has no ordinary tokens to draw from")

    def _find_eos(self, root: Path) -> int:
        """EOS id named by tokenizer_config.json, else a well-known end token."""
        names: list[str] = []
        config_path = root / "tokenizer_config.json"
        if config_path.exists():
            eos = json.loads(config_path.read_text(encoding="utf-8")).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                names.append(eos)
        for name in (*names, *_EOS_FALLBACKS):
            token_id = self.tokenizer.token_to_id(name)
            if token_id is not None:
                return int(token_id)
        raise ValueError(f"{root}: cannot find an EOS token")

    def _ordinary_ids(self) -> array[int]:
        """Non-added ids whose own text is printable, so decoded output reads cleanly."""
        added = set(self.tokenizer.get_added_tokens_decoder())
        size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        candidates = [i for i in range(size) if i not in added]
        texts = self.tokenizer.decode_batch([[i] for i in candidates])
        self.nul_id = next((i for i, text in zip(candidates, texts, strict=True)
                            if text == "\x00"), None)
        keep = [
            i
            for i, text in zip(candidates, texts, strict=True)
            if text.strip() and "\ufffd" not in text and text.isprintable()
        ]
        return array("l", keep)

    def content_ids(self, seed: bytes, n: int) -> list[int]:
        """n ids drawn uniformly from the ordinary pool."""
        pool, size = self.pool, len(self.pool)
        return [pool[w % size] for w in _stream_words(seed, n, "I")]

    def decode(self, ids: list[int]) -> str:
        """Tokenizer decode with special tokens skipped (`</think>` is not special: it stays)."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def call_ids(self, input_ids: list[int], seed: bytes) -> list[int]:
        """The ids of the tool calls a prompt asks for (sim/toolcalls.py), none if it offers
        no tools in a format this tokenizer has."""
        if self.tools_id is None or self.tools_id not in input_ids:
            return []
        names = planned_calls(str(self.tokenizer.decode(input_ids, skip_special_tokens=False)))
        if not names:
            return []
        encoded = self.tokenizer.encode(call_block(names, seed), add_special_tokens=False)
        return list(getattr(encoded, "ids", encoded))


def load_vocab(directory: str, trust_remote_code: bool = False) -> TokenizerVocab:
    """Load a tokenizer directory, failing loudly (a bad path is a config error)."""
    return TokenizerVocab(directory, trust_remote_code)
