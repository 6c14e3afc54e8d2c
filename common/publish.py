"""Publishing one small message per prompt: dataset and sample id, never token lists.

Each prompt is one message of the generate task to its dataset's queue, stamped
with the dataset's stamp, which ``revoke_by_stamped_headers`` matches when the dataset
closes. kombu's ``Producer.batch`` buffers a chunk's LPUSHes in one pipeline on one
connection, so a chunk costs one round trip instead of one per message.

A pipeline is not a transaction: a producer killed mid-chunk can leave part of a chunk
in Redis. Nothing is lost by it. Every prompt is stored in SQL as ``queued`` before it is
published, and both a re-run of ``datagen enqueue`` and the workers' sweep publish again
each queued prompt that Redis holds neither queued nor unacked (common/audit.py). The
same holds when a flush fails with an uncertain outcome: the messages are not replayed
(some may already be in Redis); the run stops and SQL decides what to send again.
"""

from __future__ import annotations

from collections.abc import Sequence

from celery import Celery
from kombu.exceptions import BatchPublishError

from common.errors import ServiceUnavailable
from common.keys import AHEAD_PRIORITY, PROMPT_PRIORITY, queue_name
from common.messages import GenerateSender

# Messages per pipeline: one chunk of the producer, a few hundred kB of commands.
BATCH_SIZE = 1000


class Publisher:
    """Publishes prompts' messages through Celery, a chunk per pipelined round trip."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    def publish(self, dataset: str, stamp: str, sample_ids: Sequence[str],
                ahead: bool = False) -> None:
        """Publish a chunk; returns only once every message of it is in Redis. ``ahead``:
        before the dataset's new prompts (a conversation's next turns).

        Raises ServiceUnavailable when Redis fails mid-chunk: then some of the chunk's
        messages may be in Redis and some not, so nothing is sent again blindly; a re-run
        of ``datagen enqueue`` sends exactly the missing ones.
        """
        if not sample_ids:
            return
        try:
            with self.app.producer_or_acquire() as producer, \
                    producer.batch(max_size=BATCH_SIZE):
                sender = GenerateSender(self.app, producer, dataset, stamp,
                                        AHEAD_PRIORITY if ahead else PROMPT_PRIORITY)
                for sid in sample_ids:
                    sender.send(sid)
        except BatchPublishError as exc:
            raise ServiceUnavailable(
                f"Redis failed while publishing {dataset}'s messages ({exc.__cause__!r}); "
                "some of them may be queued. Run `datagen enqueue` again (or let the "
                "workers' sweep do it): it publishes each queued prompt Redis does not hold."
            ) from exc

    def publish_all(self, dataset: str, stamp: str, sample_ids: Sequence[str],
                    ahead: bool = False) -> None:
        for start in range(0, len(sample_ids), BATCH_SIZE):
            self.publish(dataset, stamp, sample_ids[start : start + BATCH_SIZE], ahead)

    def announce(self, datasets: Sequence[str]) -> None:
        """Ask running workers to consume these queues (fire and forget, no replies)."""
        for name in datasets:
            self.app.control.add_consumer(queue_name(name), reply=False)
