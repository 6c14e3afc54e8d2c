"""The request ids datagen sends to SGLang: how one is made, and which server it names.

A rid is ``<uuid4 hex>-<server tag>-<dataset>``. The uuid comes first because SGLang's
scheduler aborts by rid *prefix*, so no rid may be a prefix of another. The tag, a short
hash of the server's URL, lets a close send each abort to the one server that runs the
request rather than to every server of the fleet.
"""

from __future__ import annotations

import functools
import hashlib
import uuid

_UUID_HEX = 32
_TAG_HEX = 8


@functools.lru_cache(maxsize=256)  # a worker's few servers, hashed once, not once a task
def server_tag(url: str) -> str:
    return hashlib.blake2s(url.encode(), digest_size=_TAG_HEX // 2).hexdigest()


def new_rid(dataset: str, server: str) -> str:
    return f"{uuid.uuid4().hex}-{server_tag(server)}-{dataset}"


def tag_of(rid: str) -> str | None:
    """The server tag a rid carries; None for a rid not made by ``new_rid``."""
    end = _UUID_HEX + 1 + _TAG_HEX
    if len(rid) <= end or rid[_UUID_HEX] != "-" or rid[end] != "-":
        return None
    return rid[_UUID_HEX + 1:end]
