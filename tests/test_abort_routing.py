"""Aborts on a close go to the server each rid names: real simulators over HTTP.

Two simulators run long requests; the client knows both, plus, in one test, a server that
accepts connections and never answers. Each simulator counts the /abort_request calls it
receives, so a test sees where every abort went, not only which requests ended.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import requests
import sqlalchemy as sa
from sqlalchemy.exc import OperationalError

from common import sglang_client
from common.budget import Budget
from common.closing import after_close
from common.ledger import Admission, Ledger
from common.rids import new_rid, server_tag, tag_of
from common.sglang_client import SGLangClient
from common.store import Store
from ops.localredis import free_port
from sim import SimConfig, SimServer

LONG = {"max_new_tokens": 4000, "ignore_eos": True}  # 40 s at 100 tok/s: aborted long before


@pytest.fixture(scope="module")
def two_sims() -> Iterator[tuple[str, str]]:
    cfg = SimConfig(port=0, decode_tok_per_s=100)
    with SimServer(cfg) as a, SimServer(SimConfig(port=0, decode_tok_per_s=100)) as b:
        assert a.url and b.url
        yield a.url, b.url


@pytest.fixture(autouse=True)
def _reset(two_sims: tuple[str, str]) -> None:
    for url in two_sims:
        requests.post(f"{url}/sim/reset", timeout=5).raise_for_status()


def stats(url: str) -> dict[str, Any]:
    return requests.get(f"{url}/sim/stats", timeout=5).json()


def start(pool: ThreadPoolExecutor, url: str, rid: str) -> Future[Any]:
    body = {"rid": rid, "input_ids": [5, 6, 7], "sampling_params": LONG}
    return pool.submit(lambda: requests.post(f"{url}/generate", json=body, timeout=60).json())


def running(url: str, n: int) -> None:
    deadline = time.monotonic() + 10
    while stats(url)["running"] < n:
        assert time.monotonic() < deadline, f"{url}: {n} requests never ran"
        time.sleep(0.02)


def test_a_rid_names_its_server_and_stays_unique() -> None:
    rid = new_rid("ds-1", "http://gpu-3:30000")
    assert tag_of(rid) == server_tag("http://gpu-3:30000") != server_tag("http://gpu-4:30000")
    assert rid.endswith("-ds-1") and new_rid("ds-1", "http://gpu-3:30000") != rid
    # Earlier rids (uuid-dataset) and foreign ones carry no tag.
    assert tag_of("0123456789abcdef0123456789abcdef-ds") is None
    assert tag_of("abc") is None


def test_each_abort_goes_to_its_own_server_only(two_sims: tuple[str, str]) -> None:
    a, b = two_sims
    client = SGLangClient((a, b))
    on_a = [new_rid("ds", a) for _ in range(3)]
    on_b = [new_rid("ds", b) for _ in range(2)]
    with ThreadPoolExecutor(5) as pool:
        futures = [start(pool, a, rid) for rid in on_a] + [start(pool, b, rid) for rid in on_b]
        running(a, 3)
        running(b, 2)
        assert client.abort_many(on_a) == 3
        answers = [f.result() for f in futures[:3]]
        assert stats(b)["running"] == 2  # b's requests untouched
        assert client.abort_many(on_b) == 2
        answers += [f.result() for f in futures[3:]]
    assert [x["meta_info"]["finish_reason"]["type"] for x in answers] == ["abort"] * 5
    assert (stats(a)["abort_calls"], stats(b)["abort_calls"]) == (3, 2)


def test_a_rid_naming_no_known_server_is_aborted_everywhere(two_sims: tuple[str, str]) -> None:
    a, b = two_sims
    client = SGLangClient((a, b))
    foreign = f"{'f' * 32}-ds"  # an earlier rid format, or a server this process lacks
    with ThreadPoolExecutor(1) as pool:
        future = start(pool, b, foreign)
        running(b, 1)
        assert client.abort_many([foreign]) == 2
        assert future.result()["meta_info"]["finish_reason"]["type"] == "abort"
    assert (stats(a)["abort_calls"], stats(b)["abort_calls"]) == (1, 1)


def test_a_server_that_does_not_answer_is_skipped_not_waited_on_per_rid(
    two_sims: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _ = two_sims
    monkeypatch.setattr(sglang_client, "ABORT_READ_TIMEOUT_S", 0.3)
    hung = socket.socket()  # listens (the kernel completes connects), never answers
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    refused = f"http://127.0.0.1:{free_port()}"
    silent = f"http://127.0.0.1:{hung.getsockname()[1]}"
    try:
        client = SGLangClient((a, silent, refused))
        rids = ([new_rid("ds", silent) for _ in range(10)]
                + [new_rid("ds", refused) for _ in range(10)]
                + [new_rid("ds", a) for _ in range(3)])
        # One call each to the two dead servers, then the live one's three.
        assert client.abort_many(rids) == 1 + 1 + 3
        assert stats(a)["abort_calls"] == 3
    finally:
        hung.close()


def test_a_close_aborts_its_requests_even_when_the_database_is_away(
    two_sims: tuple[str, str], ledger: Ledger, sqlite_url: str
) -> None:
    """The SQL record of a close and its aborts go side by side: a database that refuses
    connections fails the record, but the GPU stops generating what the budget no longer
    takes."""
    a, _ = two_sims
    ledger.configure("away", Budget(1000, "output", "abort"))
    rids = [new_rid("away", a) for _ in range(3)]
    for rid in rids:
        assert ledger.admit("away", rid, 100, 100) is Admission.ADMITTED
    assert ledger.close("away", "manual").closed_now
    gone = Store(sqlite_url)  # then pointed at a server that refuses connections
    gone.engine = sa.create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/x")
    with ThreadPoolExecutor(3) as pool:
        futures = [start(pool, a, rid) for rid in rids]
        running(a, 3)
        with pytest.raises(OperationalError):
            after_close("away", store=gone, ledger=ledger, app=None, client=SGLangClient((a,)))
        answers = [f.result(timeout=10) for f in futures]
    assert [x["meta_info"]["finish_reason"]["type"] for x in answers] == ["abort"] * 3
    assert stats(a)["abort_calls"] == 3


def test_a_generate_after_aborts_on_the_same_connection_keeps_its_long_read_timeout(
    two_sims: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Aborts share the thread's kept-alive connection with /generate, under a short read
    timeout of their own; a request after them must wait for its answer as long as ever."""
    a, _ = two_sims
    monkeypatch.setattr(sglang_client, "ABORT_READ_TIMEOUT_S", 0.3)
    client = SGLangClient((a,), read_timeout_s=60)
    assert client.abort_many([new_rid("ds", a) for _ in range(3)]) == 3
    # 80 tokens at 100 tok/s: 0.8 s, well past the aborts' 0.3 s.
    done = client.generate(a, new_rid("ds", a), [5, 6, 7],
                           {"max_new_tokens": 80, "ignore_eos": True})
    assert done.completion_tokens == 80 and done.finish_type == "length"
    assert stats(a)["abort_calls"] == 3


class _Refusing(BaseHTTPRequestHandler):
    """A server that wants an admin key for /abort_request, as SGLang can."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"error": {"message": "Unauthorized"}}'
        self.send_response(401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


def test_refused_aborts_are_said_once_a_close(caplog: pytest.LogCaptureFixture) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    server.protocol_version = "HTTP/1.1"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with caplog.at_level("WARNING", logger="common.sglang_client"):
            assert SGLangClient((url,)).abort_many([new_rid("ds", url) for _ in range(4)]) == 4
    finally:
        server.shutdown()
        server.server_close()
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"{url} refused an abort: HTTP 401: Unauthorized"]
