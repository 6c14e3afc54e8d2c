"""Keep a worker consuming every dataset's queue, including datasets added after it started.

At start the worker consumes the queues of every dataset SQL or Redis knows. A background
thread then watches for new datasets and asks this worker (and only it) to add their queues
through a control message, so the consumer changes in its own thread, never from ours.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import bootsteps

from common.keys import queue_name
from common.ledger import Ledger
from common.pairing import pair
from workers.context import get_context

log = logging.getLogger(__name__)
SYNC_INTERVAL_S = 5.0


class DatasetQueues(bootsteps.StartStopStep):
    """Consumer bootstep: subscribe to every dataset queue, now and as datasets appear."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, c: Any) -> None:
        ctx = get_context(c.app)
        # Before subscribing to anything: a Redis that holds another database's queues
        # stops the worker here (raised from a bootstep, Celery exits with code 1).
        pair(ctx.store, ctx.ledger)
        led = ctx.ledger
        consuming = {q.name for q in c.task_consumer.queues}
        # SQL's datasets too: a Redis that lost its data knows none until it is rebuilt.
        for name in sorted(set(led.known()) | set(ctx.store.dataset_names())):
            if queue_name(name) not in consuming:
                c.add_task_queue(queue_name(name))
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._watch, args=(c.app, c.hostname, led), daemon=True,
            name="datagen-queue-sync",
        )
        self._thread.start()

    def stop(self, c: Any) -> None:
        self._stop.set()

    def _watch(self, app: Any, hostname: str, led: Ledger) -> None:
        asked: set[str] = set()
        while not self._stop.wait(SYNC_INTERVAL_S):
            try:
                consuming = {q.name for q in app.amqp.queues.consume_from.values()}
                for name in led.known():
                    q = queue_name(name)
                    if q not in consuming and q not in asked:
                        app.control.add_consumer(q, destination=[hostname], reply=False)
                        asked.add(q)
            except Exception:
                log.exception("dataset queue sync failed; will try again")
