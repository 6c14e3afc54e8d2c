"""Connections to Redis and the database, with clear errors when they do not answer."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import redis

from common.errors import ServiceUnavailable
from common.ledger import Ledger
from common.pairing import pair
from common.settings import Settings
from common.store import Store


def safe_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password:
        netloc = f"{parts.username or ''}:***@{parts.hostname}"
        if parts.port:
            netloc += f":{parts.port}"
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def connect_redis(settings: Settings) -> redis.Redis:
    client = redis.Redis.from_url(
        settings.redis_url, socket_connect_timeout=5, health_check_interval=25
    )
    try:
        client.ping()
    except redis.RedisError as exc:
        raise ServiceUnavailable(
            f"Redis at {safe_url(settings.redis_url)} does not answer ({exc}); "
            "start it or set DATAGEN_REDIS_URL"
        ) from None
    return client


def connect(settings: Settings) -> tuple[Store, Ledger]:
    """The store and its ledger; StoreMismatch if the Redis holds another database's."""
    store = Store(settings.database_url, settings.db_connections)
    ledger = Ledger(connect_redis(settings))
    pair(store, ledger)
    return store, ledger
