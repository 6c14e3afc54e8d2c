"""Publishing one message per prompt: the producer's path against Celery's own.

µs per message, side by side on the same sample ids, each into an emptied queue:
  * ``send_task`` per message in ``Producer.batch`` with Celery's defaults;
  * ``send_task`` per message with the producer's options (the producer's path before
    the template, and still its fallback);
  * the producer's ``Publisher.publish``: one prototype message per chunk from Celery and
    kombu, copied per sample id, and one ``LPUSH`` for the whole chunk.
All three put the same Celery protocol-2 envelope in the queue.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from common.celery_app import GENERATE_TASK, STAMP, make_celery
from common.keys import queue_name
from common.publish import Publisher
from ops.bench.harness import bench_settings, fresh_redis
from ops.bench.report import Summary, table

DATASET, STAMP_VALUE = "pubbench", "pubbench@0"


def _bare_send_task(app: Any, ids: list[str]) -> None:
    """``send_task`` with Celery's defaults (saferepr of the arguments, declare per call)."""
    queue = queue_name(DATASET)
    with app.producer_or_acquire() as producer, producer.batch(max_size=1000):
        for sid in ids:
            app.send_task(GENERATE_TASK, kwargs={"dataset": DATASET, "sample_id": sid},
                          queue=queue, producer=producer, ignore_result=True,
                          add_to_parent=False, stamped_headers=[STAMP], **{STAMP: STAMP_VALUE})


def _tuned_send_task(app: Any, ids: list[str]) -> None:
    pub = Publisher(app)
    for start in range(0, len(ids), 1000):
        with app.producer_or_acquire() as producer:
            pub._publish_via_celery(producer, queue_name(DATASET), DATASET, STAMP_VALUE,
                                    ids[start:start + 1000])


def run(n: int, reps: int) -> dict[str, Summary]:
    r = fresh_redis()
    app = make_celery(bench_settings("sqlite://", "http://127.0.0.1:9"))
    paths: dict[str, Callable[[list[str]], None]] = {
        "send_task with Celery's defaults": lambda ids: _bare_send_task(app, ids),
        "send_task with the producer's options (its fallback)":
            lambda ids: _tuned_send_task(app, ids),
        "Publisher.publish (the producer's: template + one LPUSH a chunk)":
            lambda ids: Publisher(app).publish_all(DATASET, STAMP_VALUE, ids),
    }
    times: dict[str, list[float]] = {k: [] for k in paths}
    sizes: dict[str, int] = {}
    for rep in range(reps):
        ids = [f"h{rep:02d}{k:014x}" for k in range(n)]
        for name, fn in paths.items():
            r.delete(queue_name(DATASET))
            t0 = time.perf_counter()
            fn(ids)
            times[name].append(1e6 * (time.perf_counter() - t0) / n)
            assert r.llen(queue_name(DATASET)) == n, name
            sizes[name] = len(r.lindex(queue_name(DATASET), 0) or b"")
    r.delete(queue_name(DATASET))
    app.close()
    out = {k: Summary.of(v) for k, v in times.items()}
    table(f"publishing paths, {n:,} messages, {reps} reps (µs per message, median [min-max])",
          ["path", "µs/message", "messages/s", "message bytes"],
          [(k, v.fmt(1), f"{1e6 / v.median:,.0f}", sizes[k]) for k, v in out.items()])
    return out
