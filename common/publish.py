"""Publishing one small message per prompt: dataset and sample id, never token lists.

``send_task`` costs the producer far more per message than anything else it does (option
merging, routing, signals, a dict rebuilt four times, one pipeline command each). A
chunk's messages differ only in the sample id and two fresh ids, so one prototype per chunk
is built by Celery's and kombu's own functions, as ``send_task`` builds a message, and each
message is a copy with those fields replaced; the whole chunk goes to Redis in one LPUSH.
When the prototype cannot be reproduced exactly (another transport, compression, queue
expiry, a Celery or kombu that forms messages differently) ``send_task`` is used instead.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from celery import Celery
from celery.utils.nodenames import anon_nodename
from kombu.entity import maybe_delivery_mode
from kombu.serialization import dumps as serialize
from kombu.utils.json import dumps as json_dumps

from common.celery_app import GENERATE_TASK, STAMP
from common.keys import queue_name

BATCH_SIZE = 1000
# Placeholders for the per-message fields of the prototype. Only the prototype is ever
# cut at them, so a sample id holding the same text is harmless.
_TASK_ID, _SAMPLE, _KWARGSREPR, _BODY, _TAG = (
    f"\0{name}\0" for name in ("task-id", "sample", "kwargsrepr", "body", "delivery-tag")
)


def _kwargs(dataset: str, sample_id: str) -> dict[str, str]:
    return {"dataset": dataset, "sample_id": sample_id}


def _kwargsrepr(dataset: str, sample_id: str) -> str:
    # What Celery's saferepr gives for two short strings, without its generic (slow) walk.
    return f"{{'dataset': {dataset!r}, 'sample_id': {sample_id!r}}}"


def _task_options(dataset: str, stamp: str, sample_id: str) -> dict[str, Any]:
    """send_task's options for one prompt, the same on both publishing paths."""
    return {
        "ignore_result": True,
        "stamped_headers": [STAMP],
        STAMP: stamp,
        "argsrepr": "()",
        "kwargsrepr": _kwargsrepr(dataset, sample_id),
    }


class _ChunkMessages:
    """One queue's messages: a prototype built by Celery and kombu, copied per sample id.

    The prototype carries placeholders in the per-message fields; its JSON, cut at them,
    is the template every message is joined from, so a message costs a few string
    escapes instead of building and encoding four dicts.
    """

    def __init__(self, app: Celery, channel: Any, queue: str, dataset: str, stamp: str,
                 origin: str) -> None:
        self.channel, self.dataset = channel, dataset
        self.serializer: str = app.conf.task_serializer
        headers, properties, body, _event = app.amqp.as_task_v2(
            _TASK_ID, GENERATE_TASK, kwargs=_kwargs(dataset, _SAMPLE),
            reply_to=app.thread_oid, origin=origin, **_task_options(dataset, stamp, _SAMPLE),
        )
        headers["kwargsrepr"] = _KWARGSREPR
        # Where send_task_message and Producer.publish would take it from.
        properties["delivery_mode"] = maybe_delivery_mode(
            app.amqp.queues[queue].exchange.delivery_mode or app.conf.task_default_delivery_mode
        )
        content_type, content_encoding, payload = serialize(body, serializer=self.serializer)
        message = channel.prepare_message(
            payload, 0, content_type, content_encoding, headers, properties
        )
        channel._inplace_augment_message(message, "", queue)
        self.body_encoding: str = message["properties"]["body_encoding"]
        self.key: str = channel._q_for_pri(
            queue, channel._get_message_priority(message, reverse=False)
        )
        if not isinstance(payload, str):
            raise _TemplateMismatch(f"{self.serializer} gives {type(payload).__name__} bodies")
        self.body_parts = _cut(payload, {_SAMPLE: 1})
        message["body"], message["properties"]["delivery_tag"] = _BODY, _TAG
        self.prototype: dict[str, Any] = message
        self.parts = _cut(json_dumps(message), {_TASK_ID: 3, _KWARGSREPR: 1, _BODY: 1, _TAG: 1})

    def fields(self, sample_id: str) -> dict[str, str]:
        """The per-message values, fresh ids included."""
        body = _join(self.body_parts, {_SAMPLE: json.dumps(sample_id)})
        return {
            _TASK_ID: str(uuid.uuid4()),
            _KWARGSREPR: _kwargsrepr(self.dataset, sample_id),
            _BODY: self.channel.encode_body(body, self.body_encoding)[0],
            _TAG: self.channel._next_delivery_tag(),
        }

    def message(self, sample_id: str) -> str:
        return self.render(self.fields(sample_id))

    def render(self, fields: dict[str, str]) -> str:
        return _join(self.parts, {k: json.dumps(v) for k, v in fields.items()})

    def reference(self, fields: dict[str, str]) -> str:
        """The same message as kombu itself would encode it: the template's check."""
        proto = self.prototype
        headers = {**proto["headers"], "id": fields[_TASK_ID], "root_id": fields[_TASK_ID],
                   "kwargsrepr": fields[_KWARGSREPR]}
        properties = {**proto["properties"], "correlation_id": fields[_TASK_ID],
                      "delivery_tag": fields[_TAG]}
        message = {**proto, "body": fields[_BODY], "headers": headers, "properties": properties}
        return str(json_dumps(message))


def _cut(text: str, expected: dict[str, int]) -> list[str]:
    """``text`` split around the JSON strings of the placeholders: literal text at even
    indexes, a placeholder at odd ones. Raises if one is missing or not where expected."""
    quoted = {json.dumps(p): p for p in expected}
    pieces = re.split("(" + "|".join(map(re.escape, quoted)) + ")", text)
    parts = [quoted.get(piece, piece) if k % 2 else piece for k, piece in enumerate(pieces)]
    found = {p: parts[1::2].count(p) for p in expected}
    if found != expected:
        raise _TemplateMismatch(f"placeholders {found}, expected {expected}")
    return parts


def _join(parts: list[str], values: dict[str, str]) -> str:
    return "".join(values[p] if k % 2 else p for k, p in enumerate(parts))


class _TemplateMismatch(Exception):
    """Celery or kombu formed the prototype in a way the template cannot reproduce."""


class Publisher:
    """Publishes a chunk of prompts' messages with one LPUSH."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        # as_task_v2 would look the node name up again for every message.
        self.origin = anon_nodename()

    def publish(self, dataset: str, stamp: str, sample_ids: Sequence[str]) -> None:
        """Publish a chunk; returns only once every message of it is in Redis."""
        if not sample_ids:
            return
        queue = queue_name(dataset)
        with self.app.producer_or_acquire() as producer:
            # Declared once per chunk, not once per message as send_task would.
            producer.maybe_declare(self.app.amqp.queues[queue])
            channel = producer.channel
            chunk = self._chunk_messages(channel, queue, dataset, stamp, sample_ids[0])
            if chunk is None:
                self._publish_via_celery(producer, queue, dataset, stamp, sample_ids)
                return
            payloads = [chunk.message(sid) for sid in sample_ids]
            # One LPUSH of many values leaves the list as that many LPUSHes in order would,
            # and it is atomic: a producer killed mid-chunk leaves all of it or none.
            with channel.conn_or_acquire() as client:
                client.lpush(chunk.key, *payloads)

    def _chunk_messages(
        self, channel: Any, queue: str, dataset: str, stamp: str, probe: str
    ) -> _ChunkMessages | None:
        """The chunk's template, or None when only send_task can form its messages."""
        if not _pushes_directly(self.app, channel, queue):
            return None
        try:
            chunk = _ChunkMessages(self.app, channel, queue, dataset, stamp, self.origin)
        except _TemplateMismatch:
            return None
        # Any difference means the template no longer matches what kombu would store.
        fields = chunk.fields(probe)
        return chunk if chunk.render(fields) == chunk.reference(fields) else None

    def _publish_via_celery(
        self, producer: Any, queue: str, dataset: str, stamp: str, sample_ids: Sequence[str]
    ) -> None:
        with producer.batch(max_size=BATCH_SIZE):
            for sid in sample_ids:
                self.app.send_task(
                    GENERATE_TASK, kwargs=_kwargs(dataset, sid), queue=queue,
                    producer=producer, add_to_parent=False, declare=[],
                    **_task_options(dataset, stamp, sid),
                )

    def publish_all(self, dataset: str, stamp: str, sample_ids: Sequence[str]) -> None:
        for start in range(0, len(sample_ids), BATCH_SIZE):
            self.publish(dataset, stamp, sample_ids[start : start + BATCH_SIZE])

    def announce(self, datasets: Sequence[str]) -> None:
        """Ask running workers to consume these queues (fire and forget, no replies)."""
        for name in datasets:
            self.app.control.add_consumer(queue_name(name), reply=False)


def _pushes_directly(app: Celery, channel: Any, queue: str) -> bool:
    """Whether kombu's Redis transport would store this queue's messages with a bare LPUSH
    of an uncompressed body; anything else goes the way of send_task."""
    from kombu.transport.redis import Channel as RedisChannel

    return (
        isinstance(channel, RedisChannel)
        and not app.conf.task_compression
        and not (channel._expires and queue in channel._expires)
    )
