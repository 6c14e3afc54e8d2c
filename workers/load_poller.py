"""The servers' loads, read once per interval for the whole fleet, for the router and
the concurrency gate.

Every ``load_poll_s`` each worker process asks Redis for the poll lock; the one that gets
it reads every server's ``/v1/loads`` side by side and writes them to ``SERVER_LOADS``,
and the others read that hash. So the servers answer one load request per interval
whatever the number of workers, and each process's router (common/routing.py) gets the
same readings. A server that gives no reading has its field deleted: the router then
sends it its round-robin share. The process that polled also steps the concurrency
controllers (common/auto_limits.py); every process gives its gate its share.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import redis
from celery import bootsteps

from common.auto_limits import process_limits, read_limits, step_limits
from common.keys import SERVER_LOADS, SERVER_LOADS_LOCK
from common.routing import LoadRouter
from common.server_loads import ServerLoad, fetch_loads
from workers.context import get_context
from workers.gate import Gate

log = logging.getLogger(__name__)


def poll_once(client: redis.Redis, urls: tuple[str, ...], interval_s: float,
              headers: Mapping[str, str] | None = None) -> dict[str, ServerLoad | None]:
    """This interval's readings: polled here if this process holds the lock, else the
    ones another process wrote."""
    return _poll_or_read(client, urls, interval_s, headers)[1]


def _poll_or_read(client: redis.Redis, urls: tuple[str, ...], interval_s: float,
                  headers: Mapping[str, str] | None = None,
                  ) -> tuple[bool, dict[str, ServerLoad | None]]:
    """Whether this process polled (it held the lock), and the interval's readings."""
    lock_ms = max(1, int(interval_s * 1000))
    if client.set(SERVER_LOADS_LOCK, "1", nx=True, px=lock_ms):
        loads = fetch_loads(urls, timeout_s=min(2.0, max(0.2, interval_s)), headers=headers)
        pipe = client.pipeline(transaction=False)
        for url, load in loads.items():
            if load is not None:
                pipe.hset(SERVER_LOADS, url, load.to_json())
        missing = [u for u, load in loads.items() if load is None]
        if missing:
            pipe.hdel(SERVER_LOADS, *missing)
        pipe.pexpire(SERVER_LOADS, 2 * lock_ms + 2000)
        pipe.execute()
        return True, loads
    raw = client.hmget(SERVER_LOADS, list(urls))
    return False, {u: (ServerLoad.from_json(r) if r else None)
                   for u, r in zip(urls, raw, strict=True)}


class LoadPoller:
    """Feeds ``router`` and ``gate`` on a daemon thread until stopped."""

    def __init__(self, client: redis.Redis, urls: tuple[str, ...], interval_s: float,
                 headers: Mapping[str, str] | None = None, router: LoadRouter | None = None,
                 gate: Gate | None = None, dead_after_s: float = 20.0) -> None:
        self.client, self.urls, self.interval_s = client, urls, interval_s
        self.router, self.gate, self.dead_after_s = router, gate, dead_after_s
        self.headers = dict(headers or {})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="datagen-loads")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def poll(self) -> None:
        """One interval: the readings, and (the process that polled) the limits stepped."""
        polled, loads = _poll_or_read(self.client, self.urls, self.interval_s, self.headers)
        if self.router is not None:
            self.router.update(loads)
        # Stepped by whichever process polled, auto or not: one controller for the fleet.
        states = (step_limits(self.client, loads, self.interval_s) if polled
                  else read_limits(self.client, list(self.urls)))
        if self.gate is not None:
            self.gate.set_limits(process_limits(self.client, states, self.urls,
                                                self.dead_after_s))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except redis.RedisError as exc:
                # Routing goes on with the readings it has until they go stale, then by
                # round robin, and the gate with the limits it has; the heartbeat reports
                # Redis being away.
                log.debug("server loads not read: %s", exc)
            except Exception:
                log.exception("server loads not read; trying again")
            self._stop.wait(self.interval_s)


class LoadPolling(bootsteps.StartStopStep):
    """Consumer bootstep: poll while the worker consumes, where its client routes by load
    or its gate sizes concurrency by it."""

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._poller: LoadPoller | None = None

    def start(self, c: Any) -> None:
        ctx = get_context(c.app)
        router, gate = ctx.client.router, ctx.gate
        if (router is None and gate is None) or not ctx.settings.load_poll_s:
            return
        self._poller = LoadPoller(ctx.ledger.redis, ctx.settings.sglang_urls,
                                  ctx.settings.load_poll_s, ctx.client.headers, router, gate,
                                  ctx.settings.dead_after_s)
        self._poller.start()

    def stop(self, c: Any) -> None:
        if self._poller is not None:
            self._poller.stop()
            self._poller = None
