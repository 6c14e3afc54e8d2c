"""Deterministic completions: the same prompt always yields the same output ids.

Why deterministic: tests and demos compare results across retries, workers and runs, so a
prompt's output must not depend on timing or on which simulator process answered it. All
randomness is derived from a blake2b digest of the prompt ids:

* the natural length L (tokens up to and including EOS) follows a lognormal spread whose
  mean is `mean_output_tokens` (at least 1 token);
* the ids come from SHAKE-128 seeded by the digest, which is prefix-stable: asking for
  more tokens never changes the earlier ones, so a larger max_new_tokens extends a
  capped output instead of replacing it.

The output looks like a reasoning model's: ordinary vocabulary ids, `</think>` about 60 %
into the output, answer ids, then EOS (no `</think>` when the generation prompt ends with
an empty closed block: a template with reasoning off, as Qwen3's `enable_thinking=False`
renders it); with a real tokenizer its own ids and text, else the plain vocabulary's
(sim/vocab.py). A prompt that asks for tool calls in the test tokenizer's format
(sim/toolcalls.py) gets them between its answer and EOS.
"""

from __future__ import annotations

import hashlib
import math
import random
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from sim.vocab import PlainVocab, load_vocab

_LOGNORMAL_SIGMA = 0.75
_THINK_FRACTION = 0.6
_TEXT_CACHE_SIZE = 4096
# A template's generation prompt ("<|im_start|>assistant\n<think>\n", or with reasoning
# off "...<think>\n\n</think>\n\n") is a few ids; the scan for its opener stops here.
_GENERATION_PROMPT_IDS = 32


class Vocab(Protocol):
    """What the output model needs from a vocabulary."""

    eos_id: int
    think_id: int | None
    #: The block's opener; None when the vocabulary has no template to open one with.
    think_open_id: int | None
    nul_id: int | None

    def content_ids(self, seed: bytes, n: int) -> list[int]:
        """n ordinary ids drawn deterministically (and prefix-stably) from seed."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of ids with special tokens skipped."""
        ...

    def call_ids(self, input_ids: list[int], seed: bytes) -> list[int]:
        """Ids of the tool calls the prompt asks for, placed just before EOS."""
        ...


def prompt_digest(input_ids: list[int]) -> bytes:
    """16-byte blake2b of the prompt ids (packed as int64, cheaper than JSON)."""
    return hashlib.blake2b(array("q", input_ids).tobytes(), digest_size=16).digest()


@dataclass(frozen=True)
class Completion:
    """The planned output of one request, already capped to its max_new_tokens."""

    ids: list[int]
    #: "stop" (ended with EOS) or "length" (cut by max_new_tokens).
    finish_type: str
    eos_id: int
    max_new_tokens: int
    #: Index of `</think>` inside the natural output, if the output has one.
    think_pos: int | None
    digest: bytes
    #: Whether EOS was ignored (changes where `</think>` sits, so it is part of cache keys).
    ignore_eos: bool = False

    def finish_reason(self) -> dict[str, object]:
        """SGLang's finish_reason dict for a completion that ran to its end."""
        if self.finish_type == "stop":
            return {"type": "stop", "matched": self.eos_id}
        return {"type": "length", "length": self.max_new_tokens}

    def reasoning_tokens(self, n: int) -> int:
        """Tokens of the first n that belong to the reasoning (through `</think>`)."""
        if self.think_pos is None:
            return 0
        return min(n, self.think_pos + 1)


class OutputModel:
    """Plans completions and decodes them, caching decoded text per prompt."""

    def __init__(self, mean_output_tokens: int, tokenizer_dir: str | None = None,
                 trust_remote_code: bool = False, nul_every: int = 0) -> None:
        self.mean_output_tokens = max(1, int(mean_output_tokens))
        self.nul_every = nul_every
        self.vocab: Vocab = (load_vocab(tokenizer_dir, trust_remote_code) if tokenizer_dir
                             else PlainVocab())
        self._mu = math.log(self.mean_output_tokens) - _LOGNORMAL_SIGMA**2 / 2
        self._texts: OrderedDict[tuple[bytes, bool, int], str] = OrderedDict()

    @property
    def eos_id(self) -> int:
        """Id that ends a natural completion."""
        return self.vocab.eos_id

    def natural_length(self, digest: bytes) -> int:
        """Output length (EOS included) the prompt would produce without a cap."""
        rng = random.Random(int.from_bytes(digest[:8], "little"))
        return max(1, round(rng.lognormvariate(self._mu, _LOGNORMAL_SIGMA)))

    def complete(self, input_ids: list[int], max_new_tokens: int, ignore_eos: bool) -> Completion:
        """Plan the output for a prompt under a max_new_tokens cap."""
        digest = prompt_digest(input_ids)
        calls = [] if ignore_eos else self.vocab.call_ids(input_ids, digest)
        answer = max_new_tokens + 1 if ignore_eos else self.natural_length(digest)
        natural = answer + len(calls)
        n = min(natural, max_new_tokens)
        ids = self.vocab.content_ids(digest, n)
        nul_id = self.vocab.nul_id
        if self.nul_every > 0 and nul_id is not None:
            ids[self.nul_every - 1 :: self.nul_every] = [nul_id] * len(
                range(self.nul_every - 1, n, self.nul_every))
        think_pos = (self._think_position(answer, ignore_eos)
                     if self._opens_reasoning(input_ids) else None)
        think_id = self.vocab.think_id
        if think_id is not None and think_pos is not None and think_pos < n:
            ids[think_pos] = think_id
        end = min(n, answer - 1 + len(calls))
        if end > answer - 1:  # after the answer, before EOS; max_new_tokens may cut them
            ids[answer - 1: end] = calls[: end - answer + 1]
        if n == natural:
            ids[-1] = self.vocab.eos_id
        finish = "length" if natural >= max_new_tokens else "stop"
        return Completion(
            ids, finish, self.vocab.eos_id, max_new_tokens, think_pos, digest, ignore_eos
        )

    def _opens_reasoning(self, input_ids: list[int]) -> bool:
        """Whether the model reasons: unless its generation prompt closed the block it
        opened (a template's reasoning off), as a reasoning model does whatever the prompt."""
        opener, closer = self.vocab.think_open_id, self.vocab.think_id
        if opener is None:
            return True
        for token in reversed(input_ids[-_GENERATION_PROMPT_IDS:]):
            if token == opener:
                return True
            if token == closer:
                return False
        return True

    def _think_position(self, natural: int, ignore_eos: bool) -> int | None:
        if self.vocab.think_id is None or natural < 3:
            return None
        if ignore_eos:
            natural = self.mean_output_tokens
        return max(1, int(_THINK_FRACTION * (natural - 1)))

    def text(self, completion: Completion, n: int) -> str:
        """Decoded text of the first n output ids (cached: streams ask repeatedly)."""
        if n <= 0:
            return ""
        key = (completion.digest, completion.ignore_eos, n)
        cached = self._texts.get(key)
        if cached is not None:
            self._texts.move_to_end(key)
            return cached
        text = self.vocab.decode(completion.ids[:n])
        self._texts[key] = text
        if len(self._texts) > _TEXT_CACHE_SIZE:
            self._texts.popitem(last=False)
        return text
