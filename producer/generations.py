"""``--generations N``: N independent samples of each prompt, each a prompt of its own.

Generation k (from 0) of a line with id ``X`` is the sample ``X_gen<k>``, as speculators'
response regeneration names its rows; with N = 1 ids stay ``X``. Each generation is
ranked, drawn, admitted, charged, stored and exported as its own sample, so every
exactly-once guarantee of one sample holds for each. A conversation regenerated turn by
turn is copied before it is split into turns: generation k is the conversation
``X_gen<k>``, with turns ``X_gen<k>#turn<i>``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

from common.errors import ConfigError
from producer.reader import MAX_ID_CHARS, PromptRecord, ReadReport

# Enough for any sampling study; bounded so a typo does not store a million copies.
MAX_GENERATIONS = 1000


_MARK = "_gen"


def generation_id(sample_id: str, k: int) -> str:
    return f"{sample_id}{_MARK}{k}"


def line_id(generation: str) -> str:
    """The line's id of one of its generations' ids (a dataset of N > 1 generations)."""
    base, mark, k = generation.rpartition(_MARK)
    return base if mark and k.isdigit() else generation


def check_generations(value: object, where: str = "--generations") -> int:
    if isinstance(value, bool) or not isinstance(value, int) \
            or not 1 <= value <= MAX_GENERATIONS:
        raise ConfigError(f"{where} must be a whole number from 1 to {MAX_GENERATIONS}, "
                          f"not {value!r}")
    return value


def expand(records: Iterable[PromptRecord], n: int, report: ReadReport
           ) -> Iterator[PromptRecord]:
    """Each record as its ``n`` generations (as it is when ``n`` is 1); one whose
    suffixed ids would be too long is a bad line."""
    if n == 1:
        yield from records
        return
    longest = MAX_ID_CHARS - len(generation_id("", n - 1))
    for record in records:
        if len(record.sample_id) > longest:
            report.bad += 1
            report.problem(f"{record.source}: id is {len(record.sample_id)} characters; with "
                           f"{n} generations (ids '<id>_genK') it may have {longest} at most")
            continue
        for k in range(n):
            yield dataclasses.replace(record, sample_id=generation_id(record.sample_id, k))
