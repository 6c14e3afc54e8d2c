"""``datagen enqueue``: read → template → tokenize → store → publish, datasets interleaved.

Each dataset's prompts go through in its publishing order (common/order.py): shuffled, the
dataset is read whole first, its ranks sorted, and then stored and published chunk by
chunk in rank order; in file order it streams as it is read.

Re-running on the same files enqueues nothing that is done, failed, skipped or still
queued in Redis (waiting, or unacked by a worker); a prompt stored as queued whose
message Redis no longer holds is enqueued again.
"""

from __future__ import annotations

import gc
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from celery import Celery

from common.audit import queued_in_redis
from common.conversation import DEFAULT_TURNS
from common.conversation_store import queued_later_turns
from common.draws import Mixtures, draw_id, seed_of
from common.errors import ConfigError
from common.ledger import Ledger
from common.order import Order, rank_key
from common.publish import Publisher
from common.reconcile import reconcile_dataset
from common.rows import NewPrompt, allowance
from common.sampling_rules import check_sampling
from common.store import DatasetRow, Store
from producer.generations import expand
from producer.plan import DatasetPlan
from producer.reader import PromptRecord, ReadReport, read_dataset
from producer.sending import Sender
from producer.template import ChatTemplater
from producer.turns import conversation_row, first_turns, turn_of

CHUNK = 1000
# Chunks handed to the writer and not yet written: enough to keep every stage busy while
# one waits, few enough that memory stays a few chunks of prompts.
PIPELINE_DEPTH = 2
# Chunks handed to the publishing process and not yet in Redis: only their sample ids wait,
# so more may, and the publishing process never idles while this one catches up.
SENDING_DEPTH = 8
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
    notes: list[str] = field(default_factory=list)  # how lines were taken, not problems


@dataclass(frozen=True)
class Limits:
    max_seq_len: int = 32768


@dataclass(frozen=True)
class _Written:
    """What storing and publishing one chunk did, counted on the writer thread."""

    summary: DatasetSummary
    read: int
    enqueued: int
    skipped: int
    # Done once the chunk's messages are all in Redis; None when it sent none.
    sent: Future[None] | None = None


class _Abandoned(Exception):
    """A chunk not written because an earlier one failed; that failure is the one raised."""


class Enqueuer:
    """Runs the producer as four overlapping stages: this thread reads, settles and
    renders; one thread tokenizes (Rust, off the GIL); one thread stores; a child process
    publishes (producer/sending.py; ``publish_in_child=False`` keeps it in a thread).

    Each chunk is stored before it is published and chunks are written in order, so a
    producer killed at any point, even in the middle of a chunk's publishing, leaves only
    prompts stored as queued without a message, which the next run publishes.
    """

    def __init__(
        self,
        store: Store,
        ledger: Ledger,
        app: Celery,
        templater: ChatTemplater,
        limits: Limits,
        progress: Progress | None = None,
        publish_in_child: bool = True,
    ) -> None:
        self.store, self.ledger, self.templater = store, ledger, templater
        self.app, self.publish_in_child = app, publish_in_child
        self.publisher = Publisher(app)
        self.limits = limits
        self.progress = progress or (lambda n: None)
        # Made by each run, which shuts them down when it ends.
        self._tokenizing: ThreadPoolExecutor
        self._writing: ThreadPoolExecutor
        self._sending: Sender
        self._written: deque[Future[_Written]] = deque()
        self._sent: deque[Future[None]] = deque()
        self._failed = False
        self._analyzed = False
        self._orders: dict[str, Order] = {}
        self._registered: dict[str, DatasetRow] = {}

    def run(self, plans: list[DatasetPlan]) -> list[DatasetSummary]:
        for plan in plans:  # all of them before the first is stored
            check_sampling({**plan.sampling, "max_new_tokens": plan.max_new_tokens},
                           name=f"dataset {plan.name}: {{}}".format)
        self._orders = {plan.name: self._order(plan) for plan in plans}
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._writing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store")
        self._sending = Sender(self.app, in_child=self.publish_in_child)
        self._written.clear()
        self._sent.clear()
        self._failed = self._analyzed = False
        summaries = [DatasetSummary(p.name) for p in plans]
        streams = [self._dataset(p, s) for p, s in zip(plans, summaries, strict=True)]
        # Round-robin over datasets, one chunk each, so every queue fills from the start.
        try:
            first = True
            while streams:
                for stream in list(streams):
                    if next(stream, None) is None:
                        streams.remove(stream)
                if first:
                    # Every dataset is read by now (a shuffled one whole): its records live
                    # until the end, and the collector would scan them again at each full
                    # collection, a quarter of the producer's CPU.
                    gc.freeze()
                    first = False
            self._collect(0, 0)
        finally:
            gc.unfreeze()
            for pool in (self._tokenizing, self._writing):
                pool.shutdown(wait=True, cancel_futures=True)
            self._sending.close()
        if self._analyzed:  # once more on the whole load
            self.store.refresh_statistics()
        for summary in summaries:
            summary.closed = self.ledger.is_closed(summary.name)
        self.publisher.announce([p.name for p in plans])
        return summaries

    def _order(self, plan: DatasetPlan) -> Order:
        """The dataset's publishing order: the stored one where the run does not ask for
        one; ConfigError where it asks for another and the dataset holds prompts."""
        if plan.name not in self.store.dataset_names():
            return plan.order.resolve(plan.name, None, has_prompts=False)
        stored = self.store.dataset(plan.name).order
        return plan.order.resolve(plan.name, stored, bool(self.store.prompt_counts(plan.name)))

    def _draws(self, plan: DatasetPlan) -> tuple[Mixtures, int]:
        """The dataset's mixtures and generations: the stored ones where the run gives
        none and the dataset holds prompts (``_refuse_other_draws`` checks the others)."""
        if plan.name in self.store.dataset_names() and self.store.prompt_counts(plan.name):
            old = self.store.dataset(plan.name)
            return plan.mixtures or old.mixtures, plan.generations or old.generations
        return plan.mixtures, plan.generations or 1

    def _register(self, plan: DatasetPlan) -> DatasetRow:
        mixtures, generations = self._draws(plan)
        # A mixed key is drawn per sample, never sent as a fixed value.
        fixed = {k: v for k, v in plan.sampling.items() if k not in mixtures.choices}
        # Modes not asked for are the stored ones: a run without flags goes on as before.
        old = self.store.dataset(plan.name) if plan.name in self.store.dataset_names() else None
        row = DatasetRow(
            name=plan.name,
            budget=plan.budget,
            sampling={**fixed, "max_new_tokens": plan.max_new_tokens},
            max_seq_len=self.limits.max_seq_len,
            tokenizer=self.templater.name,
            template_hash=self.templater.template_hash,
            reasoning_open=self.templater.reasoning_open,
            turns=plan.turns or (old.turns if old else DEFAULT_TURNS),
            tool_call_parser=plan.tool_call_parser or (old.tool_call_parser if old else None),
            template_kwargs=self.templater.kwargs,
            order=self._orders[plan.name],
            mixtures=mixtures,
            generations=generations,
            # Every draw's, before any prompt is stored: workers judge each sample by its
            # own draw's opener (common/kept.py).
            reasoning_opens=self.templater.reasoning_opens(mixtures.template_draws()),
        )
        if old is not None:
            if self.store.prompt_counts(plan.name):
                _refuse_other_draws(old, row)
            if old.turns != row.turns and self.store.prompt_counts(plan.name):
                raise ConfigError(
                    f"dataset {plan.name} was enqueued with --turns {old.turns}; this run "
                    f"asks for --turns {row.turns}, whose prompts are other samples. Use a "
                    f"new dataset name, or --turns {old.turns}.")
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
        ds = self._registered[plan.name] = self._register(plan)
        # Redis before SQL, for the reason common.audit.lost_queued gives.
        in_redis = queued_in_redis(self.ledger.redis, plan.name)
        states = self.store.prompt_states(plan.name)
        report = ReadReport(dataset=plan.name, files=[str(f) for f in plan.files])
        records = expand(read_dataset(plan.name, plan.files, report), ds.generations, report)
        if ds.turns == "all":
            records = first_turns(records, report, ds.tool_call_parser)
        # In its publishing order: a conversation by its first turn's rank.
        ranked = ds.order.arrange(records, _sample_id)
        for pairs in iter(lambda: list(itertools.islice(ranked, CHUNK)), []):
            chunk = [record for _, record in pairs]
            ranks = {record.sample_id: rank for rank, record in pairs}
            # Rendered here, so the tokenizing thread only runs Rust (without the GIL) and
            # the next chunk renders while this one is tokenized.
            fresh, texts = self._render([r for r in chunk if r.sample_id not in states],
                                        report, ds)
            encoded = self._tokenizing.submit(self.templater.tokenize, texts)
            lost = self._settle(chunk, states, in_redis, summary)
            self._written.append(self._writing.submit(
                self._write, plan, ds.stamp, summary, len(chunk), fresh, encoded, lost, ranks
            ))
            self._collect(PIPELINE_DEPTH, SENDING_DEPTH)
            yield True
        if ds.turns == "all":
            self._later_turns(plan, ds.stamp, summary, in_redis)
        summary.read, summary.bad, summary.duplicates = report.read, report.bad, report.duplicates
        summary.problems = list(report.problems)

    def _later_turns(self, plan: DatasetPlan, stamp: str, summary: DatasetSummary,
                     in_redis: set[str]) -> None:
        """Publish again the later turns SQL holds as queued and Redis lost: workers made
        them, and no prompt file lists them. They go ahead of new prompts, as when first
        sent, for their prefix in the server's cache."""
        lost = [s for s in queued_later_turns(self.store, plan.name) if s not in in_redis]
        if lost:
            none: Future[list[list[int]]] = Future()
            none.set_result([])
            self._written.append(self._writing.submit(
                self._write, plan, stamp, summary, 0, [], none, lost, ahead=True))

    def _render(
        self, records: list[PromptRecord], report: ReadReport, ds: DatasetRow
    ) -> tuple[list[PromptRecord], list[str]]:
        """The records the chat template renders, with their texts; a line it refuses (a
        role or a tool call it does not take) is a bad line, like one the reader refuses.
        Each is rendered with the template arguments drawn for it, if its dataset mixes
        any."""
        kept, texts = [], []
        mixed = bool(ds.mixtures.template_keys)
        for record in records:
            templater = self.templater
            if mixed:
                templater = templater.variant(template_draw(ds, record))
            try:
                texts.append(templater.render(record.messages, record.tools))
            except Exception as exc:  # Jinja's errors, or raise_exception in the template
                report.bad += 1
                report.problem(f"{record.source}: the chat template cannot render it: {exc}")
                continue
            kept.append(record)
        return kept, texts

    def _collect(self, keep: int, keep_sending: int) -> None:
        """Wait for written chunks until at most ``keep`` are pending, and for sent ones
        until at most ``keep_sending`` are; count them as written."""
        while len(self._written) > keep:
            done = self._written.popleft().result()
            if done.sent is not None:
                self._sent.append(done.sent)
            done.summary.enqueued += done.enqueued
            done.summary.skipped += done.skipped
            self.progress(done.read)
        while len(self._sent) > keep_sending:
            self._sent.popleft().result()

    def _write(
        self, plan: DatasetPlan, stamp: str, summary: DatasetSummary, read: int,
        fresh: list[PromptRecord], encoded: Future[list[list[int]]], lost: list[str],
        ranks: dict[str, int] | None = None, ahead: bool = False,
    ) -> _Written:
        """Store a chunk's new prompts, then hand them and the ones Redis lost to the
        publishing process, in publishing order (``ranks``: the chunk's)."""
        if self._failed:
            # Chunks queued behind a failed one are not written: the run stops at the first
            # error, as it did when it wrote in its own thread.
            raise _Abandoned()
        try:
            return self._store_and_publish(plan, stamp, summary, read, fresh, encoded, lost,
                                           ranks or {}, ahead)
        except BaseException:
            self._failed = True
            raise

    def _store_and_publish(
        self, plan: DatasetPlan, stamp: str, summary: DatasetSummary, read: int,
        fresh: list[PromptRecord], encoded: Future[list[list[int]]], lost: list[str],
        ranks: dict[str, int], ahead: bool = False,
    ) -> _Written:
        rows = self._prompt_rows(plan, fresh, encoded.result(), ranks,
                                 self._registered[plan.name])
        self.store.insert_prompts(rows, [c for c in (conversation_row(plan.name, r)
                                                     for r in fresh) if c is not None])
        if rows and not self._analyzed:
            # Workers start on the first chunk's messages: the planner's statistics must
            # not wait for the end of a load that takes minutes.
            self.store.refresh_statistics()
            self._analyzed = True
        new = [row.sample_id for row in rows if row.state == "queued"]
        skipped = len(rows) - len(new)
        to_send = sorted({*lost, *new}, key=lambda sid: rank_key(ranks.get(sid), sid))
        if not to_send or self.ledger.is_closed(plan.name):
            return _Written(summary, read, 0, skipped)
        sent = self._sending.submit(plan.name, stamp, to_send, ahead)
        return _Written(summary, read, len(to_send), skipped, sent)

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

    def _prompt_rows(
        self, plan: DatasetPlan, fresh: list[PromptRecord], ids: list[list[int]],
        ranks: dict[str, int], ds: DatasetRow,
    ) -> list[NewPrompt]:
        mixed = bool(ds.mixtures.template_keys)
        rows = []
        for record, input_ids in zip(fresh, ids, strict=True):
            state, max_new_tokens, error = allowance(len(input_ids), plan.max_new_tokens,
                                                     self.limits.max_seq_len)
            rows.append(NewPrompt(
                dataset=plan.name,
                sample_id=record.sample_id,
                state=state,
                messages=list(record.messages),
                input_ids=input_ids,
                prompt_tokens=len(input_ids),
                max_new_tokens=max_new_tokens,
                source=record.source,
                error=error,
                tools=record.tools,
                **turn_of(record),
                rank=ranks.get(record.sample_id),
                template_kwargs=template_draw(ds, record) if mixed else None,
            ))
        return rows


def _sample_id(record: PromptRecord) -> str:
    return record.sample_id


def template_draw(ds: DatasetRow, record: PromptRecord) -> dict[str, Any]:
    """The chat template arguments drawn for a record (common/draws.py)."""
    return ds.mixtures.template(seed_of(ds.order.seed),
                                draw_id(record.sample_id, record.conversation))


def _refuse_other_draws(old: DatasetRow, new: DatasetRow) -> None:
    """A dataset holding prompts keeps its mixtures and generations: others would draw
    other samples than those stored, or name them otherwise."""
    if old.mixtures != new.mixtures:
        raise ConfigError(
            f"dataset {old.name} holds prompts drawn with mixtures "
            f"{old.mixtures.describe() or 'none'}; this run asks for "
            f"{new.mixtures.describe() or 'none'}. Give the same --mix (or mix table), or "
            "none (the stored mixtures are kept), or use a new dataset name.")
    if old.generations != new.generations:
        raise ConfigError(
            f"dataset {old.name} holds {old.generations} generation(s) of each prompt; this "
            f"run asks for {new.generations}. Leave out --generations (the stored number is "
            "kept) or use a new dataset name.")
