"""kombu's Redis transport, sharing one redis-py client per connection pool.

Stock kombu builds a new ``redis.Redis`` for every bookkeeping step of a message (moving
it to the unacked hash on delivery, removing it on ack), and the constructor fills a
case-insensitive table of about 150 response callbacks each time: a sizeable share of a
worker's CPU at hundreds of tasks a second. A ``redis.Redis`` may be shared between
threads (each command checks a connection out of the pool), so one client per pool does
the same work. kombu drops its pools after a connection error and builds new ones, so
the shared client is rebuilt whenever the pool under it is not the current one.

Only the plain ``redis://`` scheme uses it: with an explicit transport kombu would skip
what the ``rediss://`` scheme implies (TLS), so those URLs keep the stock transport.
"""

from __future__ import annotations

from typing import Any

from kombu import connection as kombu_connection
from kombu.transport import redis as kombu_redis

TRANSPORT = f"{__name__}:Transport"
# How a connection names its transport in logs and URIs ("Cannot connect to redis://..."):
# kombu's table of display aliases, which only changes how this transport is shown.
kombu_connection.resolve_aliases.setdefault(TRANSPORT, "redis")


class Channel(kombu_redis.Channel):  # type: ignore[misc]
    _shared_client: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:
            return super()._create_client(asynchronous=True)
        pool = self.pool
        client = self._shared_client
        if client is None or client.connection_pool is not pool:
            # Two threads may both build one here; either is correct, the last one is kept.
            client = self._shared_client = super()._create_client()
        return client


class Transport(kombu_redis.Transport):  # type: ignore[misc]
    Channel = Channel


def transport_for(url: str) -> str | None:
    """The transport to name in Celery's ``broker_transport`` for ``url`` (None: kombu's)."""
    return TRANSPORT if url.startswith("redis://") else None
