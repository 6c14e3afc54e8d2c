"""Synthetic prompt files shaped like the reference run, and enqueueing them in-process.

Ten datasets in the reference run's proportions (88,088 prompts at full scale). Prompt
lengths are lognormal per dataset (medians 160-1,300 tokens of the bundled tokenizer,
overall mean near 330, agent traces long and multi-turn). Half the datasets carry ids,
half get the reader's content hash. Files are cached under the bench directory.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from functools import cache
from pathlib import Path

from tokenizers import Tokenizer

from bench.harness import WORKDIR
from common.budget import Budget
from common.celery_app import make_celery
from common.ledger import Ledger
from common.order import OrderKind, OrderRequest
from common.settings import Settings
from common.store import Store
from producer.enqueue import DatasetSummary, Enqueuer, Limits
from producer.mixes import parse_mix_flags
from producer.plan import DEFAULT_SAMPLING, Draws, plans_from_paths
from producer.template import BUNDLED_TOKENIZER, ChatTemplater

REFERENCE_TOTAL = 88_088
# name, prompts in the reference run, median prompt tokens, user turns, ids given
DATASETS: tuple[tuple[str, int, int, int, bool], ...] = (
    ("B1", 12_000, 200, 1, True), ("B2", 14_714, 240, 1, True), ("B3", 10_000, 160, 1, True),
    ("B4", 9_000, 270, 1, True), ("B5", 8_000, 220, 1, False), ("B6", 11_000, 180, 2, False),
    ("B7", 9_802, 220, 1, False), ("B8", 3_572, 1_300, 4, False), ("A1", 5_000, 290, 2, True),
    ("A2", 5_000, 180, 1, False),
)
SIGMA = 0.6
MAX_PROMPT_TOKENS = 12_000
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "te", "vi", "do", "pa", "qua", "zen", "or",
              "el", "an", "is", "um", "ri", "tho", "gra", "ple", "st", "ion", "ing", "er")


def counts(total: int) -> list[tuple[str, int, int, int, bool]]:
    """The datasets scaled to ``total`` prompts (the largest absorbs the rounding)."""
    scaled = [(n, max(1, round(c * total / REFERENCE_TOTAL)), m, t, i)
              for n, c, m, t, i in DATASETS]
    diff = total - sum(c for _, c, _, _, _ in scaled)
    big = max(range(len(scaled)), key=lambda k: scaled[k][1])
    name, c, m, t, i = scaled[big]
    scaled[big] = (name, c + diff, m, t, i)
    return scaled


@cache
def _lexicon_cached() -> list[str]:
    return _lexicon(random.Random(7))


def _lexicon(rng: random.Random) -> list[str]:
    words: set[str] = set()
    while len(words) < 4000:
        words.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))))
    return sorted(words)


@cache
def _tokens_per_word() -> float:
    rng = random.Random(7)
    words = _lexicon(rng)
    text = " ".join(rng.choice(words) for _ in range(5000))
    tok = Tokenizer.from_file(str(BUNDLED_TOKENIZER / "tokenizer.json"))
    return len(tok.encode(text, add_special_tokens=False).ids) / 5000


def _text(rng: random.Random, words: list[str], tokens: float) -> str:
    n = max(1, round(tokens / _tokens_per_word()))
    out = []
    for k in range(n):
        out.append(rng.choice(words))
        if k % 17 == 16:
            out.append(".\n" if k % 51 == 50 else ",")
    return " ".join(out)


def _conversation(rng: random.Random, words: list[str], median: int, turns: int,
                  sigma: float = SIGMA) -> list[dict]:
    total = min(MAX_PROMPT_TOKENS, rng.lognormvariate(math.log(median), sigma))
    per_turn = max(4.0, total / (2 * turns - 1))
    msgs = [{"role": "system", "content": _text(rng, words, 30)}] if turns > 1 else []
    for k in range(turns):
        msgs.append({"role": "user", "content": _text(rng, words, per_turn)})
        if k < turns - 1:
            msgs.append({"role": "assistant", "content": _text(rng, words, per_turn)})
    return msgs


def prompt_files(total: int, seed: int = 0, id_prefix: str = "") -> Path:
    """A folder with one JSONL file per dataset, ``total`` prompts in all (cached).

    ``id_prefix`` starts every given id, so that folders of several seeds can be enqueued
    into one run as new prompts (without it, ids repeat from one seed to the next)."""
    folder = WORKDIR / f"prompts-{total}-{seed}{'-' + id_prefix if id_prefix else ''}"
    if not (folder / ".complete").exists():
        rng = random.Random(seed)
        for name, n, median, turns, with_ids in counts(total):
            write_dataset(folder, name, n, median, turns, with_ids, rng, id_prefix)
        (folder / ".complete").touch()
    return folder


def write_dataset(folder: Path, name: str, n: int, median: int, turns: int = 1,
                  with_ids: bool = True, rng: random.Random | None = None,
                  id_prefix: str = "", sigma: float = SIGMA) -> Path:
    """``folder/name.jsonl`` with ``n`` synthetic conversations; their prompts' lengths
    spread lognormally around ``median`` tokens (``sigma`` 0: all about ``median``)."""
    rng = rng or random.Random(name)
    words = _lexicon_cached()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jsonl"
    with path.open("w", encoding="utf-8") as fh:
        for i in range(n):
            line: dict = {"messages": _conversation(rng, words, median, turns, sigma)}
            if with_ids:
                line = {"id": f"{id_prefix}{name}-{i:06d}", **line}
            fh.write(json.dumps(line, ensure_ascii=False) + "\n")
    return path


@cache
def templater() -> ChatTemplater:
    return ChatTemplater(str(BUNDLED_TOKENIZER))


def enqueue(settings: Settings, folder: Path, budget: Budget | None = None,
            max_new_tokens: int = 1024, max_seq_len: int = 32768,
            order: OrderKind | None = None, mixes: Sequence[str] = ()
            ) -> list[DatasetSummary]:
    """``datagen enqueue FOLDER`` in this process (the tokenizer is loaded once per process);
    ``order``: its ``--order`` (default shuffle); ``mixes``: its ``--mix`` flags."""
    import redis

    plans = plans_from_paths([str(folder)], budget or Budget(), dict(DEFAULT_SAMPLING),
                             max_new_tokens, order=OrderRequest(order),
                             draws=Draws(parse_mix_flags(list(mixes))))
    store = Store(settings.database_url)
    ledger = Ledger(redis.Redis.from_url(settings.redis_url))
    app = make_celery(settings)
    try:
        return Enqueuer(store, ledger, app, templater(), Limits(max_seq_len)).run(plans)
    finally:
        store.engine.dispose()
        ledger.redis.close()
        app.close()
