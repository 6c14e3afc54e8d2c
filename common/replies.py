"""Redis replies as text, whatever the client's decode setting and redis-py's typing."""

from __future__ import annotations

from typing import Any


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def texts(values: Any) -> list[str]:
    return [text(v) for v in values]
