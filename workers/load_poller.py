"""The servers' loads, read once per interval for the whole fleet, for the router.

Every ``load_poll_s`` each worker process asks Redis for the poll lock; the one that gets
it reads every server's ``/v1/loads`` side by side and writes them to ``SERVER_LOADS``,
and the others read that hash. So the servers answer one load request per interval
whatever the number of workers, and each process's router (common/routing.py) gets the
same readings. A server that gives no reading has its field deleted: the router then
sends it its round-robin share.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import redis
from celery import bootsteps

from common.keys import SERVER_LOADS, SERVER_LOADS_LOCK
from common.routing import LoadRouter
from common.server_loads import ServerLoad, fetch_loads
from workers.context import get_context

log = logging.getLogger(__name__)


def poll_once(client: redis.Redis, urls: tuple[str, ...], interval_s: float,
              headers: Mapping[str, str] | None = None) -> dict[str, ServerLoad | None]:
    """This interval's readings: polled here if this process holds the lock, else the
    ones another process wrote."""
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
        return loads
    raw = client.hmget(SERVER_LOADS, list(urls))
    return {u: (ServerLoad.from_json(r) if r else None) for u, r in zip(urls, raw, strict=True)}


class LoadPoller:
    """Feeds ``router`` on a daemon thread until stopped."""

    def __init__(self, client: redis.Redis, router: LoadRouter, interval_s: float,
                 headers: Mapping[str, str] | None = None) -> None:
        self.client, self.router, self.interval_s = client, router, interval_s
        self.headers = dict(headers or {})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="datagen-loads")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.router.update(poll_once(self.client, self.router.urls, self.interval_s,
                                             self.headers))
            except redis.RedisError as exc:
                # Routing goes on with the readings it has until they go stale, then by
                # round robin; the heartbeat reports Redis being away.
                log.debug("server loads not read: %s", exc)
            except Exception:
                log.exception("server loads not read; trying again")
            self._stop.wait(self.interval_s)


class LoadPolling(bootsteps.StartStopStep):
    """Consumer bootstep: poll while the worker consumes, where its client routes by load."""

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._poller: LoadPoller | None = None

    def start(self, c: Any) -> None:
        ctx = get_context(c.app)
        router = ctx.client.router
        if router is None:
            return
        self._poller = LoadPoller(ctx.ledger.redis, router, ctx.settings.load_poll_s,
                                  ctx.client.headers)
        self._poller.start()

    def stop(self, c: Any) -> None:
        if self._poller is not None:
            self._poller.stop()
            self._poller = None
