"""A results database as a finished run leaves it, written through the store API at
tens of thousands of rows a second, with no worker or server: for the export and
validate benchmarks, and for the tests of what an export writes about a run.

Each dataset gets prompts in every state: most done with a stored result (finish
``stop``, some ``length``), some ``failed`` with an error, some ``skipped`` (no room
left), some still ``queued`` (not generated before the close); with ``close`` set, the
dataset is closed by its budget with its last result cut to it (finish ``budget``).
Texts are words of the synthetic lexicon, ids their encoding with the bundled tokenizer,
so every export format, ``text`` fields included, can be made from them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime

from tokenizers import Tokenizer

from bench.synth import _lexicon_cached, _text
from common.budget import Budget
from common.rows import NewPrompt, ResultRow
from common.store import DatasetRow, Store
from producer.plan import DEFAULT_SAMPLING
from producer.template import BUNDLED_TOKENIZER

CHUNK = 1000
MODEL = "synthetic/model-7b"
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                   "required": ["word"]}}}]


@dataclass(frozen=True)
class Shape:
    """What share of a dataset's prompts ends in each state (the rest: done)."""

    failed: float = 0.02
    skipped: float = 0.01
    queued: float = 0.05
    length: float = 0.1  # of the done ones: cut at max_new_tokens
    unclosed: float = 0.1  # of the done ones, where reasoning is on: cut while reasoning
    prompt_tokens: int = 60
    output_tokens: int = 120


def _tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(BUNDLED_TOKENIZER / "tokenizer.json"))


def _state(rng: random.Random, shape: Shape) -> str:
    x = rng.random()
    for state, share in (("failed", shape.failed), ("skipped", shape.skipped),
                         ("queued", shape.queued)):
        if x < share:
            return state
        x -= share
    return "done"


def _answer(rng: random.Random, words: list[str], shape: Shape, reasoning: bool) -> str:
    text = _text(rng, words, rng.uniform(0.3, 1.7) * shape.output_tokens)
    if not reasoning:
        return text
    thought = _text(rng, words, shape.output_tokens / 2)
    return thought if rng.random() < shape.unclosed else f"{thought}\n</think>\n\n{text}"


def add_dataset(store: Store, name: str, n: int, *, shape: Shape = Shape(), seed: int = 0,
                close: bool = False, reasoning: bool = False, tools: bool = False) -> None:
    """``n`` prompts of dataset ``name`` in the states ``shape`` gives, with their results;
    ``reasoning``: outputs open with a ``<think>`` block, some never closed; ``tools``:
    every other prompt carries a function schema."""
    rng, words, tok = random.Random(f"{name}-{seed}"), _lexicon_cached(), _tokenizer()
    store.upsert_dataset(DatasetRow(
        name, Budget(10_000_000, "output", "exact" if close else "drain"), dict(DEFAULT_SAMPLING),
        32768, str(BUNDLED_TOKENIZER), f"synthetic-{seed}",
        reasoning_open="<think>" if reasoning else None))
    for start in range(0, n, CHUNK):
        states = [_state(rng, shape) for _ in range(start, min(n, start + CHUNK))]
        ids = [f"{name}-{start + k:07d}" for k in range(len(states))]
        asks = [_text(rng, words, shape.prompt_tokens) for _ in states]
        answers = [_answer(rng, words, shape, reasoning) for _ in states]
        asked = [e.ids for e in tok.encode_batch(asks)]
        answered = [e.ids for e in tok.encode_batch(answers, add_special_tokens=False)]
        store.insert_prompts([
            NewPrompt(name, sid, "skipped" if state == "skipped" else "queued", len(ids_),
                      2048, f"{name}.jsonl:{start + k + 1}",
                      [{"role": "user", "content": text}], ids_,
                      tools=TOOLS if tools and k % 2 else None)
            for k, (sid, state, text, ids_) in enumerate(zip(ids, states, asks, asked,
                                                             strict=True))
        ])
        done = [k for k, state in enumerate(states) if state == "done"]
        finish = ["length" if rng.random() < shape.length else "stop" for _ in done]
        if close and done and start + CHUNK >= n:
            finish[-1] = "budget"  # the sample whose charge closed the dataset, cut to fit
        store.save_results([
            ResultRow(name, ids[k], f"rid-{ids[k]}", len(asked[k]), len(answered[k]),
                      why, answered[k], answers[k], "http://127.0.0.1:30000", MODEL,
                      e2e_latency_s=1.5)
            for k, why in zip(done, finish, strict=True)
        ])
        for k, state in enumerate(states):
            if state == "failed":
                store.mark_failed(name, ids[k], "HTTP 400: synthetic refusal")
    if close:
        budget = store.dataset(name).budget
        store.record_close(name, "budget", datetime.now(UTC), store.used_tokens(name, budget))


def fill(store: Store, total: int, datasets: int = 4, seed: int = 0) -> list[str]:
    """``total`` prompts over ``datasets`` datasets (the first one closed by its budget)."""
    names = [f"D{k + 1}" for k in range(datasets)]
    for k, name in enumerate(names):
        n = total // datasets + (1 if k < total % datasets else 0)
        add_dataset(store, name, n, seed=seed, close=k == 0)
    return names
