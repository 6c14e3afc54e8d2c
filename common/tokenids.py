"""Token id lists as packed little-endian uint32 bytes, exact both ways."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Dialect

_SWAP = sys.byteorder != "little"


def pack(ids: Sequence[int]) -> bytes:
    buf = array("I", ids)
    if _SWAP:
        buf.byteswap()
    return buf.tobytes()


def unpack(raw: bytes) -> list[int]:
    buf = array("I")
    buf.frombytes(raw)
    if _SWAP:
        buf.byteswap()
    return buf.tolist()


class TokenIds(sa.types.TypeDecorator[list[int]]):
    """A list[int] column stored as packed uint32 bytes."""

    impl = sa.LargeBinary
    cache_ok = True

    def process_bind_param(self, value: Sequence[int] | None, dialect: Dialect) -> bytes | None:
        return None if value is None else pack(value)

    def process_result_value(self, value: bytes | None, dialect: Dialect) -> list[int] | None:
        return None if value is None else unpack(bytes(value))
