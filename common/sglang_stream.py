"""A streamed /generate read to its end: the one signal SGLang gives that a request has
left its waiting queue is its first output token.

A worker asks for a stream only to learn that moment: ``stream_interval`` is set past
the request's ``max_new_tokens``, so SGLang sends the first token's chunk (it streams a
chunk whenever ``len(output_ids) % stream_interval == 1``) and then only the final one.
Until the first chunk the request is queued inside the server and has produced nothing,
so a dataset closing under ``drain`` may abort it at no cost (common/closing.py).

The final chunk holds the whole output when the server streams cumulatively, only what
followed the first chunk with ``--incremental-streaming-output``; ``meta_info`` counts
are cumulative either way, which tells the two apart without asking /server_info.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import requests

from common.errors import PermanentError, TransientError

_DATA = b"data: "
_DONE = b"[DONE]"


def stream_params(sampling_params: dict[str, Any]) -> dict[str, Any]:
    """The request's sampling with a ``stream_interval`` that streams only the first
    token's chunk and the final one."""
    cap = int(sampling_params.get("max_new_tokens") or 0)
    return {**sampling_params, "stream_interval": cap + 2}


def is_event_stream(resp: requests.Response) -> bool:
    """Whether the answer is a stream; a server that answers a stream request with one
    JSON body (whatever its version) is read as a plain answer."""
    return resp.headers.get("Content-Type", "").startswith("text/event-stream")


def _lines(resp: requests.Response) -> Iterator[bytes]:
    """The answer's lines as they arrive. A chunked answer (SGLang's: an event a chunk) is
    read a chunk at a time, whatever its size: a final chunk holding a long output's ids
    is then one read, not one per 512 bytes as ``iter_lines`` would make it. An answer
    that is not chunked is read 512 bytes at a time, since a read of no fixed size would
    wait for its end, and the first chunk's moment with it."""
    pending = b""
    for piece in resp.iter_content(chunk_size=None if resp.raw.chunked else 512):
        *lines, pending = (pending + piece).split(b"\n")
        yield from lines
    if pending:
        yield pending


def _events(resp: requests.Response, server: str) -> Iterator[dict[str, Any]]:
    """The stream's events, read to the end of the body (past ``[DONE]``): a response read
    whole gives its connection back to the session's pool, one left unread is closed, and
    every request would open a new connection."""
    try:
        done = False
        for line in _lines(resp):
            if done or not line.startswith(_DATA):
                continue
            data = line[len(_DATA):].strip()
            if data == _DONE:
                done = True
                continue
            yield json.loads(data)
    except ValueError as exc:
        raise TransientError(f"{server}: a stream event is not JSON", server=server) from exc
    except requests.RequestException as exc:
        raise TransientError(f"{server}: the stream broke ({exc})", server=server) from exc


def _raise_error(event: dict[str, Any], server: str) -> None:
    """An error SGLang sends inside a stream (HTTP 200 already sent), sorted as the same
    error answered over HTTP would be."""
    error = event["error"]
    if isinstance(error, dict):
        code, message = error.get("code"), error.get("message", error)
    else:
        code, message = None, error
    status = int(code) if isinstance(code, int) else 500
    cls = TransientError if status >= 500 or status in (408, 429) else PermanentError
    raise cls(f"{server}: HTTP {status}: {message}", server=server, status=status)


def _raise_status_abort(finish: Any, server: str) -> None:
    """A scheduler abort carrying a status (e.g. 503 queue full) is an HTTP error when not
    streaming: the same error here."""
    if isinstance(finish, dict) and finish.get("type") == "abort" and finish.get("status_code"):
        _raise_error({"error": {"code": finish["status_code"],
                                "message": finish.get("message", "aborted")}}, server)


def read_stream(resp: requests.Response, server: str,
                on_start: Callable[[], None]) -> dict[str, Any]:
    """The body a non-streamed /generate would have answered, read from the stream;
    ``on_start`` is called once, at the first chunk that carries output."""
    started, text = False, ""
    ids: list[Any] = []
    last: dict[str, Any] | None = None
    for event in _events(resp, server):
        if "error" in event:
            _raise_error(event, server)
        chunk_ids = list(event.get("output_ids") or [])
        meta = event.get("meta_info") or {}
        if not started and chunk_ids:
            started = True
            on_start()
        count = meta.get("completion_tokens")
        if count != len(chunk_ids) and count == len(ids) + len(chunk_ids):
            # Incremental streaming: this chunk continues the ones before it.
            chunk_ids, event["text"] = ids + chunk_ids, text + str(event.get("text", ""))
        ids, text, last = chunk_ids, str(event.get("text", "")), event
    if last is None:
        raise TransientError(f"{server}: the stream ended without an answer", server=server)
    _raise_status_abort((last.get("meta_info") or {}).get("finish_reason"), server)
    return {**last, "output_ids": ids, "text": text}
