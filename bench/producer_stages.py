"""Where the producer's time goes, stage by stage, and what each candidate fix gains.

Stages (µs per prompt, one at a time, on the same data): read (JSON + id), render (chat
template), tokenize (the same Rust ``encode_batch_fast`` the templater calls) with the
tokenizers library's own thread pool on and off, store (``Store.insert_prompts``) and
publish (the producer's ``Publisher``). Then the per-chunk loop itself, measured
end-to-end in variants run side by side: serial, tokenization of the next chunk
overlapped with store + publish of the current one, tokenization split over two Python
threads with the library's pool off, and the three-stage pipeline ``Enqueuer`` runs
(render here, tokenize in one thread, store + publish in another).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from tokenizers import Tokenizer

from bench.harness import bench_settings, fresh_db, fresh_redis
from bench.report import Summary, table
from bench.synth import prompt_files, templater
from common.celery_app import make_celery
from common.publish import Publisher
from common.rows import NewPrompt
from common.store import Store
from producer.reader import PromptRecord, ReadReport, read_dataset
from producer.template import BUNDLED_TOKENIZER

CHUNK = 1000
Chunk = tuple[str, list[PromptRecord]]


@contextmanager
def parallelism(on: bool) -> Iterator[None]:
    """The tokenizers library reads TOKENIZERS_PARALLELISM at every batch call."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if on else "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def read_chunks(n: int) -> tuple[list[Chunk], float]:
    """The first ``n`` prompts as (dataset, chunk) pairs, and µs/prompt of reading."""
    folder = prompt_files(n)
    t0 = time.perf_counter()
    chunks: list[Chunk] = []
    for path in sorted(folder.glob("*.jsonl")):
        records = list(read_dataset(path.stem, [path], ReadReport(path.stem)))
        chunks += [(path.stem, records[i:i + CHUNK]) for i in range(0, len(records), CHUNK)]
    total = sum(len(c) for _, c in chunks)
    return chunks, 1e6 * (time.perf_counter() - t0) / total


class Loop:
    """The producer's per-chunk work, with the project's own store and publisher."""

    def __init__(self) -> None:
        fresh_redis()
        self.settings = bench_settings(fresh_db("sqlite", "stages"), "http://127.0.0.1:9")
        self.store = Store(self.settings.database_url)
        self.app = make_celery(self.settings)
        self.pub = Publisher(self.app)
        self.tok = Tokenizer.from_file(str(BUNDLED_TOKENIZER / "tokenizer.json"))
        self.tmpl = templater()

    def close(self) -> None:
        self.store.engine.dispose()
        self.app.close()

    def render(self, chunk: list[PromptRecord]) -> list[str]:
        return [self.tmpl.render(r.messages) for r in chunk]

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]

    def tokenize2(self, pool: ThreadPoolExecutor, texts: list[str]) -> list[list[int]]:
        half = len(texts) // 2
        a, b = pool.map(self.tokenize, [texts[:half], texts[half:]])
        return a + b

    def store_publish(self, ds: str, chunk: list[PromptRecord], ids: list[list[int]]) -> None:
        rows = [NewPrompt(dataset=ds, sample_id=r.sample_id, state="queued",
                          messages=list(r.messages), input_ids=i, prompt_tokens=len(i),
                          max_new_tokens=16384, source=r.source, error=None)
                for r, i in zip(chunk, ids, strict=True)]
        self.store.insert_prompts(rows)
        self.pub.publish(ds, f"{ds}@bench", [r.sample_id for r in chunk])


def timed(fn: Callable[[], Any], n: int) -> float:
    t0 = time.perf_counter()
    fn()
    return 1e6 * (time.perf_counter() - t0) / n


def stage_times(chunks: list[Chunk], n: int) -> dict[str, float]:
    loop = Loop()
    try:
        texts = [loop.render(c) for _, c in chunks]
        out = {"render": timed(lambda: [loop.render(c) for _, c in chunks], n)}
        with parallelism(True):
            out["tokenize (library pool on)"] = timed(lambda: [loop.tokenize(t) for t in texts], n)
        with parallelism(False):
            out["tokenize (1 thread)"] = timed(lambda: [loop.tokenize(t) for t in texts], n)
        ids = [loop.tokenize(t) for t in texts]
        rows = list(zip(chunks, ids, strict=True))
        def store_publish() -> None:
            for (ds, c), i in rows:
                loop.store_publish(ds, c, i)

        out["store + publish"] = timed(store_publish, n)
    finally:
        loop.close()
    return out


def serial(loop: Loop, chunks: list[Chunk]) -> None:
    for ds, chunk in chunks:
        loop.store_publish(ds, chunk, loop.tokenize(loop.render(chunk)))


def overlapped(loop: Loop, chunks: list[Chunk]) -> None:
    with ThreadPoolExecutor(1) as pool:
        nxt = pool.submit(loop.tokenize, loop.render(chunks[0][1]))
        for k, (ds, chunk) in enumerate(chunks):
            ids = nxt.result()
            if k + 1 < len(chunks):
                nxt = pool.submit(loop.tokenize, loop.render(chunks[k + 1][1]))
            loop.store_publish(ds, chunk, ids)


def pipelined(loop: Loop, chunks: list[Chunk]) -> None:
    with ThreadPoolExecutor(1) as tokenizing, ThreadPoolExecutor(1) as writing:
        pending: list[Future[None]] = []
        for ds, chunk in chunks:
            ids = tokenizing.submit(loop.tokenize, loop.render(chunk))
            pending.append(writing.submit(
                lambda ds, c, ids: loop.store_publish(ds, c, ids.result()), ds, chunk, ids))
            while len(pending) > 2:
                pending.pop(0).result()
        for fut in pending:
            fut.result()


def two_threads(loop: Loop, chunks: list[Chunk]) -> None:
    with parallelism(False), ThreadPoolExecutor(2) as pool:
        for ds, chunk in chunks:
            loop.store_publish(ds, chunk, loop.tokenize2(pool, loop.render(chunk)))


BASE = "serial, library pool on"
VARIANTS: dict[str, Callable[[Loop, list[Chunk]], None]] = {
    BASE: serial,
    "overlap next chunk's tokenize with store+publish": overlapped,
    "tokenize in 2 Python threads, library pool off": two_threads,
    "3 stages: render | tokenize | store+publish (as Enqueuer)": pipelined,
}


def variant_rates(chunks: list[Chunk], n: int, reps: int) -> dict[str, Summary]:
    rates: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for _ in range(reps):
        for name, fn in VARIANTS.items():
            loop = Loop()
            try:
                t0 = time.perf_counter()
                fn(loop, chunks)
                rates[name].append(n / (time.perf_counter() - t0))
            finally:
                loop.close()
    return {k: Summary.of(v) for k, v in rates.items()}


def run(n: int, reps: int) -> dict[str, Any]:
    chunks, read_us = read_chunks(n)
    total = sum(len(c) for _, c in chunks)
    stages = {"read (JSON + id)": read_us, **stage_times(chunks, total)}
    serial_us = sum(v for k, v in stages.items() if k != "tokenize (1 thread)")
    table(f"producer stages in isolation, {total:,} prompts (µs per prompt)",
          ["stage", "µs/prompt", "share of serial sum"],
          [(k, f"{v:.0f}", f"{100 * v / serial_us:.0f}%" if "1 thread" not in k else "-")
           for k, v in stages.items()])
    variants = variant_rates(chunks, total, reps)
    base = variants[BASE].median
    table(f"per-chunk loop variants side by side (render .. publish; reading excluded), "
          f"{reps} reps (prompts/s median [min-max])", ["variant", "prompts/s", "vs serial"],
          [(k, v.fmt(0), f"{v.median / base:.2f}x") for k, v in variants.items()])
    return {"stages_us": stages, "variants": variants}
