"""A client for SGLang's native /generate, with errors sorted into retryable or not.

Requests go out as token ids with a unique rid and explicit sampling parameters; the
answer's ``output_ids`` are checked against ``meta_info.completion_tokens``.

Every call goes through ``requests``: one ``Session`` per thread (its pool keeps one
kept-alive connection per server), timeouts ``(connect_timeout_s, read_timeout_s)``, no
retries of its own (a failed call is the pipeline's to retry, counted or not). Failures
are sorted here:

    ServerUnreachable  no connection was made (refused, name not resolved, connect timeout,
                       proxy refused): the server is at fault, not counted as an attempt
    TransientError     timeouts, resets, a connection closed unanswered, 408/429/5xx, an
                       answer that is not JSON
    PermanentError     any other 4xx (with SGLang's message), an answer without meta_info
    IncompatibleServer no output_ids, or a count that does not match them
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import requests
from urllib3.exceptions import NameResolutionError, NewConnectionError

from common.errors import (
    IncompatibleServer,
    PermanentError,
    ServerUnreachable,
    TransientError,
)
from common.rids import server_tag, tag_of
from common.routing import LoadRouter
from common.sglang_stream import is_event_stream, read_stream, stream_params

log = logging.getLogger(__name__)
NEEDED_VERSION = "SGLang >= 0.5.5"
RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}
# Most servers a close aborts on at once (one thread each).
ABORT_THREADS = 16
ABORT_READ_TIMEOUT_S = 5.0
# /parse_function_call runs a regex or two on the server: seconds mean it is stuck.
PARSE_READ_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Completion:
    rid: str
    server: str
    output_ids: list[int]
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    finish_type: str
    finish_detail: dict[str, Any]
    e2e_latency_s: float | None
    sampling_params: dict[str, Any] | None = None  # as sent; None where not known


def _error_message(resp: requests.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.content[:500].decode("utf-8", "replace") or resp.reason
    err = body.get("error", body.get("message", body)) if isinstance(body, dict) else body
    if isinstance(err, dict):
        err = err.get("message", err)
    return str(err)[:1000]


def parse_completion(body: Any, rid: str, server: str) -> Completion:
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise PermanentError(f"{server}: /generate answered without meta_info", server=server)
    meta = body["meta_info"]
    ids = body.get("output_ids")
    if ids is None:
        raise IncompatibleServer(
            f"{server}: /generate returned no output_ids; datagen needs {NEEDED_VERSION} "
            "(earlier versions return text only)",
            server=server,
        )
    count = meta.get("completion_tokens")
    if count != len(ids):
        raise IncompatibleServer(
            f"{server}: len(output_ids)={len(ids)} but completion_tokens={count}; "
            f"SGLang 0.5.4 has this bug (sgl-project/sglang#10896), use {NEEDED_VERSION}",
            server=server,
        )
    finish = meta.get("finish_reason") or {}
    if isinstance(finish, str):
        finish = {"type": finish}
    return Completion(
        rid=rid,
        server=server,
        output_ids=[int(i) for i in ids],
        text=str(body.get("text", "")),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        completion_tokens=int(count),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        reasoning_tokens=int(meta.get("reasoning_tokens") or 0),
        finish_type=str(finish.get("type", "unknown")),
        finish_detail=finish,
        e2e_latency_s=meta.get("e2e_latency"),
    )


def _raise_for_status(resp: requests.Response, server: str) -> None:
    """A non-200 answer as the error it is: retryable or not, with SGLang's message."""
    if resp.status_code in RETRYABLE_STATUS:
        raise TransientError(f"{server}: HTTP {resp.status_code}: {_error_message(resp)}",
                             server=server, status=resp.status_code)
    if resp.status_code != 200:
        raise PermanentError(f"{server}: HTTP {resp.status_code}: {_error_message(resp)}",
                             server=server, status=resp.status_code)


def _unreachable(server: str, exc: requests.ConnectionError) -> ServerUnreachable | None:
    """The error for a call that never reached the server (no connection was made), or
    None when the connection was made and then failed: the request may have run."""
    if isinstance(exc, requests.exceptions.ProxyError):
        return ServerUnreachable(f"{server}: proxy unreachable ({exc})", server=server)
    # requests wraps a failed connect in urllib3's MaxRetryError, whose reason says why.
    reason = getattr(exc.args[0] if exc.args else None, "reason", None)
    if isinstance(reason, NameResolutionError):
        return ServerUnreachable(f"{server}: name not resolved", server=server)
    if isinstance(reason, NewConnectionError):
        return ServerUnreachable(f"{server}: connection refused", server=server)
    return None


class SGLangClient:
    """Spreads requests over one or more servers, one ``requests`` session per thread."""

    def __init__(
        self,
        urls: tuple[str, ...],
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 1800.0,
        api_key: str = "",
        router: LoadRouter | None = None,
    ) -> None:
        self.urls = urls
        # Picks by the servers' loads when given; round robin otherwise.
        self.router = router
        self.timeout = (connect_timeout_s, read_timeout_s)
        self._next = itertools.cycle(urls)
        self._lock = threading.Lock()
        self._local = threading.local()
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._models: dict[str, str] = {}
        # Proxy settings are read from the environment once, here, per server (NO_PROXY
        # may exempt some and not others), and the sessions do not look again per request.
        self._proxies = {u: requests.utils.get_environ_proxies(u) for u in urls}

    def _session(self) -> requests.Session:
        session: requests.Session | None = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            session.headers.update(self.headers)
            session.trust_env = False
            self._local.session = session
        return session

    def _request(self, method: str, server: str, path: str, **kwargs: Any) -> requests.Response:
        return self._session().request(method, f"{server}{path}",
                                       proxies=self._proxies.get(server, {}), **kwargs)

    def _post(self, server: str, path: str, payload: dict[str, Any],
              read_timeout_s: float, stream: bool = False) -> requests.Response:
        """One POST on this thread's session, its failures sorted into the error tree."""
        try:
            return self._request("POST", server, path, json=payload, stream=stream,
                                 timeout=(self.timeout[0], read_timeout_s))
        except requests.ConnectTimeout as exc:
            raise ServerUnreachable(f"{server}: connect timed out", server=server) from exc
        except requests.ReadTimeout as exc:
            raise TransientError(
                f"{server}: timed out (read timeout={read_timeout_s}s)", server=server
            ) from exc
        except requests.exceptions.SSLError as exc:
            raise TransientError(f"{server}: TLS failed ({exc})", server=server) from exc
        except requests.ConnectionError as exc:
            unreachable = _unreachable(server, exc)
            if unreachable is not None:
                raise unreachable from exc
            raise TransientError(f"{server}: connection failed ({exc})", server=server) from exc
        except requests.RequestException as exc:  # a broken answer: cut short, bad chunks
            raise TransientError(f"{server}: connection failed ({exc})", server=server) from exc

    def pick_server(self) -> str:
        if self.router is not None:
            return self.router.pick()
        with self._lock:
            return next(self._next)

    def generate(
        self, server: str, rid: str, input_ids: list[int], sampling_params: dict[str, Any],
        on_start: Callable[[], None] | None = None,
    ) -> Completion:
        """The completion of one request. With ``on_start``, the request is streamed so as
        to call it once the server has started it (its first token: common/sglang_stream.py)."""
        stream = on_start is not None
        payload = {
            "rid": rid,
            "input_ids": input_ids,
            "sampling_params": stream_params(sampling_params) if stream else sampling_params,
            "stream": stream,
        }
        with self._post(server, "/generate", payload, self.timeout[1], stream=stream) as resp:
            if on_start is not None and resp.status_code == 200 and is_event_stream(resp):
                completion = parse_completion(read_stream(resp, server, on_start), rid, server)
            else:
                completion = parse_completion(self._json(server, resp), rid, server)
        # The sampling the model was sampled with (a stream's interval is transport).
        return dataclasses.replace(completion, sampling_params=sampling_params)

    def parse_function_call(self, server: str, text: str, tools: list[dict[str, Any]],
                            parser: str) -> tuple[str, list[dict[str, Any]]]:
        """(normal_text, calls) of a model's output by the server's own tool-call parser
        (SGLang's ``POST /parse_function_call``); each call ``{"tool_index", "name",
        "parameters"}`` with ``parameters`` a JSON string."""
        payload = {"text": text, "tools": tools, "tool_call_parser": parser}
        body = self._json(server, self._post(server, "/parse_function_call", payload,
                                             PARSE_READ_TIMEOUT_S))
        calls = body.get("calls") if isinstance(body, dict) else None
        if not isinstance(calls, list) or not isinstance(body.get("normal_text"), str):
            raise IncompatibleServer(f"{server}: /parse_function_call answered without "
                                     "normal_text and calls", server=server)
        return body["normal_text"], calls

    def _json(self, server: str, resp: requests.Response) -> Any:
        """The JSON of a 200 answer; any other sorted into the error tree."""
        _raise_for_status(resp, server)
        try:
            return resp.json()
        except ValueError as exc:
            raise TransientError(f"{server}: answer is not JSON", server=server) from exc

    def abort(self, rid: str) -> None:
        self.abort_many([rid])

    def abort_many(self, rids: Sequence[str]) -> int:
        """Abort requests, each on the server its rid names (on every server when it names
        none this client knows: the others ignore a rid they do not run). Each server's
        aborts go one after another, the servers' side by side, so closing a dataset spread
        over a fleet takes about one server's share. Returns the calls made."""
        tags = {server_tag(u): u for u in self.urls}
        by_server: dict[str, list[str]] = {u: [] for u in self.urls}
        for rid in rids:
            server = tags.get(tag_of(rid) or "")
            for s in (server,) if server else self.urls:
                by_server[s].append(rid)
        jobs = [(s, batch) for s, batch in by_server.items() if batch]
        if len(jobs) <= 1:
            return sum(self._abort_on(s, batch) for s, batch in jobs)
        with ThreadPoolExecutor(max_workers=min(len(jobs), ABORT_THREADS)) as pool:
            return sum(pool.map(lambda job: self._abort_on(*job), jobs))

    def _abort_on(self, server: str, rids: Sequence[str]) -> int:
        refused = 0
        for n, rid in enumerate(rids):
            try:
                resp = self._post(server, "/abort_request", {"rid": rid}, ABORT_READ_TIMEOUT_S)
            except TransientError as exc:  # ServerUnreachable included
                # A server that does not answer runs nothing to abort (or cannot be
                # reached to): waiting out a timeout per rid would only delay the others.
                log.warning("%s did not answer an abort (%s); skipped its %d other aborts",
                            server, exc, len(rids) - n - 1)
                return n + 1
            if resp.status_code != 200:
                refused += 1
                if refused == 1:  # said once a close: a missing admin key refuses them all
                    log.warning("%s refused an abort: HTTP %d: %s", server, resp.status_code,
                                _error_message(resp))
        return len(rids)

    def model(self, server: str) -> str:
        """The served model's name, asked once per server."""
        name = self._models.get(server)
        if name is None:
            try:
                info = self._request("GET", server, "/model_info", timeout=self.timeout[0] + 5)
                data = info.json() if info.status_code == 200 else {}
            except (requests.RequestException, ValueError):
                data = {}
            name = str(data.get("served_model_name") or data.get("model_path") or "unknown")
            if data:
                self._models[server] = name
        return name

    def check_servers(self) -> list[str]:
        """The servers that do not answer /health, with why."""
        down = []
        for server in self.urls:
            try:
                r = self._request("GET", server, "/health", timeout=(self.timeout[0], 30))
                if r.status_code != 200:
                    down.append(f"{server}: /health answered HTTP {r.status_code}")
            except requests.RequestException as exc:
                down.append(f"{server}: {exc.__class__.__name__}")
        return down
