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

from common.keys import PROMPT_PRIORITY

GENERATE_TASK = "datagen.generate"
STAMP = "dataset"
# kombu's Redis transport pops a queue's lower priority numbers first (each priority step
# is a list of its own, BRPOP naming step 0's lists first). A conversation's next turn
# goes ahead of new prompts, so its prefix (the turn before, prompt and answer) is still
# in the server's prefix cache when it is sent; each list stays first in, first out
# (the two steps are named in common/keys.py).


def send_generate(app: Celery, producer: Producer, queue: str, dataset: str, sample_id: str,
                  stamp: str, priority: int = PROMPT_PRIORITY) -> None:
    """Send one sample's message on ``producer`` (declared by the caller: ``declare=[]``)."""
    app.send_task(
        GENERATE_TASK, kwargs={"dataset": dataset, "sample_id": sample_id},
        queue=queue, producer=producer, declare=[], add_to_parent=False,
        ignore_result=True, priority=priority, stamped_headers=[STAMP], **{STAMP: stamp},
    )


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
