"""The overhead baseline: a bare Celery task that only makes the pipeline's HTTP call.

Same app options (``common.celery_app.celery_config``), same task name and queues, same
messages (the real producer publishes them), threads pool at the same concurrency. The
task posts the same ``/generate`` body the pipeline would (ids loaded at start from
``DATAGEN_BENCH_PAYLOADS``), streamed where the pipeline streams it (a ``drain``
dataset's request: its events read to the end, the last one parsed), parses the answer
and returns: no SQL, no ledger. The call goes through ``requests``, one session per
thread, as the pipeline's own ``SGLangClient`` makes it.

    celery -A bench.bare_worker worker --pool=threads -c 64 -Q datagen.q.B1,...
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import requests
from celery import Task

from common.celery_app import make_celery
from common.messages import GENERATE_TASK
from common.rids import new_rid
from common.settings import Settings
from common.sglang_stream import stream_params

settings = Settings.from_env()
app = make_celery(settings, main="bench-bare")
app.conf.update(worker_pool="threads", worker_concurrency=settings.concurrency)
_PAYLOADS: dict[str, Any] = json.loads(
    open(os.environ["DATAGEN_BENCH_PAYLOADS"], encoding="utf-8").read()  # noqa: SIM115
) if os.environ.get("DATAGEN_BENCH_PAYLOADS") else {}
_local = threading.local()
_SERVER = settings.sglang_urls[0]


def _session() -> requests.Session:
    session = getattr(_local, "session", None)
    if session is None:
        session = _local.session = requests.Session()
    return session


@app.task(name=GENERATE_TASK, bind=True, acks_late=True, shared=False)
def generate(self: Task, dataset: str, sample_id: str) -> int:
    p = _PAYLOADS[f"{dataset}/{sample_id}"]
    rid = new_rid(dataset, _SERVER)  # the pipeline's own rid: the same body, byte for byte
    stream = bool(p.get("stream"))
    body = {"rid": rid, "input_ids": p["input_ids"],
            "sampling_params": stream_params(p["sampling"]) if stream else p["sampling"],
            "stream": stream}
    with _session().post(f"{_SERVER}/generate", json=body, stream=stream,
                         timeout=(settings.connect_timeout_s, settings.request_timeout_s)
                         ) as resp:
        resp.raise_for_status()
        if not stream:
            return int(resp.json()["meta_info"]["completion_tokens"])
        last = b""
        for line in resp.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                last = line
        return int(json.loads(last[len(b"data: "):])["meta_info"]["completion_tokens"])
