"""Publishing one message per prompt: the producer's path against cheaper ones.

µs per message, side by side on the same sample ids, each into an emptied queue:
  * ``send_task`` per message in ``Producer.batch`` with Celery's defaults;
  * the producer's ``Publisher.publish`` (the same, with its own tuning);
  * a prebuilt envelope: one real message from ``Publisher`` as a template, per message a
    new task id and body, pipelined ``LPUSH`` (what a dedicated fast path would do).
All three put the same Celery protocol-2 envelope in the queue.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from common.celery_app import GENERATE_TASK, STAMP, make_celery
from common.keys import queue_name
from ops.bench.harness import bench_settings, fresh_redis, publisher
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


class Envelope:
    """A real producer message with the per-task fields replaced."""

    def __init__(self, r: redis.Redis, app: Any) -> None:
        publisher(app).publish(DATASET, STAMP_VALUE, ["template"])
        raw = r.rpop(queue_name(DATASET))
        assert raw is not None, "no template message"
        self.template: dict[str, Any] = json.loads(raw)  # type: ignore[arg-type]
        self.embed = json.loads(base64.b64decode(self.template["body"]))[2]
        self.r = r

    def message(self, sid: str) -> bytes:
        task_id = str(uuid.uuid4())
        kwargs = {"dataset": DATASET, "sample_id": sid}
        body = json.dumps([[], kwargs, self.embed]).encode()
        headers = {**self.template["headers"], "id": task_id, "root_id": task_id,
                   "kwargsrepr": repr(kwargs)}
        props = {**self.template["properties"], "correlation_id": task_id,
                 "delivery_tag": str(uuid.uuid4())}
        return json.dumps({**self.template, "body": base64.b64encode(body).decode(),
                           "headers": headers, "properties": props}).encode()

    def publish(self, ids: list[str]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for start in range(0, len(ids), 1000):
            pipe.lpush(queue_name(DATASET), *(self.message(s) for s in ids[start:start + 1000]))
        pipe.execute()


def run(n: int, reps: int) -> dict[str, Summary]:
    r = fresh_redis()
    app = make_celery(bench_settings("sqlite://", "http://127.0.0.1:9"))
    env = Envelope(r, app)
    paths: dict[str, Callable[[list[str]], None]] = {
        "send_task with Celery's defaults": lambda ids: _bare_send_task(app, ids),
        "Publisher.publish (the producer's, send_task per message)":
            lambda ids: publisher(app).publish(DATASET, STAMP_VALUE, ids),
        "prebuilt envelope + pipelined LPUSH": env.publish,
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
