"""Row ids unique across the datasets of one export.

A row's id is its sample id (a SpecForge turn row's, its conversation's with the turn
numbered from 0), as one dataset holds each once. Two datasets can hold the same ids:
both made from one file, say, or from files numbered alike. In one export folder (read
whole by speculators' ``--data FOLDER`` and by the dataset card's ``all`` config) their
rows would share ids, and a trainer keying on them (speculators resumes by
``primary_id``) would take one for the other.

So, when an export writes several datasets, the rows of a line whose id another of them
also holds are written ``<dataset>/<id>``: ``id``, ``primary_id`` and ``source_id``,
every row of that line alike (its turns, its generations), so the rows of one line keep
one key. Every other id is the sample id as it always was: an export of one dataset, or
of datasets from different files, writes the ids an earlier export wrote. A line is
what speculators' ``primary_id`` names: a conversation, or a prompt of its own, less the
``_gen<k>`` suffix of a dataset of several generations. The datasets and the results
compared are those the export writes, up to the bounds it reads, so ``validate`` finds
the same lines shared.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import sqlalchemy as sa

from common.conversation import conversation_of
from common.schema import prompt_inputs, results
from common.store import DatasetRow, Store
from producer.generations import line_id

SEPARATOR = "/"


def line_key(unit: str, generations: int) -> str:
    """The line of a conversation id or a sample id of a prompt of its own."""
    return line_id(unit) if generations > 1 else unit


def _units(store: Store, dataset: str, upto_id: int) -> Iterator[str]:
    """The conversations (and prompts outside any) with a result up to ``upto_id``."""
    unit = sa.func.coalesce(prompt_inputs.c.conversation, results.c.sample_id)
    q = sa.select(unit).distinct().select_from(results.outerjoin(
        prompt_inputs, sa.and_(prompt_inputs.c.dataset == results.c.dataset,
                               prompt_inputs.c.sample_id == results.c.sample_id),
    )).where(results.c.dataset == dataset, results.c.id <= upto_id)
    with store.engine.connect() as conn:
        yield from conn.execution_options(yield_per=10_000).scalars(q)


def shared_lines(store: Store, datasets: Sequence[DatasetRow], upto: Mapping[str, int]
                 ) -> frozenset[str]:
    """The lines held by more than one of ``datasets``, among their results up to
    ``upto``; none for a single dataset. Memory holds every line's key once."""
    if len(datasets) < 2:
        return frozenset()
    first: dict[str, str] = {}
    shared: set[str] = set()
    for ds in datasets:
        for unit in _units(store, ds.name, upto[ds.name]):
            key = line_key(unit, ds.generations)
            if first.setdefault(key, ds.name) != ds.name:
                shared.add(key)
    return frozenset(shared)


class RowIds:
    """One dataset's written ids: ``<dataset>/<id>`` for a shared line's rows."""

    def __init__(self, ds: DatasetRow, shared: frozenset[str] = frozenset()) -> None:
        self.prefix = f"{ds.name}{SEPARATOR}"
        self.generations, self.shared, self.turns = ds.generations, shared, ds.turns

    def written(self, unit: str, value: str) -> str:
        """``value``, an id of a row of ``unit`` (its conversation or sample id), as
        written."""
        return self.prefix + value if line_key(unit, self.generations) in self.shared \
            else value

    def stored(self, value: str) -> str:
        """A written id back as stored: the prefix off where this export put it on."""
        if not value.startswith(self.prefix):
            return value
        bare = value[len(self.prefix):]
        unit = conversation_of(bare) if self.turns == "all" else bare
        return bare if line_key(unit, self.generations) in self.shared else value
