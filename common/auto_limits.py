"""The fleet's concurrency limits in Redis: stepped by the poller, shared by every worker.

The worker that polled the servers this interval (workers/load_poller.py) steps each
server's controller (common/concurrency.py) with the fresh reading and writes the new
state to ``AUTO_LIMITS``; every worker then takes its share of each limit, the fleet's
limit divided by the live workers (the heartbeat registry, ``WORKERS``). So there is one
controller per server whatever the number of workers, and its state survives the poll
lock passing from one worker to another.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import redis

from common.concurrency import AutoLimit, LimitState, share
from common.keys import AUTO_LIMITS, WORKERS
from common.server_loads import ServerLoad

# A state unused this long (no worker polling: the fleet stopped) is started afresh.
MIN_TTL_S = 60.0
CONTROLLER = AutoLimit()


def step_limits(client: redis.Redis, loads: Mapping[str, ServerLoad | None],
                interval_s: float) -> dict[str, LimitState]:
    """Step every server's controller with its fresh reading; a server without one loses
    its state (it gets the fallback until it publishes a load again)."""
    urls = list(loads)
    held = _states(client, urls)
    stepped = {u: CONTROLLER.step(held.get(u), load) for u, load in loads.items()
               if load is not None}
    pipe = client.pipeline(transaction=False)
    if stepped:
        pipe.hset(AUTO_LIMITS, mapping={u: s.to_json() for u, s in stepped.items()})
    missing = [u for u, load in loads.items() if load is None]
    if missing:
        pipe.hdel(AUTO_LIMITS, *missing)
    pipe.pexpire(AUTO_LIMITS, int(1000 * max(MIN_TTL_S, 10 * interval_s)))
    pipe.execute()
    return stepped


def read_limits(client: redis.Redis, urls: list[str]) -> dict[str, LimitState]:
    """The states the last poller wrote."""
    return _states(client, urls)


def process_limits(client: redis.Redis, states: Mapping[str, LimitState],
                   urls: tuple[str, ...], dead_after_s: float) -> dict[str, int | None]:
    """This worker's share of each server's limit (None: no state, so no load reading)."""
    workers = int(client.zcount(WORKERS, time.time() - dead_after_s, "+inf"))
    return {u: share(states[u].limit, workers) if u in states else None for u in urls}


def _states(client: redis.Redis, urls: list[str]) -> dict[str, LimitState]:
    if not urls:
        return {}
    raw = client.hmget(AUTO_LIMITS, urls)
    return {u: LimitState.from_json(r) for u, r in zip(urls, raw, strict=True) if r}
