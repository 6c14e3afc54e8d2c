"""Text as both databases can hold it, and the way back to what a model really wrote.

PostgreSQL's text columns refuse NUL (U+0000), which a model can emit (the byte-0 token of
a byte-level vocabulary) and a prompt file can hold (``\\u0000`` in its JSON). Every other
character, control characters included, is stored as it is. A text column holds NUL as
U+FFFD, the replacement character, on SQLite as on PostgreSQL, so that a query gives the
same answer on both; the token ids beside it stay exact, and exports decode the original
back from them (``restored``). JSON columns (a prompt's messages) need nothing: their
JSON text escapes NUL as ``\\u0000``, which both databases' ``json`` types keep.
"""

from __future__ import annotations

import re

NUL = "\x00"
REPLACEMENT = "\ufffd"
# A surrogate on its own is no character at all: neither database's driver can encode it.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def storable(text: str) -> str:
    """``text`` with each NUL (and any lone surrogate) replaced by U+FFFD."""
    if NUL in text:
        text = text.replace(NUL, REPLACEMENT)
    if not text.isascii():
        text = _LONE_SURROGATE.sub(REPLACEMENT, text)
    return text


def storable_or_none(text: str | None) -> str | None:
    return None if text is None else storable(text)


def restored(stored: str, decoded: str) -> str:
    """The original text of a stored one: ``decoded`` (the output ids decoded again) when
    storing it gives exactly ``stored``, else ``stored`` as it is (a decoder that differs
    from the one that made it must not change a character)."""
    if REPLACEMENT in stored and NUL in decoded and storable(decoded) == stored:
        return decoded
    return stored
