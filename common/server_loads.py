"""What an SGLang server says of its load (``GET /v1/loads``), read into one record.

SGLang answers ``{"loads": [one entry per DP rank], "aggregate": {...}}``; each entry has
``num_running_reqs``, ``num_waiting_reqs``, ``num_used_tokens``, ``num_total_tokens`` (the
KV the running batch holds plus what the queue still has to prefill),
``max_total_num_tokens``, ``max_running_requests``, ``gen_throughput``, ``cache_hit_rate``
and ``queues.retracted`` (waiting requests that were retracted). A server's load is the sum
over its ranks. Routing (common/routing.py), the workers' poller (workers/load_poller.py)
and ``datagen status`` read it here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import requests

LOADS_PATH = "/v1/loads"
# A load answer slower than this is no use to a router polling every second or so.
LOAD_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ServerLoad:
    """One server's load, summed over its DP ranks, and when it was read (epoch s)."""

    running: int
    waiting: int
    used_tokens: int
    total_tokens: int
    max_total_tokens: int
    max_running: int
    gen_throughput: float
    cache_hit_rate: float
    retracted_waiting: int
    polled_at: float

    @property
    def token_usage(self) -> float:
        return self.used_tokens / self.max_total_tokens if self.max_total_tokens else 0.0

    def pressure(self, extra_requests: int = 0) -> float:
        """How full the server is: 1.0 is as many requests as it runs at once, or as many
        tokens as its KV pool holds, whichever is nearer. Waiting requests, and the tokens
        they still have to prefill, count too, so a server with a queue reads above 1.
        ``extra_requests``: requests sent to it since this was read."""
        reqs = self.running + self.waiting + extra_requests
        # A server that does not say how many it runs at once is compared by its count.
        by_requests = reqs / (self.max_running or 1)
        by_tokens = self.total_tokens / self.max_total_tokens if self.max_total_tokens else 0.0
        return max(by_requests, by_tokens)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> ServerLoad:
        return cls(**json.loads(raw))


def _number(entry: Mapping[str, Any], key: str) -> float:
    value = entry.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} is not a number: {value!r}")
    return float(value)


def parse_loads(body: Any, polled_at: float | None = None) -> ServerLoad:
    """The load of a ``/v1/loads`` answer; ValueError if it has not SGLang's shape."""
    if not isinstance(body, dict) or not isinstance(body.get("loads"), list) or not body["loads"]:
        raise ValueError("no 'loads' list in the answer")
    ranks: Sequence[Any] = body["loads"]
    if not all(isinstance(r, dict) for r in ranks):
        raise ValueError("a 'loads' entry is not an object")

    def total(key: str) -> float:
        return sum(_number(r, key) for r in ranks)

    retracted = sum(_number(r.get("queues") or {}, "retracted") for r in ranks)
    n = len(ranks)
    return ServerLoad(
        running=int(total("num_running_reqs")),
        waiting=int(total("num_waiting_reqs")),
        used_tokens=int(total("num_used_tokens")),
        total_tokens=int(total("num_total_tokens") or total("num_used_tokens")),
        max_total_tokens=int(total("max_total_num_tokens")),
        max_running=int(total("max_running_requests")),
        gen_throughput=total("gen_throughput"),
        cache_hit_rate=total("cache_hit_rate") / n,
        retracted_waiting=int(retracted),
        polled_at=time.time() if polled_at is None else polled_at,
    )


def fetch_load(url: str, session: requests.Session | None = None,
               timeout_s: float = LOAD_TIMEOUT_S,
               headers: Mapping[str, str] | None = None) -> ServerLoad | None:
    """``url``'s load, or None when it does not answer its load endpoint with one (down,
    too old an SGLang, a router that does not serve it)."""
    getter = session or requests
    try:
        resp = getter.get(f"{url}{LOADS_PATH}", timeout=timeout_s, headers=dict(headers or {}))
        if resp.status_code != 200:
            return None
        return parse_loads(resp.json())
    except (requests.RequestException, ValueError):
        return None


def fetch_loads(urls: Sequence[str], timeout_s: float = LOAD_TIMEOUT_S,
                headers: Mapping[str, str] | None = None) -> dict[str, ServerLoad | None]:
    """Every server's load, read side by side (a silent server costs one timeout)."""
    if not urls:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        found = pool.map(lambda u: fetch_load(u, timeout_s=timeout_s, headers=headers), urls)
        return dict(zip(urls, found, strict=True))
