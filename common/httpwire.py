"""HTTP/1.1 for the /generate hot path: where a server's requests go (directly or through
a proxy) and a connection that reads a JSON answer with the least parsing.

At an instant server, ``requests`` (sessions, adapters, hooks, header merging) and
http.client's header parsing (through the email package) cost a worker more CPU than the
rest of a sample's path. Connecting, TLS, tunnels and closing stay http.client's; errors
are http.client's exceptions or OSError, as there.
"""

from __future__ import annotations

import base64
import http.client
import select
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

_MAX_LINE = 65536
_MAX_FIELDS = 100


@dataclass(frozen=True)
class Answer:
    status: int
    reason: str
    body: bytes


@dataclass(frozen=True)
class Route:
    """Where a server's requests go: straight to it, or through the environment's proxy."""

    https: bool
    host: str
    port: int
    generate_path: str
    tunnel: tuple[str, int] | None = None
    tunnel_headers: tuple[tuple[str, str], ...] = ()  # sent to the proxy only, at CONNECT
    proxy_headers: tuple[tuple[str, str], ...] = ()  # sent with each request

    def path_to(self, endpoint: str) -> str:
        """The request target of another endpoint of the same server (``/abort_request``)."""
        return self.generate_path.removesuffix("/generate") + endpoint


def _address(url: str) -> tuple[bool, str, int]:
    parts = urlsplit(url)
    https = parts.scheme == "https"
    return https, parts.hostname or "localhost", parts.port or (443 if https else 80)


def route(server: str, proxies: dict[str, str]) -> Route:
    https, host, port = _address(server)
    path = (urlsplit(server).path.rstrip("/") or "") + "/generate"
    proxy = proxies.get("https" if https else "http") or proxies.get("all")
    if not proxy:
        return Route(https, host, port, path)
    p_https, p_host, p_port = _address(proxy)
    p = urlsplit(proxy)
    auth: tuple[tuple[str, str], ...] = ()
    if p.username is not None:
        token = f"{unquote(p.username)}:{unquote(p.password or '')}".encode()
        auth = (("Proxy-Authorization", "Basic " + base64.b64encode(token).decode()),)
    if https:  # CONNECT through the proxy, TLS with the server inside the tunnel
        return Route(True, p_host, p_port, path, tunnel=(host, port), tunnel_headers=auth)
    # Plain HTTP via a proxy: the request line carries the absolute URL.
    return Route(p_https, p_host, p_port, server.rstrip("/") + "/generate", proxy_headers=auth)


def is_fast(target: Route) -> bool:
    return not target.https and not target.proxy_headers and target.generate_path[:1] == "/"


def request_head(target: Route, headers: dict[str, str]) -> bytes:
    """The request's header block after the request line, but for Content-Length."""
    host = f"[{target.host}]" if ":" in target.host else target.host
    fields = {"Host": f"{host}:{target.port}", "Content-Type": "application/json",
              "Accept-Encoding": "identity", **headers}
    return "".join(f"{k}: {v}\r\n" for k, v in fields.items()).encode("latin-1")


def dropped(sock: Any) -> bool:
    """A kept-alive socket that is readable before we send has been closed by the server
    (or holds bytes nobody asked for): reusing it would fail the next request."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    try:
        return bool(poller.poll(0))
    except OSError:
        return True


def new_connection(target: Route, connect_timeout_s: float) -> http.client.HTTPConnection:
    conn: http.client.HTTPConnection
    if is_fast(target):
        conn = FastConnection(target.host, target.port, timeout=connect_timeout_s)
    elif target.https:
        conn = http.client.HTTPSConnection(target.host, target.port, timeout=connect_timeout_s)
    else:
        conn = http.client.HTTPConnection(target.host, target.port, timeout=connect_timeout_s)
    if target.tunnel is not None:
        conn.set_tunnel(*target.tunnel, headers=dict(target.tunnel_headers))
    return conn


class FastConnection(http.client.HTTPConnection):
    """Plain HTTP/1.1 to a server with no proxy between, with the least parsing a JSON
    answer needs: http.client's response parsing (headers through the email package)
    cost the worker more CPU than the rest of the exchange. Connecting and closing are
    http.client's; errors are http.client's exceptions or OSError, as there."""

    _reader: Any = None

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        super().close()

    def exchange(self, path: str, head: bytes, body: bytes) -> Answer:
        if self.sock is None:
            raise http.client.NotConnected()
        if self._reader is None:
            self._reader = self.sock.makefile("rb")
        self.sock.sendall(b"POST %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s"
                          % (path.encode("ascii"), head, len(body), body))
        status, reason, fields, keep = _read_head(self._reader)
        data, keep = _read_body(self._reader, status, fields, keep)
        if not keep:
            self.close()
        return Answer(status, reason, data)


def _read_head(reader: Any) -> tuple[int, str, dict[bytes, bytes], bool]:
    """Status and header fields of the next final (non-1xx) response."""
    while True:
        line = reader.readline(_MAX_LINE + 1)
        if not line:
            raise http.client.RemoteDisconnected("remote end closed connection without response")
        version, _, rest = line.partition(b" ")
        code, _, reason = rest.partition(b" ")
        if not version.startswith(b"HTTP/") or not code.isdigit():
            raise http.client.BadStatusLine(repr(line[:100]))
        fields = _read_fields(reader)
        status = int(code)
        if status >= 200:
            token = fields.get(b"connection", b"").lower()
            keep = token != b"close" and (version != b"HTTP/1.0" or token == b"keep-alive")
            return status, reason.strip().decode("latin-1"), fields, keep


def _read_fields(reader: Any) -> dict[bytes, bytes]:
    fields: dict[bytes, bytes] = {}
    for _ in range(_MAX_FIELDS):
        line = reader.readline(_MAX_LINE + 1)
        if line in (b"\r\n", b"\n", b""):
            return fields
        name, _, value = line.partition(b":")
        fields[name.strip().lower()] = value.strip()
    raise http.client.HTTPException(f"more than {_MAX_FIELDS} header fields")


def _read_body(reader: Any, status: int, fields: dict[bytes, bytes],
               keep: bool) -> tuple[bytes, bool]:
    """The body and whether the connection stays usable after it."""
    if status in (204, 304):
        return b"", keep
    if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
        return _read_chunked(reader), keep
    length = fields.get(b"content-length")
    if length is None:  # delimited by the end of the connection
        return reader.read(), False
    if not length.isdigit():
        raise http.client.HTTPException(f"bad Content-Length {length[:40]!r}")
    data = reader.read(int(length))
    if len(data) < int(length):
        raise http.client.IncompleteRead(data, int(length) - len(data))
    return data, keep


def _read_chunked(reader: Any) -> bytes:
    parts: list[bytes] = []
    while True:
        line = reader.readline(_MAX_LINE + 1)
        try:
            size = int(line.split(b";", 1)[0], 16)
        except ValueError:
            raise http.client.HTTPException(f"bad chunk size {line[:40]!r}") from None
        if size == 0:
            _read_fields(reader)  # trailers
            return b"".join(parts)
        chunk = reader.read(size)
        if len(chunk) < size:
            raise http.client.IncompleteRead(chunk, size - len(chunk))
        parts.append(chunk)
        reader.readline(_MAX_LINE + 1)  # the CRLF after the chunk
