"""A streamed /generate (common/sglang_stream.py) reads the same completion as a plain one,
from a server streaming cumulatively or incrementally, calls its start hook once, at the
first token, and sorts errors as the plain request does."""

from __future__ import annotations

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
