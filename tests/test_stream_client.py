"""A streamed /generate (common/sglang_stream.py) reads the same completion as a plain one,
from a server streaming cumulatively or incrementally, calls its start hook once, at the
first token, and sorts errors as the plain request does."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest
import requests

from common.errors import PermanentError
from common.sglang_client import SGLangClient
from sim import SimConfig, SimServer

PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module", params=[False, True], ids=["cumulative", "incremental"])
def sim_url(request: pytest.FixtureRequest) -> Iterator[str]:
    with SimServer(SimConfig(port=0, decode_tok_per_s=2000, mean_output_tokens=80,
                             incremental_streaming_output=request.param)) as server:
        yield server.url


def test_a_streamed_request_reads_what_a_plain_one_does(sim_url: str) -> None:
    client = SGLangClient((sim_url,))
    starts: list[int] = []
    params = {"max_new_tokens": 60, "temperature": 1.0}
    plain = client.generate(sim_url, "plain-1", PROMPT, params)
    streamed = client.generate(sim_url, "stream-1", PROMPT, params,
                               on_start=lambda: starts.append(1))
    assert starts == [1]
    assert plain.output_ids and streamed.output_ids == plain.output_ids
    assert (streamed.text, streamed.finish_type, streamed.completion_tokens) == (
        plain.text, plain.finish_type, plain.completion_tokens)
    log = requests.get(f"{sim_url}/sim/requests", timeout=5).json()
    assert [r["stream"] for r in log if r["rid"] in ("plain-1", "stream-1")] == [False, True]


def test_a_streamed_request_the_server_refuses_is_the_same_error(sim_url: str) -> None:
    client = SGLangClient((sim_url,))
    with pytest.raises(PermanentError, match="HTTP 400"):
        client.generate(sim_url, "bad-1", PROMPT, {"max_new_tokens": 10, "top_p": 1.5},
                        on_start=lambda: None)


def test_streamed_requests_keep_their_connection_alive(sim_url: str) -> None:
    # A stream left unread past its [DONE] closes its connection: every request of a
    # drain dataset would then open a new one.
    client = SGLangClient((sim_url,))
    rids = [f"alive-{i}" for i in range(4)]
    for rid in rids:
        client.generate(sim_url, rid, PROMPT, {"max_new_tokens": 8}, on_start=lambda: None)
    log = requests.get(f"{sim_url}/sim/requests", timeout=5).json()
    peers = [r["peer"] for r in log if r["rid"] in rids]
    assert len(peers) == len(rids) and all(peers)
    assert len(set(peers)) == 1


def _event(body: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


FIRST = _event({"text": "a", "output_ids": [7], "meta_info": {"completion_tokens": 1}})
FINAL = _event({"text": "ab", "output_ids": [7, 8], "meta_info": {
    "id": "r", "prompt_tokens": 5, "completion_tokens": 2,
    "finish_reason": {"type": "length", "length": 2}}}) + b"data: [DONE]\n\n"


class _Stream(http.server.BaseHTTPRequestHandler):
    """A /generate that streams by hand: the first event split across two HTTP chunks,
    then the final one only once the test lets it go (``chunked``); or the whole
    stream as one body of known length."""

    protocol_version = "HTTP/1.1"
    chunked = True
    release = threading.Event()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if not self.chunked:
            self.send_header("Content-Length", str(len(FIRST + FINAL)))
            self.end_headers()
            self.wfile.write(FIRST + FINAL)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for piece in (FIRST[:9], FIRST[9:]):
            self._chunk(piece)
        self.release.wait(10)
        self._chunk(FINAL)
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "known-length"])
def test_a_stream_is_read_as_its_chunks_arrive(chunked: bool) -> None:
    """The start hook runs at the first event, split across two chunks, while the server
    still holds the final one; a stream sent as one body reads the same."""
    handler = type("Handler", (_Stream,), {"chunked": chunked, "release": threading.Event()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    started_early: list[bool] = []

    def on_start() -> None:
        started_early.append(not handler.release.is_set())
        handler.release.set()

    try:
        done = SGLangClient((url,)).generate(url, "r", PROMPT, {"max_new_tokens": 2},
                                             on_start=on_start)
    finally:
        handler.release.set()
        server.shutdown()
        server.server_close()
    assert started_early == [True]
    assert (done.output_ids, done.text, done.completion_tokens) == ([7, 8], "ab", 2)
