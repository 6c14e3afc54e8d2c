"""The request log: one record per request that reached /generate, rejected ones included.

Tests and benchmarks use it as ground truth ("the server saw exactly these prompts, this
often, and answered like this"), e.g. to prove that a retry did not duplicate work. It is
kept in memory (bounded) for `GET /sim/requests` and optionally appended to a JSONL file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import IO, Any

log = logging.getLogger(__name__)


def input_sha1(input_ids: Any) -> str | None:
    """sha1 of the ids as compact JSON, so any client can compute the same key."""
    if not isinstance(input_ids, list):
        return None
    return hashlib.sha1(json.dumps(input_ids, separators=(",", ":")).encode()).hexdigest()


@dataclass
class RequestRecord:
    """What the log keeps about one request; filled in as the request progresses."""

    rid: str | None
    arrived_ts: float
    prompt_tokens: int
    input_sha1: str | None
    max_new_tokens: int | None
    stream: bool = False
    finished_ts: float | None = None
    #: HTTP status sent; 0 when the connection was dropped without a response.
    status: int = 0
    #: stop | length | abort | error | disconnect (server dropped the connection). The
    #: default covers a handler cancelled by a client disconnect: SGLang aborts those.
    finish_type: str = "abort"
    completion_tokens: int = 0
    #: Why it ended that way when that is not obvious (error text, fault name...).
    detail: str | None = "client disconnected"
    #: The body's sampling_params as received (an object), else None.
    sampling_params: dict[str, Any] | None = None
    #: The client's address and port: requests on one kept-alive connection share it.
    peer: str | None = None

    @classmethod
    def from_body(cls, body: Any, arrived_ts: float) -> RequestRecord:
        """Best-effort record of a body that may be invalid."""
        body = body if isinstance(body, dict) else {}
        ids = body.get("input_ids")
        params = body.get("sampling_params")
        max_new = params.get("max_new_tokens") if isinstance(params, dict) else None
        rid = body.get("rid")
        return cls(
            rid=rid if isinstance(rid, str) else None,
            arrived_ts=arrived_ts,
            prompt_tokens=len(ids) if isinstance(ids, list) else 0,
            input_sha1=input_sha1(ids),
            max_new_tokens=max_new if isinstance(max_new, int) else None,
            stream=body.get("stream") is True,
            sampling_params=params if isinstance(params, dict) else None,
        )

    def finish(
        self, status: int, finish_type: str, completion_tokens: int = 0, detail: str | None = None
    ) -> None:
        """Mark the outcome (the last call wins)."""
        self.status = status
        self.finish_type = finish_type
        self.completion_tokens = completion_tokens
        self.detail = detail


class RequestLog:
    """Bounded in-memory log plus an optional JSONL file (line-buffered)."""

    def __init__(self, path: str | None, capacity: int) -> None:
        self.entries: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._file: IO[str] | None = None
        if path:
            self._file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def add(self, record: RequestRecord) -> None:
        """Store a finished record (stamps finished_ts if unset)."""
        if record.finished_ts is None:
            record.finished_ts = time.time()
        entry = dict(vars(record))  # flat record: cheaper than dataclasses.asdict
        self.entries.append(entry)
        if self._file is not None:
            try:
                self._file.write(json.dumps(entry, separators=(",", ":")) + "\n")
            except OSError:
                log.exception("cannot append to the request log; file logging stops")
                self._file = None

    def snapshot(self, limit: int | None = None, rid_prefix: str | None = None) -> list[Any]:
        """Entries oldest first, optionally only rids with a prefix and only the last N."""
        items = list(self.entries)
        if rid_prefix:
            items = [e for e in items if (e["rid"] or "").startswith(rid_prefix)]
        if limit is not None:
            items = items[-limit:] if limit > 0 else []
        return items

    def clear(self) -> None:
        """Forget the in-memory entries (the JSONL file is an archive: it is kept)."""
        self.entries.clear()

    def close(self) -> None:
        """Close the JSONL file."""
        if self._file is not None:
            self._file.close()
            self._file = None
