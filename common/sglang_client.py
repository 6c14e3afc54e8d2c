"""A client for SGLang's native /generate, with errors sorted into retryable or not.

Requests go out as token ids with a unique rid and explicit sampling parameters; the
answer's ``output_ids`` are checked against ``meta_info.completion_tokens``.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any

import requests

from common.errors import (
    IncompatibleServer,
    PermanentError,
    ServerUnreachable,
    TransientError,
)

NEEDED_VERSION = "SGLang >= 0.5.5"
RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}


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


def _error_message(resp: requests.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500] or resp.reason
    err = body.get("error", body.get("message", body)) if isinstance(body, dict) else body
    if isinstance(err, dict):
        err = err.get("message", err)
    return str(err)[:1000]


def _refused(exc: requests.ConnectionError) -> bool:
    """Nothing listens (or resolves): the request never reached the server."""
    text = str(exc)
    return "NewConnectionError" in text or "NameResolutionError" in text


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


class SGLangClient:
    """Spreads requests over one or more servers, one HTTP session per thread."""

    def __init__(
        self,
        urls: tuple[str, ...],
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 1800.0,
        api_key: str = "",
    ) -> None:
        self.urls = urls
        self.timeout = (connect_timeout_s, read_timeout_s)
        self._next = itertools.cycle(urls)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._models: dict[str, str] = {}
        self._proxies = requests.utils.get_environ_proxies(urls[0]) if urls else {}

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            session.headers.update(self._headers)
            # Proxy settings are read from the environment once, here, instead of on every
            # request (requests' trust_env walks the environment and netrc each time).
            session.trust_env = False
            session.proxies = self._proxies
            self._local.session = session
        return session

    def pick_server(self) -> str:
        with self._lock:
            return next(self._next)

    def generate(
        self, server: str, rid: str, input_ids: list[int], sampling_params: dict[str, Any]
    ) -> Completion:
        payload = {
            "rid": rid,
            "input_ids": input_ids,
            "sampling_params": sampling_params,
            "stream": False,
        }
        try:
            resp = self._session().post(f"{server}/generate", json=payload, timeout=self.timeout)
        except requests.ConnectTimeout as exc:
            raise ServerUnreachable(f"{server}: connect timed out", server=server) from exc
        except requests.Timeout as exc:
            raise TransientError(f"{server}: timed out ({exc})", server=server) from exc
        except requests.ConnectionError as exc:
            if _refused(exc):
                raise ServerUnreachable(f"{server}: connection refused", server=server) from exc
            raise TransientError(f"{server}: connection failed ({exc})", server=server) from exc
        if resp.status_code in RETRYABLE_STATUS:
            raise TransientError(
                f"{server}: HTTP {resp.status_code}: {_error_message(resp)}",
                server=server,
                status=resp.status_code,
            )
        if resp.status_code != 200:
            raise PermanentError(
                f"{server}: HTTP {resp.status_code}: {_error_message(resp)}",
                server=server,
                status=resp.status_code,
            )
        try:
            body = resp.json()
        except ValueError as exc:
            raise TransientError(f"{server}: answer is not JSON", server=server) from exc
        return parse_completion(body, rid, server)

    def abort(self, rid: str) -> None:
        """Abort a request on every server (a rid lives on one; the others ignore it)."""
        for server in self.urls:
            try:
                self._session().post(f"{server}/abort_request", json={"rid": rid}, timeout=5)
            except requests.RequestException:
                continue

    def model(self, server: str) -> str:
        """The served model's name, asked once per server."""
        name = self._models.get(server)
        if name is None:
            try:
                info = self._session().get(f"{server}/model_info", timeout=self.timeout[0] + 5)
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
                r = self._session().get(f"{server}/health", timeout=(self.timeout[0], 30))
                if r.status_code != 200:
                    down.append(f"{server}: /health answered HTTP {r.status_code}")
            except requests.RequestException as exc:
                down.append(f"{server}: {exc.__class__.__name__}")
        return down
