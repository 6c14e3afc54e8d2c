"""The /generate client on requests: every answer and failure sorted into the error tree,
kept-alive connections reused, and a connection the server dropped while idle replaced
unnoticed.

A small threaded HTTP/1.1 server plays each behaviour; no simulator, no Redis.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from common.errors import IncompatibleServer, PermanentError, ServerUnreachable, TransientError
from common.sglang_client import SGLangClient
from ops.localredis import free_port

OK_BODY = {"text": "hi", "output_ids": [5, 6, 7],
           "meta_info": {"prompt_tokens": 3, "completion_tokens": 3, "cached_tokens": 1,
                         "finish_reason": {"type": "stop"}, "e2e_latency": 0.01}}


_OK = json.dumps(OK_BODY).encode()
# Answers written byte for byte: the framings http.server does not produce by itself.
RAW = {
    "chunked": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Type: application/json"
               b"\r\nTransfer-Encoding: chunked\r\n\r\n"
               + b"".join(b"%x;ext=1\r\n%s\r\n" % (len(_OK[i:i + 7]), _OK[i:i + 7])
                          for i in range(0, len(_OK), 7)) + b"0\r\nX-Trailer: t\r\n\r\n",
    "until_close": b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + _OK,
    "short": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(_OK) + 10, _OK),
    "garbage": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
}


class Behaviour:
    def __init__(self) -> None:
        self.mode = "ok"
        self.connections = 0
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.paths: list[str] = []


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Any

    def setup(self) -> None:
        super().setup()
        self.server.behaviour.connections += 1

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        b: Behaviour = self.server.behaviour
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        b.bodies.append(json.loads(raw))
        b.headers.append(dict(self.headers))
        b.paths.append(self.path)
        mode = b.mode
        if mode == "drop":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if mode == "slow":
            time.sleep(1.0)
        if mode in RAW:
            self.wfile.write(RAW[mode])
            self.wfile.flush()
            self.close_connection = mode != "chunked"
            return
        status, body = {
            "ok": (200, json.dumps(OK_BODY).encode()),
            "slow": (200, json.dumps(OK_BODY).encode()),
            "close_after": (200, json.dumps(OK_BODY).encode()),
            "503": (503, json.dumps({"error": {"message": "The request queue is full"}}).encode()),
            "500text": (500, b"boom"),
            "400": (400, json.dumps({"message": "bad sampling params"}).encode()),
            "notjson": (200, b"<html>"),
            "no_ids": (200, json.dumps({"text": "x",
                                        "meta_info": {"completion_tokens": 1}}).encode()),
            "no_meta": (200, json.dumps({"text": "x"}).encode()),
        }[mode]
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        if mode == "close_after":
            # Keep-alive announced, then the server forgets the connection while it idles.
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def server() -> Iterator[tuple[str, Behaviour]]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    httpd.behaviour = Behaviour()  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}", httpd.behaviour  # type: ignore[attr-defined]
    finally:
        httpd.shutdown()
        httpd.server_close()


def call(url: str, **kw: Any) -> Any:
    client = kw.pop("client", None) or SGLangClient((url,), read_timeout_s=0.5, **kw)
    return client.generate(url, "rid-1", [1, 2, 3], {"max_new_tokens": 8})


def test_a_good_answer_is_parsed_and_the_connection_kept(server: tuple[str, Behaviour]) -> None:
    url, b = server
    client = SGLangClient((url,), api_key="k")
    for _ in range(3):
        c = call(url, client=client)
        assert (c.output_ids, c.text, c.completion_tokens, c.cached_tokens) == ([5, 6, 7], "hi",
                                                                               3, 1)
        assert (c.finish_type, c.rid, c.server) == ("stop", "rid-1", url)
    assert b.connections == 1
    assert b.bodies[0] == {"rid": "rid-1", "input_ids": [1, 2, 3],
                           "sampling_params": {"max_new_tokens": 8}, "stream": False}
    assert b.headers[0]["Authorization"] == "Bearer k"
    assert b.headers[0]["Content-Type"] == "application/json"


def test_a_connection_dropped_while_idle_is_replaced(server: tuple[str, Behaviour]) -> None:
    url, b = server
    client = SGLangClient((url,))
    b.mode = "close_after"
    call(url, client=client)
    time.sleep(0.1)
    b.mode = "ok"
    assert call(url, client=client).output_ids == [5, 6, 7]
    assert b.connections == 2


@pytest.mark.parametrize(("mode", "error", "needle", "status"), [
    ("503", TransientError, "HTTP 503: The request queue is full", 503),
    ("500text", TransientError, "HTTP 500: boom", 500),
    ("400", PermanentError, "HTTP 400: bad sampling params", 400),
    ("notjson", TransientError, "answer is not JSON", None),
    ("no_ids", IncompatibleServer, "no output_ids", None),
    ("no_meta", PermanentError, "without meta_info", None),
    ("drop", TransientError, "connection failed", None),
    ("slow", TransientError, "timed out", None),
])
def test_each_failure_is_classified(server: tuple[str, Behaviour], mode: str,
                                    error: type[Exception], needle: str,
                                    status: int | None) -> None:
    url, b = server
    b.mode = mode
    with pytest.raises(error) as info:
        call(url)
    assert needle in str(info.value)
    assert not isinstance(info.value, ServerUnreachable)
    assert getattr(info.value, "status", None) == status


def test_the_connection_is_usable_after_a_failure(server: tuple[str, Behaviour]) -> None:
    url, b = server
    client = SGLangClient((url,), read_timeout_s=0.5)
    for mode in ("drop", "slow", "503"):
        b.mode = mode
        with pytest.raises(TransientError):
            call(url, client=client)
        b.mode = "ok"
        assert call(url, client=client).output_ids == [5, 6, 7]


def test_nothing_listening_is_unreachable_not_counted() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerUnreachable, match="connection refused"):
        call(url)


def test_an_unknown_host_is_unreachable() -> None:
    with pytest.raises(ServerUnreachable):
        call("http://no-such-host.invalid:30000")


def test_a_proxy_from_the_environment_carries_generate_and_aborts(
    server: tuple[str, Behaviour], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain HTTP through a proxy: the request line carries the absolute URL, the proxy's
    credentials go in Proxy-Authorization, and a close's aborts take the same way."""
    proxy_url, b = server
    monkeypatch.setenv("HTTP_PROXY", proxy_url.replace("http://", "http://u:p@"))
    for var in ("http_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    far = "http://gpu-b.example:30000/sgl"  # resolvable only by the proxy
    client = SGLangClient((far,), api_key="k")
    assert client.generate(far, "rid-1", [1], {"max_new_tokens": 8}).output_ids == [5, 6, 7]
    client.abort_many(["rid-2"])
    assert b.paths == [f"{far}/generate", f"{far}/abort_request"]
    token = base64.b64encode(b"u:p").decode()
    assert b.headers[0]["Proxy-Authorization"] == f"Basic {token}"
    assert b.headers[0]["Authorization"] == "Bearer k"


@pytest.mark.parametrize("mode", ["chunked", "until_close"])
def test_other_framings_are_read_whole(server: tuple[str, Behaviour], mode: str) -> None:
    url, b = server
    client = SGLangClient((url,))
    for _ in range(2):
        b.mode = mode
        assert call(url, client=client).output_ids == [5, 6, 7]
    b.mode = "ok"
    assert call(url, client=client).output_ids == [5, 6, 7]
    assert b.connections == (1 if mode == "chunked" else 3)


@pytest.mark.parametrize("mode", ["short", "garbage"])
def test_a_broken_answer_is_a_connection_failure(server: tuple[str, Behaviour],
                                                 mode: str) -> None:
    url, b = server
    b.mode = mode
    with pytest.raises(TransientError, match="connection failed") as info:
        call(url)
    assert not isinstance(info.value, ServerUnreachable)


class PathRecorder(BaseHTTPRequestHandler):
    """Answers every GET with 200 and keeps the request target (absolute via a proxy)."""

    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.server.paths.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")


def test_each_server_uses_its_own_proxy_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    servers = []
    for _ in range(2):
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), PathRecorder)
        httpd.paths = []  # type: ignore[attr-defined]
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
    direct, proxy = servers
    try:
        for var in ("HTTP_PROXY", "http_proxy"):
            monkeypatch.setenv(var, f"http://127.0.0.1:{proxy.server_port}")
        for var in ("NO_PROXY", "no_proxy"):
            monkeypatch.setenv(var, "127.0.0.1")
        near = f"http://127.0.0.1:{direct.server_port}"
        far = "http://gpu-b.example:30000"  # resolvable only by the proxy
        client = SGLangClient((near, far))
        assert client.check_servers() == []
        assert direct.paths == ["/health"]  # type: ignore[attr-defined]
        assert proxy.paths == [f"{far}/health"]  # type: ignore[attr-defined]
    finally:
        for httpd in servers:
            httpd.shutdown()
