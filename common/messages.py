"""The generate task's message: the one module that builds it and reads it.

A message carries references, never prompts or token lists: the task's name, the
kwargs ``{"dataset": ..., "sample_id": ...}``, and the dataset's stamp as a stamped
header, which ``revoke_by_stamped_headers({STAMP: stamp})`` matches when the dataset
closes. Celery encodes it (protocol 2, JSON); ``sample_of`` reads one back from what
kombu's Redis transport stores in a queue or in its unacked hash.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from celery import Celery
from kombu import Producer
from kombu.utils.uuid import uuid

from common.keys import PROMPT_PRIORITY, queue_name

GENERATE_TASK = "datagen.generate"
STAMP = "dataset"
# kombu's Redis transport pops a queue's lower priority numbers first (each priority step
# is a list of its own, BRPOP naming step 0's lists first). A conversation's next turn
# goes ahead of new prompts, so its prefix (the turn before, prompt and answer) is still
# in the server's prefix cache when it is sent; each list stays first in, first out
# (the two steps are named in common/keys.py).


class GenerateSender:
    """Sends the generate task's messages for one dataset on one producer, built and sent
    by Celery's own ``app.amqp.create_task_message`` and ``send_task_message``, the two
    steps ``send_task`` is made of.

    ``send_task`` costs 120-150 µs of Python a message; most of it is work a batch of
    same-shaped messages needs once: routing, configuration lookups, and ``saferepr`` of
    the arguments for the log line. Here the route is looked up once, and the arguments'
    log line is Python's ``repr`` of the two strings (what ``saferepr`` gives too, but for
    quotes, backslashes and a few escapes it spells otherwise): about 55 µs a message.
    The messages are otherwise those ``send_task`` makes, field for field.
    """

    def __init__(self, app: Celery, producer: Producer, dataset: str, stamp: str,
                 priority: int = PROMPT_PRIORITY) -> None:
        amqp = app.amqp
        self._producer, self._dataset, self._stamp = producer, dataset, stamp
        self._create, self._send = amqp.create_task_message, amqp.send_task_message
        queue = queue_name(dataset)
        # Declared once here, and each message sent with declare=[]: by default each one
        # binds a copy of the queue to the channel, a fifth of send_task's cost.
        producer.maybe_declare(amqp.queues[queue])
        self._options = amqp.router.route(
            {"queue": queue, "priority": priority, "declare": []}, GENERATE_TASK)
        self._reply_to = app.thread_oid
        # Sent from a worker's task (a conversation's next turn), the message names that
        # task as its parent, as send_task's would.
        parent = app.current_worker_task
        self._parent_id = parent.request.id if parent else None
        self._root_id = (parent.request.root_id or parent.request.id) if parent else None
        self._sent_event = app.conf.task_send_sent_event
        self._repr_max = amqp.kwargsrepr_maxsize

    def send(self, sample_id: str) -> None:
        kwargs = {"dataset": self._dataset, "sample_id": sample_id}
        message = self._create(
            uuid(), GENERATE_TASK, (), kwargs, reply_to=self._reply_to,
            root_id=self._root_id, parent_id=self._parent_id,
            create_sent_event=self._sent_event, ignore_result=True,
            argsrepr="()", kwargsrepr=repr(kwargs)[: self._repr_max],
            stamped_headers=[STAMP], **{STAMP: self._stamp},
        )
        self._send(self._producer, GENERATE_TASK, message, **self._options)


def unacked_entry(raw: bytes | str | None) -> tuple[dict[str, Any], str] | None:
    """(message, queue) of one record of kombu's unacked hash, which it stores as
    ``[message, exchange, routing key]``; None for a missing or unreadable record."""
    if raw is None:
        return None
    try:
        payload, _exchange, routing_key = json.loads(raw)
    except (ValueError, TypeError):
        return None
    return payload, str(routing_key)


def sample_of(payload: dict[str, Any]) -> tuple[str, str] | None:
    """(dataset, sample_id) of one stored task message, or None if it is not ours."""
    try:
        body = payload["body"]
        if payload.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        kwargs = json.loads(body)[1]
        return str(kwargs["dataset"]), str(kwargs["sample_id"])
    except (KeyError, IndexError, TypeError, ValueError):
        return None
