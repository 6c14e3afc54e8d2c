"""Admission at delivery: the consumer reads the prompts and asks ADMIT for a whole pop.

A task's path had two group waits, one before its request (the prompt read and ADMIT) and
one after it (the charge and the store). Each wait costs a task a thread hand-off and a
turn at the GIL in a process of many threads, and at full rate those waits, more than
the statements, held the worker below a bare task making the same request
(docs/PERFORMANCE_EXPERIMENTS.md, twelfth and twentieth rounds). The consumer thread
takes up to 16 messages a pop (common/broker.py); here it reads their prompts with one
SELECT and admits them with one ADMIT script before it hands them to the pool, and each
task finds its prompt and its admission waiting under its message's delivery tag.

With one message prefetched per thread (``worker_prefetch_multiplier`` 1) a message is
popped only when a thread is free for it, so its task starts at once and the admission
is as fresh as the task's own would be; no more are admitted here than there are threads
free (every rid claimed is a thread busy, or about to be). A message whose task does not
run here after all (revoked, or put back by a consumer restart) leaves a reservation
behind: a revoke gives it back at once (``drop``), and anything not taken within
``TTL_S`` is given back by the next pop (``expire``). Whatever goes wrong here (a
database or Redis away, a message in an unexpected form) leaves the message to the
task's own admission.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery import bootsteps

from common.broker import Channel
from common.celery_app import GENERATE_TASK
from common.rids import new_rid
from workers import steps
from workers.inflight import give_back

if TYPE_CHECKING:
    from workers.context import WorkerContext

log = logging.getLogger(__name__)
# A message's task starts within milliseconds of its pop; an admission not taken for this
# long belongs to a message that will not run here.
TTL_S = 60.0
# After a failed admission at delivery, tasks admit themselves for this long: a database
# or Redis away must not hold up the consumer at every pop.
PAUSE_S = 5.0


@dataclass(frozen=True)
class Early:
    """A message's prompt and admission, made at its delivery."""

    dataset: str
    sample_id: str
    server: str
    rid: str
    admitted: steps.Admitted
    at: float  # time.monotonic() of the admission


def sample_of(payload: dict[str, Any]) -> tuple[str, str, str] | None:
    """(delivery tag, dataset, sample_id) of a generate message due now; None for any
    other message (another task, one with an ETA or an expiry, an unexpected encoding)."""
    try:
        headers, props = payload["headers"], payload["properties"]
        if (headers.get("task") != GENERATE_TASK or headers.get("eta")
                or headers.get("expires") or payload.get("content-type") != "application/json"
                or props.get("body_encoding") != "base64"):
            return None
        args, kwargs, _embed = json.loads(base64.b64decode(payload["body"]))
        if args:
            return None
        dataset, sample_id = kwargs["dataset"], kwargs["sample_id"]
        tag = props["delivery_tag"]
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if not all(isinstance(v, str) for v in (tag, dataset, sample_id)):
        return None
    return tag, dataset, sample_id


class EarlyAdmissions:
    """The admissions made at delivery, by delivery tag, until their tasks take them."""

    def __init__(self, ctx: WorkerContext, ttl_s: float = TTL_S,
                 pause_s: float = PAUSE_S) -> None:
        self.ctx = ctx
        self.ttl_s = ttl_s
        self.pause_s = pause_s
        self.made = self.taken = self.given_back = 0
        self._waiting: dict[str, Early] = {}
        self._lock = threading.Lock()
        self._paused_until = 0.0

    def __len__(self) -> int:
        return len(self._waiting)

    def on_delivery(self, payloads: list[dict[str, Any]], now: float | None = None) -> None:
        """Read and admit the samples of a pop's messages (the consumer's thread)."""
        now = time.monotonic() if now is None else now
        self.expire(now)
        if now < self._paused_until:
            return
        ctx = self.ctx
        # Only as many as there are threads free to run them at once. Celery widens the
        # prefetch by one for each retry it holds until its ETA, and a message popped
        # into that room may wait for a thread for as long as a request takes, its
        # reservation holding admission short meanwhile; such a message admits itself.
        free = ctx.settings.concurrency - len(ctx.live_rids)
        found = [s for s in map(sample_of, payloads) if s is not None][:max(0, free)]
        if not found:
            return
        picked = []
        for tag, dataset, sample_id in found:
            server = ctx.client.pick_server()
            rid = new_rid(dataset, server)
            ctx.live_rids.add(rid)  # claimed before ADMIT, as in the task's own path
            picked.append((tag, dataset, sample_id, server, rid))
        try:
            admitted = steps.admit_group(ctx, [(d, s, rid) for _, d, s, _, rid in picked])
        except Exception as exc:
            # ADMIT may have run with its reply lost: free what it may have reserved, as a
            # task does after a failed step. Each task then admits itself.
            give_back(ctx.ledger, ctx.live_rids, [(d, rid) for _, d, _, _, rid in picked])
            self._paused_until = now + self.pause_s
            log.warning("admission at delivery failed (%s: %s); tasks admit themselves "
                        "for %.0fs", type(exc).__name__, exc, self.pause_s)
            return
        replaced: list[Early] = []
        with self._lock:
            for (tag, dataset, sample_id, server, rid), answer in zip(picked, admitted,
                                                                      strict=True):
                # A message put back (a consumer restart) comes again with its tag: the
                # admission of its first delivery was never taken.
                old = self._waiting.pop(tag, None)
                if old is not None:
                    replaced.append(old)
                self._waiting[tag] = Early(dataset, sample_id, server, rid, answer, now)
            self.made += len(picked)
        self._give_back(replaced)

    def take(self, tag: str | None, dataset: str, sample_id: str) -> Early | None:
        """The admission made for this message at its delivery, now the task's to settle
        (its rid stays claimed until the task discards it); None if there is none."""
        if tag is None:
            return None
        with self._lock:
            early = self._waiting.pop(tag, None)
            if early is not None:
                self.taken += 1
        if early is not None and (early.dataset, early.sample_id) != (dataset, sample_id):
            self._give_back([early])  # never expected: a tag names one message
            return None
        return early

    def drop(self, tag: str | None) -> None:
        """Give back the admission of a message whose task will not run (revoked)."""
        if tag is None:
            return
        with self._lock:
            early = self._waiting.pop(tag, None)
        if early is not None:
            self._give_back([early])

    def expire(self, now: float | None = None) -> int:
        """Give back the admissions not taken within the TTL; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            # Entries are kept in the order they were made, so the stale ones come first.
            stale = [tag for tag, _ in itertools.takewhile(
                lambda item: now - item[1].at > self.ttl_s, self._waiting.items())]
            old = [self._waiting.pop(tag) for tag in stale]
        self._give_back(old)
        return len(old)

    def _give_back(self, entries: list[Early]) -> None:
        if not entries:
            return
        with self._lock:
            self.given_back += len(entries)
        # Only an admitted sample holds a reservation; every entry holds its rid's claim.
        give_back(self.ctx.ledger, self.ctx.live_rids,
                  [(e.dataset, e.rid) for e in entries if e.admitted[1] is not None])
        for e in entries:
            if e.admitted[1] is None:
                self.ctx.live_rids.discard(e.rid)


class AdmitOnDelivery(bootsteps.StartStopStep):
    """Consumer bootstep: the worker's channel admits each pop's samples as it delivers
    them (a restarted consumer has a new channel, and comes here again)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        from workers.context import get_context  # it holds this module's EarlyAdmissions

        channel = getattr(c.task_consumer, "channel", None)
        if isinstance(channel, Channel):
            channel.before_delivery = get_context(c.app).early.on_delivery
