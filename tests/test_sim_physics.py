"""The simulator's GPU physics: step law, KV admission, retraction, prefix cache, metrics.

The scheduler is a pure state machine (`sim.gpusched`): each `step()` is one forward pass
and returns its simulated duration, so the hand-computed cases below need no clock. The
HTTP tests run the GPU mode at a large time scale and assert on what the server answers,
never on how long it took.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from sim import SimConfig, SimServer
from sim.gpujob import DECODE, PREFILL, Job, Step
from sim.gpusched import INIT_NEW_TOKEN_RATIO, LONE_OOM_MESSAGE, GpuScheduler
from sim.server import config_from_args
from sim.steplaw import PROFILES, StepLaw, steady_state_tok_per_s

LAW = StepLaw(t0_s=0.01, a_s_per_seq=0.001, c_s_per_kv_token=1e-6, p_s_per_token=1e-4)
_ids = itertools.count(10_000)


def fresh(n: int) -> list[int]:
    """n token ids never used before in this module (no accidental cache hits)."""
    return [next(_ids) for _ in range(n)]


def job(name: str, prompt: list[int], output: int, max_new: int | None = None) -> Job:
    return Job(name, prompt, fresh(output), max_new if max_new is not None else output)


def step(sched: GpuScheduler) -> Step:
    result = sched.step()
    assert result is not None, "the scheduler went idle"
    return result


def run_until(sched: GpuScheduler, done: Callable[[Step], bool], limit: int = 1000) -> Step:
    for _ in range(limit):
        result = step(sched)
        if done(result):
            return result
    raise AssertionError("condition not reached")


# ---- the step law --------------------------------------------------------------------------


def test_step_law_prefill_then_decode() -> None:
    sched = GpuScheduler(LAW, kv_tokens=1000, max_running_requests=8)
    sched.submit(job("a", fresh(10), 3))
    sched.submit(job("b", fresh(20), 3))
    first = step(sched)
    assert (first.kind, first.uncached_tokens, first.tokens) == (PREFILL, 30, 2)
    assert first.duration_s == pytest.approx(0.01 + 30 * 1e-4)
    second = step(sched)
    # both decode, reading (10 + 1) + (20 + 1) KV tokens
    assert second.kind == DECODE
    assert second.duration_s == pytest.approx(0.01 + 2 * 0.001 + 32 * 1e-6)
    assert [j.generated for j in sched.running] == [2, 2]
    assert sched.stats.clock_s == pytest.approx(first.duration_s + second.duration_s)
    last = step(sched)
    assert last.ended == last.jobs and not sched.running
    assert sched.step() is None
    assert sched.new_token_ratio == INIT_NEW_TOKEN_RATIO


def test_reference_profile_gives_about_930_tok_s_at_40_running() -> None:
    profile = PROFILES["reference"]
    tok_s = steady_state_tok_per_s(profile.law, running=40, prompt_tokens=1500, output_tokens=4096)
    assert tok_s == pytest.approx(40 / (0.041192 + 40 / 4096 * 0.169))
    assert 900 < tok_s < 960
    # 40 sequences halfway through 4K outputs fit the 159K pool, 48 would not
    assert 40 * (1500 + 2048) < profile.kv_tokens < 48 * (1500 + 2048)


# ---- KV admission --------------------------------------------------------------------------


@pytest.mark.parametrize(("b_max_new", "second_kind"), [(40, PREFILL), (45, DECODE)])
def test_admission_reserves_future_tokens(b_max_new: int, second_kind: str) -> None:
    """Pool 100. A (10 + 50) leaves 40 in round one, so B (10 + 40 or 45) waits; next round
    A's reserve is (50 - 1) * 0.7 = 34.3 of the 89 free: 54.7 left, enough for 50, not 55."""
    sched = GpuScheduler(LAW, kv_tokens=100, max_running_requests=8)
    a, b = job("a", fresh(10), 50), job("b", fresh(10), b_max_new)
    sched.submit(a)
    sched.submit(b)
    first = step(sched)
    assert first.jobs == [a] and list(sched.waiting) == [b]
    assert sched.used_tokens == 11
    second = step(sched)
    assert second.kind == second_kind
    assert (b in sched.running) == (second_kind == PREFILL)


def test_running_request_cap_limits_admission() -> None:
    sched = GpuScheduler(LAW, kv_tokens=10_000, max_running_requests=2)
    for name in "abc":
        sched.submit(job(name, fresh(5), 4))
    assert [j.rid for j in step(sched).jobs] == ["a", "b"]
    assert [j.rid for j in sched.waiting] == ["c"]


# ---- retraction ----------------------------------------------------------------------------


def test_decode_outgrowing_the_pool_retracts_and_recomputes() -> None:
    """Pool 60, A and B: 10-token prompts, 30-token outputs. With new_token_ratio forced to
    0.1 both get in (49 - 29 * 0.1 = 46.1 > 40); they hold 22 tokens and take 2 a step, so
    after 19 decode steps the pool is full and the 20th retracts B (tie: the later one).
    B keeps its 20 tokens, is prefilled again (prompt cached, 20 recomputed) and ends."""
    sched = GpuScheduler(LAW, kv_tokens=60, max_running_requests=8)
    a, b = job("a", fresh(10), 30), job("b", fresh(10), 30)
    sched.submit(a)
    sched.submit(b)
    assert step(sched).jobs == [a]
    sched.new_token_ratio = 0.1
    assert step(sched).jobs == [b]
    decodes = 0

    def retracted(s: Step) -> bool:
        nonlocal decodes
        decodes += 1
        return bool(s.retracted)

    hit = run_until(sched, retracted)
    assert decodes == 20 and hit.kind == DECODE
    assert hit.retracted == [b] and hit.jobs == [a]
    assert (a.generated, b.generated, b.retractions) == (21, 20, 1)
    assert sched.new_token_ratio == 1.0  # (20 + 20 * 1) / 30, capped
    stats = sched.stats
    assert (stats.retracted_reqs_total, stats.retracted_output_tokens_total) == (1, 20)
    assert sched.owed_recompute() == (1, 20)  # B waits with its 20 tokens to compute again
    refill = run_until(sched, lambda s: b in s.jobs and s.kind == PREFILL)
    assert (refill.hit_tokens, refill.uncached_tokens) == (10, 20)
    assert stats.recomputed_tokens_total == 20 and sched.owed_recompute() == (0, 0)
    run_until(sched, lambda s: b in s.ended)
    assert (a.done, b.done, b.generated, b.cached_tokens) == (True, True, 30, 0)
    assert sched.used_tokens == 0


def test_lone_request_runs_until_the_pool_is_full_then_aborts() -> None:
    """Pool 30, prompt 10 + max_new 30: over the estimate, admitted because the server is
    idle; 11 held after prefill, 19 decode steps fill the pool, the 20th aborts it."""
    sched = GpuScheduler(LAW, kv_tokens=30, max_running_requests=8)
    a = job("a", fresh(10), 30)
    sched.submit(a)
    assert step(sched).jobs == [a]
    last = run_until(sched, lambda s: bool(s.ended))
    assert last.ended == [a] and a.abort_message == LONE_OOM_MESSAGE
    assert (a.generated, sched.used_tokens, sched.running) == (20, 0, [])
    assert sched.step() is None


# ---- prefix cache ----------------------------------------------------------------------------


def test_shared_prefix_prefills_only_the_rest() -> None:
    sched = GpuScheduler(LAW, kv_tokens=1000, max_running_requests=8)
    shared = fresh(60)
    sched.submit(job("a", [*shared, *fresh(40)], 2))
    run_until(sched, lambda s: bool(s.ended))
    b = job("b", [*shared, *fresh(40)], 2)
    sched.submit(b)
    prefill = step(sched)
    assert (prefill.hit_tokens, prefill.uncached_tokens, b.cached_tokens) == (60, 40, 60)
    assert prefill.duration_s == pytest.approx(LAW.prefill_s(40))
    assert sched.stats.last_cache_hit_rate == pytest.approx(0.6)


def test_cache_evicts_the_least_recently_used_prefix() -> None:
    """Pool 250: A and B leave 105 cached tokens each; C's 100-token prefill finds 40 free
    and evicts the older leaf, A's. A later B-prefixed prompt still hits, an A one does not."""
    sched = GpuScheduler(LAW, kv_tokens=250, max_running_requests=8)
    p1, p2 = fresh(100), fresh(100)
    for name, prompt in (("a", p1), ("b", p2), ("c", fresh(100))):
        sched.submit(job(name, prompt, 5))
        run_until(sched, lambda s: bool(s.ended))
    e, d = job("e", [*p2, *fresh(1)], 2), job("d", [*p1, *fresh(1)], 2)
    for late in (e, d):
        sched.submit(late)
        run_until(sched, lambda s: bool(s.ended))
    assert (e.cached_tokens, d.cached_tokens) == (100, 0)


# ---- over HTTP -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu() -> Iterator[str]:
    cfg = SimConfig(port=0, physics="gpu", time_scale=1000.0, mean_output_tokens=40)
    with SimServer(cfg) as srv:
        assert srv.url
        yield srv.url


@pytest.fixture(scope="module")
def fast() -> Iterator[str]:
    with SimServer(SimConfig(port=0, decode_tok_per_s=0, mean_output_tokens=40)) as srv:
        assert srv.url
        yield srv.url


def generate(url: str, ids: list[int], **params: object) -> dict[str, object]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 64, **params}}
    resp = requests.post(url + "/generate", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    meta = resp.json()["meta_info"]
    assert isinstance(meta, dict)
    return meta


def test_gpu_mode_reports_cached_tokens_and_keeps_outputs(gpu: str, fast: str) -> None:
    shared = fresh(300)
    first = generate(gpu, [*shared, *fresh(20)])
    second_ids = [*shared, *fresh(20)]
    second = generate(gpu, second_ids)
    assert (first["cached_tokens"], second["cached_tokens"]) == (0, 300)
    assert second["num_retractions"] == 0
    # same prompt, same output ids in both modes: the physics only decides when
    body = {"input_ids": second_ids, "sampling_params": {"max_new_tokens": 64}}
    outs = [requests.post(u + "/generate", json=body, timeout=30).json() for u in (gpu, fast)]
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    assert outs[0]["meta_info"]["finish_reason"] == outs[1]["meta_info"]["finish_reason"]


def test_gpu_mode_clock_counts_passes_and_idle_time_not_its_own_overhead() -> None:
    cfg = SimConfig(port=0, physics="gpu", time_scale=10.0, mean_output_tokens=40)
    with SimServer(cfg) as srv:
        def clock() -> float:
            return float(requests.get(f"{srv.url}/sim/stats", timeout=10).json()["sim_clock_s"])

        start = clock()
        meta = generate(srv.url, fresh(100), max_new_tokens=16)
        after_one = clock()
        law = PROFILES["reference"].law
        # One prefill of 100 tokens (its first token), then a decode pass a token.
        passes = law.prefill_s(100) + (int(meta["completion_tokens"]) - 1) * law.decode_s(1, 100)
        assert after_one - start >= passes
        busy = float(requests.get(f"{srv.url}/sim/stats", timeout=10).json()["simulated_s"])
        assert passes <= busy <= after_one - start  # the passes alone
        time.sleep(0.5)  # idle: half a second of wall time is 5 simulated seconds
        assert clock() - after_one >= 0.5 * cfg.time_scale
        stats = requests.get(f"{srv.url}/sim/stats", timeout=10).json()
        assert stats["simulated_s"] == busy  # nothing while idle
        assert (stats["prefill_steps_total"], stats["prompt_uncached_tokens_total"]) == (1, 100)
        assert (stats["waiting_retracted"], stats["waiting_retracted_tokens"]) == (0, 0)
        assert stats["prefill_s_total"] == pytest.approx(law.prefill_s(100))
    with SimServer(SimConfig(port=0, decode_tok_per_s=0)) as srv:
        stats = requests.get(f"{srv.url}/sim/stats", timeout=10).json()
        assert stats["sim_clock_s"] is None and stats["prefill_steps_total"] is None


def test_gpu_mode_keeps_its_time_scale_with_passes_shorter_than_a_loop_tick() -> None:
    from sim.gpu import MAX_BEHIND_S, Pacer

    def run(passes: int, real_s: float, overhead_s: float, tick_s: float = 0.001) -> float:
        """Real seconds ``passes`` passes take on a loop whose sleeps last a tick at least
        and whose every pass costs ``overhead_s``."""
        pacer, now = Pacer(), 100.0
        pacer.restart(now)
        for _ in range(passes):
            now += overhead_s
            sleep = pacer.delay(now, real_s)
            now += max(sleep, tick_s) if sleep > 0 else 0.0
        return now - 100.0

    # 40 ms passes at a time scale of 200: 1,000 of them are 0.2 s of real time, not the
    # 1 s one tick-long sleep a pass would take.
    assert run(1000, 0.0002, overhead_s=0.00001) == pytest.approx(0.2, abs=0.002)
    # Passes that are long against the tick keep their own durations.
    assert run(10, 0.01, overhead_s=0.0001) == pytest.approx(0.1, abs=0.002)
    # A loop slower than its pace (its own work) runs flat out, not ahead of it.
    assert run(1000, 0.0002, overhead_s=0.001) == pytest.approx(1.0)
    # Fallen behind, it catches up at most MAX_BEHIND_S of passes unslept.
    pacer = Pacer()
    pacer.restart(0.0)
    assert pacer.delay(1.0, 0.0002) == 0.0
    assert pacer.due == pytest.approx(1.0 - MAX_BEHIND_S + 0.0002)


def test_gpu_mode_streams(gpu: str) -> None:
    body = {"input_ids": fresh(8), "stream": True, "sampling_params": {"max_new_tokens": 30}}
    resp = requests.post(gpu + "/generate", json=body, timeout=30)
    assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")


def test_gpu_mode_abort_ends_a_running_stream() -> None:
    """Real time: 2000 tokens would take ~40 s, so the abort lands mid-decode."""
    with SimServer(SimConfig(port=0, physics="gpu", mean_output_tokens=5000)) as srv:
        body = {
            "input_ids": fresh(8),
            "rid": "gpu-abort-1",
            "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
        }
        with requests.post(f"{srv.url}/generate", json=body, stream=True, timeout=30) as resp:
            lines = (line for line in resp.iter_lines() if line)
            assert next(lines).startswith(b"data: {")
            requests.post(f"{srv.url}/abort_request", json={"rid": "gpu-abort-1"}, timeout=5)
            events = [line for line in lines if line != b"data: [DONE]"]
        final = json.loads(events[-1][len(b"data: ") :])
        assert final["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < final["meta_info"]["completion_tokens"] < 2000


@pytest.mark.parametrize("mode", ["gpu", "fast"])
def test_loads_endpoint_has_sglang_keys(mode: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(mode)
    generate(url, fresh(30))
    body = requests.get(url + "/v1/loads", timeout=5).json()
    assert body["dp_rank_count"] == 1
    (load,) = body["loads"]
    for key in (
        "dp_rank",
        "num_running_reqs",
        "num_waiting_reqs",
        "num_used_tokens",
        "max_total_num_tokens",
        "token_usage",
        "gen_throughput",
        "cache_hit_rate",
        "max_running_requests",
    ):
        assert key in load, key
    assert load["max_running_requests"] == 48
    expected_pool = 159_000 if mode == "gpu" else 48 * 32768
    assert load["max_total_num_tokens"] == expected_pool
    assert body["aggregate"]["total_reqs"] == load["num_running_reqs"] + load["num_waiting_reqs"]
    text = requests.get(url + "/v1/loads?format=prometheus", timeout=5).text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"sglang_num_running_reqs", "sglang_token_usage"} <= names


@pytest.mark.parametrize("mode", ["gpu", "fast"])
def test_metrics_parse_as_prometheus_text(mode: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(mode)
    generate(url, fresh(30))
    resp = requests.get(url + "/metrics", timeout=5)
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:gen_throughput",
        "sglang:num_retracted_reqs",
        "sglang:cache_hit_rate",
        "sglang:max_total_num_tokens",
    ):
        assert families[name].type == "gauge", name
        (sample,) = families[name].samples
        assert sample.labels == {
            "model_name": "datagen-sim",
            "engine_type": "unified",
            "tp_rank": "0",
            "pp_rank": "0",
            "moe_ep_rank": "0",
        }
    requests_total = families["sglang:num_requests"]
    assert requests_total.type == "counter"
    assert requests_total.samples[0].name == "sglang:num_requests_total"
    assert requests_total.samples[0].value >= 1
    assert families["sglang:num_retracted_requests"].type == "counter"


def test_cli_flags_select_the_gpu_mode() -> None:
    cfg = config_from_args(["--physics", "gpu", "--kv-tokens", "5000", "--time-scale", "50"])
    assert (cfg.physics, cfg.profile, cfg.kv_pool_tokens, cfg.time_scale) == (
        "gpu",
        "reference",
        5000,
        50.0,
    )
    assert cfg.max_req_input_len == 5000 - 1 - 5
    with pytest.raises(SystemExit):
        config_from_args(["--time-scale", "0"])
