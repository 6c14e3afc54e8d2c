"""One scheduler's load, as both engines report it for `/v1/loads` and `/metrics`.

Field names and meanings follow SGLang (repo sgl-project/sglang, python/sglang/srt/):
`managers/load_snapshot.py` (LoadSnapshot, the /v1/loads core keys), `metrics/collector.py`
(SchedulerStats, the sglang:* gauges) and `managers/scheduler_metrics_mixin.py` (how
token_usage, gen_throughput and cache_hit_rate are computed).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    """A snapshot of one scheduler (the simulator has one DP rank, rank 0)."""

    num_running_reqs: int
    num_waiting_reqs: int
    #: Prompt (+ generated, for retracted requests) tokens of the queue not in the cache.
    num_waiting_uncached_tokens: int
    #: KV tokens held by running requests (SGLang: pool - free - evictable cache).
    num_used_tokens: int
    max_total_num_tokens: int
    max_running_requests: int
    #: Output tokens/s over the recent decode window.
    gen_throughput: float
    #: Hit fraction of the latest prefill batch's prompt tokens.
    cache_hit_rate: float
    #: Requests retracted within the recent window (gauge), and since start (counters).
    num_retracted_reqs: int = 0
    retracted_reqs_total: int = 0
    retracted_input_tokens_total: int = 0
    retracted_output_tokens_total: int = 0
    new_token_ratio: float = 0.0
    #: Waiting requests that were retracted (SGLang's queues.retracted).
    num_waiting_retracted: int = 0

    @property
    def token_usage(self) -> float:
        """num_used_tokens / max_total_num_tokens."""
        total = self.max_total_num_tokens
        return self.num_used_tokens / total if total else 0.0

    @property
    def num_total_tokens(self) -> int:
        """KV tokens the running batch holds plus what the queue still has to prefill."""
        return self.num_used_tokens + self.num_waiting_uncached_tokens

    @property
    def utilization(self) -> float:
        """Running requests over the running-request cap."""
        cap = self.max_running_requests
        return self.num_running_reqs / cap if cap else 0.0

    def to_dict(self) -> dict[str, object]:
        """One entry of /v1/loads' `loads` list (core keys + queues, as SGLang orders them)."""
        return {
            "dp_rank": 0,
            "num_running_reqs": self.num_running_reqs,
            "num_waiting_reqs": self.num_waiting_reqs,
            "num_waiting_uncached_tokens": self.num_waiting_uncached_tokens,
            "num_used_tokens": self.num_used_tokens,
            "num_total_tokens": self.num_total_tokens,
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_running_requests": self.max_running_requests,
            "token_usage": round(self.token_usage, 4),
            "gen_throughput": round(self.gen_throughput, 2),
            "cache_hit_rate": round(self.cache_hit_rate, 4),
            "utilization": round(self.utilization, 4),
            "queues": {
                "waiting": self.num_waiting_reqs,
                "grammar": 0,
                "paused": 0,
                "retracted": self.num_waiting_retracted,
            },
            "num_total_reqs": self.num_running_reqs + self.num_waiting_reqs,
        }
