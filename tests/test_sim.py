"""The SGLang simulator over real HTTP: wire format, validation, timing, aborts, faults.

Servers run in-process on port 0 (`SimServer`), one per behaviour class, module-scoped
so the whole file stays fast. Decode is instant except where timing is the point.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from sim import SimConfig, SimServer
from sim.contract import unknown_field_message
from sim.server import config_from_args

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "common" / "assets" / "tokenizer"
CONTEXT = 4096
PLAIN_EOS = 2
PLAIN_THINK = 3


@pytest.fixture(scope="module")
def fast() -> Iterator[str]:
    """Instant decode, 48 slots, small context (cheap too-long prompts)."""
    with SimServer(SimConfig(port=0, decode_tok_per_s=0, context_length=CONTEXT)) as srv:
        assert srv.url
        yield srv.url


@pytest.fixture(scope="module")
def slow() -> Iterator[str]:
    """One slot, a one-place queue and 200 tok/s: for queueing, abort and disconnects."""
    cfg = SimConfig(port=0, decode_tok_per_s=200, max_running_requests=1, max_queued_requests=1)
    with SimServer(cfg) as srv:
        assert srv.url
        yield srv.url


@pytest.fixture(scope="module")
def incremental() -> Iterator[str]:
    """Streams deltas; 4000 tok/s so a sample spans several chunks."""
    cfg = SimConfig(port=0, decode_tok_per_s=4000, incremental_streaming_output=True)
    with SimServer(cfg) as srv:
        assert srv.url
        yield srv.url


@pytest.fixture(autouse=True)
def _reset_faults(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test starts with the command-line faults on the servers it uses."""
    yield
    for name in ("fast", "slow", "incremental"):
        if name in request.fixturenames:
            requests.post(request.getfixturevalue(name) + "/sim/reset", timeout=5)


def gen(url: str, ids: list[int], timeout: float = 10, **body: Any) -> requests.Response:
    return requests.post(url + "/generate", json={"input_ids": ids, **body}, timeout=timeout)


def sse_events(resp: requests.Response) -> list[Any]:
    """Parse an SSE body into JSON payloads, with "[DONE]" kept as a string."""
    events = []
    for block in resp.text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            payload = block[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def wait_for(predicate: Any, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def stats(url: str) -> dict[str, Any]:
    return requests.get(url + "/sim/stats", timeout=5).json()


def log_entry(url: str, rid: str) -> dict[str, Any]:
    entries = requests.get(url + "/sim/requests", params={"rid_prefix": rid}, timeout=5).json()
    assert len(entries) == 1, entries
    return entries[0]


# ---- non-streaming output ------------------------------------------------------------


def test_nonstream_shape_and_invariants(fast: str) -> None:
    resp = gen(fast, [11, 12, 13], rid="shape-1", sampling_params={"max_new_tokens": 3000})
    assert resp.status_code == 200
    out = resp.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "shape-1"
    assert meta["finish_reason"] == {"type": "stop", "matched": PLAIN_EOS}
    assert out["output_ids"][-1] == PLAIN_EOS  # EOS kept in ids and counted
    assert len(out["output_ids"]) == meta["completion_tokens"]
    assert meta["prompt_tokens"] == 3
    assert meta["weight_version"] == "default" and meta["num_retractions"] == 0
    ids = out["output_ids"][:-1]
    # The plain vocabulary closes the reasoning once, like a reasoning model: `</think>` (3).
    assert ids.count(PLAIN_THINK) == 1 and ids.index(PLAIN_THINK) > 0
    assert meta["reasoning_tokens"] == ids.index(PLAIN_THINK) + 1 and meta["cached_tokens"] == 0
    assert 0 <= meta["e2e_latency"] < 5 and meta["response_sent_to_client_ts"] > 1e9
    assert all(10 <= i < 32000 for i in ids if i != PLAIN_THINK)
    assert out["text"] == " ".join("</think>" if i == PLAIN_THINK else f"t{i}" for i in ids)
    reasoning, found, answer = out["text"].partition("</think>")
    assert found and reasoning.strip() and answer.strip()


def test_outputs_are_deterministic_per_prompt(fast: str) -> None:
    first = gen(fast, [1, 2, 3, 4], sampling_params={"max_new_tokens": 3000}).json()
    again = gen(fast, [1, 2, 3, 4], sampling_params={"max_new_tokens": 3000}).json()
    other = gen(fast, [1, 2, 3, 5], sampling_params={"max_new_tokens": 3000}).json()
    assert first["output_ids"] == again["output_ids"] and first["text"] == again["text"]
    assert first["output_ids"] != other["output_ids"]
    capped = gen(fast, [1, 2, 3, 4], sampling_params={"max_new_tokens": 5}).json()
    assert capped["output_ids"] == first["output_ids"][:5]  # a cap cuts, never reshuffles


def test_default_max_new_tokens_is_128_with_length_finish(fast: str) -> None:
    outs = [gen(fast, [7, n]).json() for n in range(40)]
    capped = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "length"]
    assert capped, "mean 300 tokens: most prompts exceed the default cap"
    for out in capped:
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 128}
        assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"] == 128
    assert all(o["meta_info"]["completion_tokens"] <= 128 for o in outs)


# ---- validation ----------------------------------------------------------------------

TOO_LONG = list(range(CONTEXT))


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"input_ids": [1], "sampling_params": {"seed": 1}}, unknown_field_message("seed")),
        (
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 8.0}},
            "invalid type: floating point `8.0`, expected i64",
        ),
        (
            {"input_ids": [1], "sampling_params": {"temperature": "0.5"}},
            'invalid type: string "0.5", expected f64',
        ),
        ({"input_ids": [1, 2.5]}, "invalid type: floating point `2.5`, expected i32"),
    ],
)
def test_contract_errors_have_a_string_error(fast: str, body: dict[str, Any], error: str) -> None:
    resp = requests.post(fast + "/generate", json=body, timeout=5)
    assert resp.status_code == 400
    assert resp.json() == {"error": error}


def test_unknown_field_lists_the_allowed_keys() -> None:
    message = unknown_field_message("seed")
    assert message.startswith("unknown field `seed`, expected one of `max_new_tokens`, `stop`, ")
    assert "`sampling_seed`" in message and "`top_k`" in message


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"sampling_params": {}}, "Either text, input_ids or input_embeds should be provided."),
        ({"input_ids": []}, "input_ids cannot be empty."),
        (
            {"input_ids": TOO_LONG},
            f"The input ({CONTEXT} tokens) is longer than the model's context length "
            f"({CONTEXT} tokens).",
        ),
        (
            {"input_ids": list(range(100)), "sampling_params": {"max_new_tokens": CONTEXT}},
            f"Requested token count exceeds the model's maximum context length of {CONTEXT} "
            f"tokens. You requested a total of {CONTEXT + 100} tokens: 100 tokens from the "
            f"input messages and {CONTEXT} tokens for the completion. Please reduce the number "
            "of tokens in the input messages or the completion to fit within the limit.",
        ),
        (
            {"input_ids": [1], "sampling_params": {"top_p": 1.5}},
            "top_p must be in (0, 1], got 1.5.",
        ),
        (
            {"input_ids": [1], "sampling_params": {"temperature": -1}},
            "temperature must be a non-negative finite number, got -1.0.",
        ),
        (
            {"input_ids": [1], "sampling_params": {"top_k": 0}},
            "top_k must be -1 (disable) or at least 1, got 0.",
        ),
        ({"input_ids": [1], "sampling_params": {"min_p": 2}}, "min_p must be in [0, 1], got 2.0."),
        ({"input_ids": [[1], [2]]}, "batch requests are not supported by the simulator"),
        ({"text": "hello"}, "the simulator accepts input_ids only"),
    ],
)
def test_request_errors_have_a_message_object(
    fast: str, body: dict[str, Any], message: str
) -> None:
    resp = requests.post(fast + "/generate", json=body, timeout=5)
    assert resp.status_code == 400
    assert resp.json() == {"error": {"message": message}}


def test_stream_request_error_is_an_sse_event(fast: str) -> None:
    resp = gen(fast, [], stream=True)
    assert resp.status_code == 200
    error, done = sse_events(resp)
    assert error["error"]["message"] == "input_ids cannot be empty."
    assert error["error"]["code"] == 400 and error["error"]["retryable"] is False
    assert done == "[DONE]"


def test_greedy_temperature_accepts_top_k_zero(fast: str) -> None:
    params = {"temperature": 0, "top_k": 0, "max_new_tokens": 4}
    assert gen(fast, [1], sampling_params=params).status_code == 200


# ---- streaming -----------------------------------------------------------------------


def test_stream_cumulative_matches_nonstream(fast: str) -> None:
    # Slow enough that the output takes many chunk intervals, so chunks stay apart even
    # when a loaded machine wakes the stream late.
    requests.post(fast + "/sim/faults", json={"decode_tok_per_s": 500}, timeout=5)
    params = {"max_new_tokens": 400}
    plain = gen(fast, [42, 43], sampling_params=params).json()
    events = sse_events(gen(fast, [42, 43], sampling_params=params, stream=True))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2, "several decode steps expected at 500 tok/s"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    for before, after in itertools.pairwise(chunks):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    assert chunks[-1]["output_ids"] == plain["output_ids"]
    assert chunks[-1]["text"] == plain["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]


def test_stream_incremental_deltas_add_up(incremental: str) -> None:
    params = {"max_new_tokens": 400}
    plain = gen(incremental, [42, 43], sampling_params=params).json()
    events = sse_events(gen(incremental, [42, 43], sampling_params=params, stream=True))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    ids = [i for c in chunks for i in c["output_ids"]]
    assert ids == plain["output_ids"]
    assert "".join(c["text"] for c in chunks) == plain["text"]
    assert chunks[-1]["meta_info"]["completion_tokens"] == len(ids)
    info = requests.get(incremental + "/server_info", timeout=5).json()
    assert info["incremental_streaming_output"] is True


# ---- timing, aborts and disconnects --------------------------------------------------

LONG = {"max_new_tokens": 2000, "ignore_eos": True}  # 10 s at 200 tok/s: aborted long before


def _start(pool: ThreadPoolExecutor, url: str, rid: str, **body: Any) -> Future[Any]:
    return pool.submit(gen, url, [5, 6, 7], 20, rid=rid, sampling_params=LONG, **body)


def test_abort_running_returns_partial_output(slow: str) -> None:
    with ThreadPoolExecutor(2) as pool:
        fut = _start(pool, slow, "run-abort-1")
        wait_for(lambda: stats(slow)["running"] == 1)
        time.sleep(0.2)
        abort = requests.post(slow + "/abort_request", json={"rid": "run-abort"}, timeout=5)
        assert abort.status_code == 200 and abort.content == b""
        out = fut.result().json()
    meta = out["meta_info"]
    assert meta["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    assert 0 < meta["completion_tokens"] < 2000
    assert len(out["output_ids"]) == meta["completion_tokens"]
    assert log_entry(slow, "run-abort-1")["finish_type"] == "abort"


def test_abort_waiting_request_and_queue_full(slow: str) -> None:
    with ThreadPoolExecutor(2) as pool:
        running = _start(pool, slow, "busy-1")
        wait_for(lambda: stats(slow)["running"] == 1)
        waiting = _start(pool, slow, "queued-1")
        wait_for(lambda: stats(slow)["waiting"] == 1)
        full = gen(slow, [9], rid="rejected-1")
        assert full.status_code == 503
        assert full.json() == {
            "object": "error",
            "message": "The request queue is full.",
            "type": "503",
            "param": None,
            "code": 503,
        }
        requests.post(slow + "/abort_request", json={"rid": "queued-1"}, timeout=5)
        queued = waiting.result().json()
        requests.post(slow + "/abort_request", json={"abort_all": True}, timeout=5)
        assert running.result().json()["meta_info"]["finish_reason"]["message"] == "Aborted"
    assert queued["output_ids"] == [] and queued["meta_info"]["completion_tokens"] == 0
    assert queued["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Abort in waiting queue",
    }


def test_duplicate_inflight_rid_is_rejected(slow: str) -> None:
    with ThreadPoolExecutor(1) as pool:
        first = _start(pool, slow, "dup-1")
        wait_for(lambda: stats(slow)["running"] == 1)
        resp = gen(slow, [1, 2], rid="dup-1")
        requests.post(slow + "/abort_request", json={"rid": "dup-1"}, timeout=5)
        assert first.result().status_code == 200
    assert resp.status_code == 400
    assert resp.json() == {"error": {"message": "Duplicate request ID detected: dup-1"}}


def test_client_disconnect_frees_the_slot(slow: str) -> None:
    with pytest.raises(requests.exceptions.ReadTimeout):
        gen(slow, [5, 6, 7], timeout=0.3, rid="gone-1", sampling_params=LONG)
    started = time.monotonic()
    served = gen(slow, [8], rid="after-gone-1", sampling_params={"max_new_tokens": 4})
    assert served.status_code == 200 and served.json()["meta_info"]["completion_tokens"] == 4
    assert time.monotonic() - started < 2.0, "the abandoned request must not hold the slot"
    entry = log_entry(slow, "gone-1")
    assert entry["finish_type"] == "abort" and entry["detail"] == "client disconnected"
    assert 0 < entry["completion_tokens"] < 2000


def test_requests_queue_fifo_behind_one_slot(slow: str) -> None:
    params = {"max_new_tokens": 40, "ignore_eos": True}  # 0.2 s each at 200 tok/s
    started = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(gen, slow, [n], 10, sampling_params=params) for n in (1, 2)]
        outs = [f.result().json() for f in futs]
    elapsed = time.monotonic() - started
    assert all(o["meta_info"]["completion_tokens"] == 40 for o in outs)
    assert elapsed >= 0.38, "two 0.2 s decodes through one slot take about 0.4 s"


# ---- info endpoints ------------------------------------------------------------------


def test_info_endpoints_and_aliases(fast: str) -> None:
    for path in ("/health", "/health_generate", "/ready"):
        assert requests.get(fast + path, timeout=5).status_code == 200
    model = requests.get(fast + "/model_info", timeout=5).json()
    assert model == requests.get(fast + "/get_model_info", timeout=5).json()
    assert model["served_model_name"] == "datagen-sim" and model["is_generation"] is True
    assert {"model_path", "tokenizer_path", "weight_version", "architectures"} <= set(model)
    info = requests.get(fast + "/server_info", timeout=5).json()
    alias = requests.get(fast + "/get_server_info", timeout=5).json()
    assert info["context_length"] == alias["context_length"] == CONTEXT
    assert info["max_running_requests"] == 48 and info["skip_tokenizer_init"] is False
    assert info["incremental_streaming_output"] is False
    assert info["max_req_input_len"] == CONTEXT - 6 and info["version"] == "0.5.23-sim"
    assert "last_gen_throughput" in info["internal_states"][0]
    models = requests.get(fast + "/v1/models", timeout=5).json()
    assert models["data"][0]["max_model_len"] == CONTEXT
    assert "sglang:num_running_reqs" in requests.get(fast + "/metrics", timeout=5).text


# ---- faults --------------------------------------------------------------------------


def test_fail_next_500_then_503(fast: str) -> None:
    requests.post(fast + "/sim/faults", json={"fail_next": 1}, timeout=5)
    resp = gen(fast, [1])
    assert resp.status_code == 500
    assert resp.json() == {
        "object": "error",
        "message": "Internal server error (simulated)",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
    faults = requests.post(
        fast + "/sim/faults", json={"fail_next": 1, "error_status": 503}, timeout=5
    ).json()
    assert faults["fail_next"] == 1 and faults["error_status"] == 503
    resp = gen(fast, [1])
    assert resp.status_code == 503 and resp.json()["message"] == "The request queue is full."
    assert gen(fast, [1]).status_code == 200  # the counter is used up


def test_disconnect_next_and_down_for_s(fast: str) -> None:
    requests.post(fast + "/sim/faults", json={"disconnect_next": 1}, timeout=5)
    with pytest.raises(requests.exceptions.ConnectionError):
        gen(fast, [1])
    requests.post(fast + "/sim/faults", json={"down_for_s": 0.4}, timeout=5)
    with pytest.raises(requests.exceptions.ConnectionError):
        gen(fast, [1])
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(fast + "/health", timeout=5)
    assert stats(fast)["disconnects"] >= 2  # control routes keep working while down
    time.sleep(0.5)
    assert gen(fast, [1]).status_code == 200


def test_abort_next_and_latency(fast: str) -> None:
    requests.post(fast + "/sim/faults", json={"abort_next": 1, "latency_s": 0.2}, timeout=5)
    started = time.monotonic()
    out = gen(fast, [3], sampling_params={"max_new_tokens": 100, "ignore_eos": True}).json()
    assert time.monotonic() - started >= 0.2
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] == 50
    bad = requests.post(fast + "/sim/faults", json={"error_rate": 2}, timeout=5)
    assert bad.status_code == 400 and "error_rate" in bad.json()["error"]


# ---- request log ---------------------------------------------------------------------


def test_request_log_records_every_request(fast: str) -> None:
    ids = [100, 200, 300]
    gen(fast, ids, rid="log-ok-1", sampling_params={"max_new_tokens": 7, "ignore_eos": True})
    gen(fast, ids, rid="log-bad-1", sampling_params={"top_p": 0})
    ok, bad = log_entry(fast, "log-ok-1"), log_entry(fast, "log-bad-1")
    sha1 = hashlib.sha1(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()
    assert ok["input_sha1"] == bad["input_sha1"] == sha1
    assert ok["status"] == 200 and ok["finish_type"] == "length"
    assert ok["completion_tokens"] == 7 and ok["max_new_tokens"] == 7
    assert ok["prompt_tokens"] == 3 and ok["arrived_ts"] <= ok["finished_ts"]
    assert bad["status"] == 400 and bad["finish_type"] == "error"
    assert bad["completion_tokens"] == 0


def test_request_log_file(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    with SimServer(SimConfig(port=0, decode_tok_per_s=0, request_log=str(path))) as srv:
        assert srv.url
        gen(srv.url, [1, 2], rid="file-1")
        gen(srv.url, [1, 2], rid="file-2", sampling_params={"bogus": 1})
        lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(e["rid"], e["status"]) for e in lines] == [("file-1", 200), ("file-2", 400)]


# ---- tokenizer mode and CLI ----------------------------------------------------------


def test_tokenizer_output_has_think_and_eos() -> None:
    if not (TOKENIZER_DIR / "tokenizer.json").exists():
        pytest.skip("project tokenizer not built yet")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    eos, think = tok.token_to_id("<|im_end|>"), tok.token_to_id("</think>")
    cfg = SimConfig(port=0, decode_tok_per_s=0, tokenizer=str(TOKENIZER_DIR))
    with SimServer(cfg) as srv:
        assert srv.url
        outs = [
            gen(srv.url, [9, n], sampling_params={"max_new_tokens": 5000}).json() for n in range(5)
        ]
    out = max(outs, key=lambda o: o["meta_info"]["completion_tokens"])
    ids, meta = out["output_ids"], out["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": eos} and ids[-1] == eos
    assert think in ids and "</think>" in out["text"] and "<|im_end|>" not in out["text"]
    assert meta["reasoning_tokens"] == ids.index(think) + 1
    assert 0.4 < ids.index(think) / len(ids) < 0.8
    assert out["text"] == tok.decode(ids, skip_special_tokens=True)


def test_a_prompt_with_reasoning_off_gets_no_think_marker() -> None:
    if not (TOKENIZER_DIR / "tokenizer.json").exists():
        pytest.skip("project tokenizer not built yet")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    opener, closer = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    assert opener is not None and closer is not None
    nl = tok.encode("\n", add_special_tokens=False).ids[0]
    cfg = SimConfig(port=0, decode_tok_per_s=0, tokenizer=str(TOKENIZER_DIR))
    params = {"max_new_tokens": 5000}
    with SimServer(cfg) as srv:
        assert srv.url
        on = [gen(srv.url, [9, n, opener, nl], sampling_params=params).json()
              for n in range(5)]
        off = [gen(srv.url, [9, n, opener, nl, nl, closer, nl, nl],
                   sampling_params=params).json() for n in range(5)]
    long_on = [o for o in on if o["meta_info"]["completion_tokens"] >= 3]
    assert long_on and all(closer in o["output_ids"] for o in long_on)
    assert all(o["meta_info"]["completion_tokens"] >= 3 for o in off)
    for out in off:
        assert closer not in out["output_ids"] and "</think>" not in out["text"]
        assert out["meta_info"]["reasoning_tokens"] == 0


def test_cli_flags_map_to_config() -> None:
    cfg = config_from_args(
        [
            "--port",
            "0",
            "--max-running-requests",
            "8",
            "--decode-tok-per-s",
            "0",
            "--max-queued-requests",
            "3",
            "--incremental-streaming-output",
            "--seed",
            "7",
        ]
    )
    assert cfg == SimConfig(
        port=0,
        max_running_requests=8,
        decode_tok_per_s=0.0,
        max_queued_requests=3,
        incremental_streaming_output=True,
        seed=7,
    )
    assert config_from_args([]) == SimConfig()


def test_stream_disconnect_frees_the_slot(slow: str) -> None:
    body = {"input_ids": [4, 4], "rid": "sgone-1", "stream": True, "sampling_params": LONG}
    with requests.post(slow + "/generate", json=body, stream=True, timeout=5) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first[len(b"data: ") :])["meta_info"]["finish_reason"] is None
    wait_for(lambda: stats(slow)["running"] == 0)
    entry = log_entry(slow, "sgone-1")
    assert entry["status"] == 200 and entry["finish_type"] == "abort"


def test_cli_main_serves_until_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "sim", "--port", "0", "--decode-tok-per-s", "0"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("datagen sim: serving on http://127.0.0.1:")
        url = line.split()[4]
        assert gen(url, [1, 2], sampling_params={"max_new_tokens": 3}).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
