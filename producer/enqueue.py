"""``datagen enqueue``: read → template → tokenize → store → publish, datasets interleaved.

Re-running on the same files enqueues nothing that is done, failed, skipped or still
queued in Redis (waiting, or unacked by a worker); a prompt stored as queued whose
message Redis no longer holds is enqueued again.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from celery import Celery

from common.audit import queued_in_redis
from common.errors import ConfigError
from common.ledger import Ledger
from common.publish import Publisher
from common.reconcile import reconcile_dataset
from common.store import DatasetRow, Store
from producer.plan import DatasetPlan
from producer.reader import PromptRecord, ReadReport, read_dataset
from producer.template import ChatTemplater

CHUNK = 1000
Progress = Callable[[int], None]


@dataclass
class DatasetSummary:
    name: str
    read: int = 0
    bad: int = 0
    duplicates: int = 0
    skipped: int = 0
    enqueued: int = 0
    already_done: int = 0
    already_queued: int = 0
    failed_before: int = 0
    closed: bool = False
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Limits:
    max_seq_len: int = 32768


class Enqueuer:
    def __init__(
        self,
        store: Store,
        ledger: Ledger,
        app: Celery,
        templater: ChatTemplater,
        limits: Limits,
        progress: Progress | None = None,
    ) -> None:
        self.store, self.ledger, self.templater = store, ledger, templater
        self.publisher = Publisher(app)
        self.limits = limits
        self.progress = progress or (lambda n: None)
        self._tokenizing = ThreadPoolExecutor(max_workers=1)

    def run(self, plans: list[DatasetPlan]) -> list[DatasetSummary]:
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        summaries = [DatasetSummary(p.name) for p in plans]
        streams = [self._dataset(p, s) for p, s in zip(plans, summaries, strict=True)]
        # Round-robin over datasets, one chunk each, so every queue fills from the start.
        try:
            while streams:
                for stream in list(streams):
                    if next(stream, None) is None:
                        streams.remove(stream)
        finally:
            self._tokenizing.shutdown(wait=True, cancel_futures=True)
        self.publisher.announce([p.name for p in plans])
        return summaries

    def _register(self, plan: DatasetPlan) -> DatasetRow:
        row = DatasetRow(
            name=plan.name,
            budget=plan.budget,
            sampling={**plan.sampling, "max_new_tokens": plan.max_new_tokens},
            max_seq_len=self.limits.max_seq_len,
            tokenizer=self.templater.name,
            template_hash=self.templater.template_hash,
            reasoning_open=self.templater.reasoning_open,
        )
        if plan.name in self.store.dataset_names():
            old = self.store.dataset(plan.name)
            if old.template_hash != row.template_hash and self.store.prompt_counts(plan.name):
                raise ConfigError(
                    f"dataset {plan.name} was templated with tokenizer {old.tokenizer} "
                    f"(template {old.template_hash[:12]}); this run uses {row.tokenizer} "
                    f"(template {row.template_hash[:12]}). Mixing them would mix prompt "
                    "formats: use a new dataset name or the same tokenizer and kwargs."
                )
        self.store.upsert_dataset(row)
        reconcile_dataset(self.store, self.ledger, plan.name)
        return self.store.dataset(plan.name)

    def _dataset(self, plan: DatasetPlan, summary: DatasetSummary) -> Iterator[bool]:
        ds = self._register(plan)
        states = self.store.prompt_states(plan.name)
        in_redis = queued_in_redis(self.ledger.redis, plan.name)
        report = ReadReport(dataset=plan.name, files=[str(f) for f in plan.files])
        records = read_dataset(plan.name, plan.files, report)
        chunks = iter(lambda: list(itertools.islice(records, CHUNK)), [])
        ahead = self._encode_ahead(next(chunks, None), states)
        while ahead is not None:
            chunk, fresh, encoded = ahead
            # Tokenization releases the GIL: the next chunk's runs while this one is stored
            # and published.
            ahead = self._encode_ahead(next(chunks, None), states)
            to_send = self._settle(chunk, states, in_redis, summary)
            to_send += self._store_fresh(plan, fresh, encoded.result(), states, summary)
            summary.closed = self.ledger.is_closed(plan.name)
            if to_send and not summary.closed:
                self.publisher.publish(plan.name, ds.stamp, to_send)
                summary.enqueued += len(to_send)
            self.progress(len(chunk))
            yield True
        summary.closed = self.ledger.is_closed(plan.name)
        summary.read, summary.bad, summary.duplicates = report.read, report.bad, report.duplicates
        summary.problems = list(report.problems)

    def _encode_ahead(
        self, chunk: list[PromptRecord] | None, states: dict[str, str]
    ) -> tuple[list[PromptRecord], list[PromptRecord], Future[list[list[int]]]] | None:
        if chunk is None:
            return None
        fresh = [r for r in chunk if r.sample_id not in states]
        convs = [list(r.messages) for r in fresh]
        return chunk, fresh, self._tokenizing.submit(self.templater.encode_batch, convs)

    @staticmethod
    def _settle(
        chunk: list[PromptRecord], states: dict[str, str], in_redis: set[str],
        summary: DatasetSummary,
    ) -> list[str]:
        """Count the chunk's prompts stored before; return those whose message Redis lost."""
        to_send = []
        for r in chunk:
            state = states.get(r.sample_id)
            if state == "done":
                summary.already_done += 1
            elif state == "failed":
                summary.failed_before += 1
            elif state == "skipped":
                summary.skipped += 1
            elif state == "queued" and r.sample_id in in_redis:
                summary.already_queued += 1
            elif state == "queued":
                to_send.append(r.sample_id)
        return to_send

    def _store_fresh(
        self, plan: DatasetPlan, fresh: list[PromptRecord], ids: list[list[int]],
        states: dict[str, str], summary: DatasetSummary,
    ) -> list[str]:
        """Store new prompts; return the sample ids that need a message."""
        rows = self._prompt_rows(plan, fresh, ids)
        self.store.insert_prompts(rows)
        to_send = []
        for row in rows:
            states[row["sample_id"]] = row["state"]
            if row["state"] == "queued":
                to_send.append(row["sample_id"])
            else:
                summary.skipped += 1
        return to_send

    def _prompt_rows(
        self, plan: DatasetPlan, fresh: list[PromptRecord], ids: list[list[int]]
    ) -> list[dict[str, Any]]:
        max_seq = self.limits.max_seq_len
        rows = []
        for record, input_ids in zip(fresh, ids, strict=True):
            room = max_seq - len(input_ids)
            state, error = "queued", None
            if room <= 0:
                state = "skipped"
                error = f"prompt is {len(input_ids)} tokens; no room to generate within " \
                        f"max_seq_len {max_seq}"
            rows.append({
                "dataset": plan.name,
                "sample_id": record.sample_id,
                "state": state,
                "messages": list(record.messages),
                "input_ids": input_ids,
                "prompt_tokens": len(input_ids),
                "max_new_tokens": max(0, min(plan.max_new_tokens, room)),
                "source": record.source,
                "error": error,
            })
        return rows
