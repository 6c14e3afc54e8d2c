"""An export's output text as the model wrote it, NUL characters included.

SQL's ``output_text`` holds each NUL as U+FFFD (common/sqltext.py); the output ids are
exact. A row whose stored text has a U+FFFD is decoded again from its ids with the
dataset's ``tokenizer.json`` and takes that text where storing it gives back the stored
one exactly; otherwise (no tokenizer file on disk, or a decoder that differs from the
server's) it keeps the stored text. Rows without U+FFFD, nearly all, cost one scan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from common.sqltext import REPLACEMENT, restored
from common.store import Store

Row = TypeVar("Row", bound=Any)  # an ExportRow: any dataclass with output_ids, output_text
Decoder = Callable[[Sequence[int]], str]


def load_decoder(tokenizer: str) -> Decoder | None:
    """The dataset tokenizer's decode (special tokens skipped, as the worker and SGLang
    decode), or None where no ``tokenizer.json`` loads."""
    path = Path(tokenizer) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception:  # a corrupt file must not stop the export: the stored text stands
        return None
    return lambda ids: str(tok.decode(list(ids), skip_special_tokens=True))


class OriginalText:
    """Called on each row of one dataset: the row with its original output text."""

    def __init__(self, store: Store, dataset: str) -> None:
        self.store, self.dataset = store, dataset
        self._decoder: Decoder | None = None
        self._loaded = False

    def __call__(self, row: Row) -> Row:
        if REPLACEMENT not in row.output_text:
            return row
        decode = self._decode()
        if decode is None:
            return row
        text = restored(row.output_text, decode(row.output_ids))
        return row if text == row.output_text else dataclasses.replace(row, output_text=text)

    def _decode(self) -> Decoder | None:
        if not self._loaded:  # only for a dataset that has such a row
            self._decoder = load_decoder(self.store.dataset(self.dataset).tokenizer)
            self._loaded = True
        return self._decoder
