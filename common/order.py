"""The order a dataset's prompts go out in, so that what a budget keeps is a fair sample.

A budget keeps a fraction of a dataset: the samples its queue hands out first. Each
prompt has a rank, stored with it (``prompts.rank``), and every path that publishes
prompts sends a dataset's prompts in (rank, sample_id) order, to a FIFO queue:

  shuffle  rank = BLAKE2b of the sample id's UTF-8 with an 8-byte digest, keyed with the
           seed as 8 big-endian bytes, read big-endian and shifted right one bit (63 bits,
           a signed BIGINT). A pure function of (seed, sample id): a re-run, a resume, a
           rebuild after Redis lost its data and a raised budget all continue the same
           random sequence, so the samples kept at any budget are a uniform random subset,
           and a larger budget keeps a superset of a smaller one.
  file     rank = the prompt's position among the dataset's prompts as read (0, 1, ...):
           the head of the files first.

A dataset keeps the order it was created with: a run that asks for another one while the
dataset holds prompts is refused, since it would re-draw which samples the budget keeps.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal, TypeVar

from common.errors import ConfigError

OrderKind = Literal["shuffle", "file"]
ORDERS: tuple[OrderKind, ...] = ("shuffle", "file")
DEFAULT_ORDER: OrderKind = "shuffle"
MAX_SEED = 2**63 - 1
T = TypeVar("T")


def shuffle_rank(seed: int, sample_id: str) -> int:
    """The rank of ``sample_id`` under ``seed``: the same in every process and version."""
    digest = hashlib.blake2b(sample_id.encode("utf-8"), digest_size=8,
                             key=seed.to_bytes(8, "big")).digest()
    return int.from_bytes(digest, "big") >> 1


def rank_key(rank: int | None, sample_id: str) -> tuple[bool, int, str]:
    """Sort key of the publishing order, as SQL's ``ORDER BY rank NULLS FIRST, sample_id``
    (a prompt stored before ranks existed has none)."""
    return (rank is not None, rank or 0, sample_id)


def check_seed(seed: object, where: str = "--seed") -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"{where} must be a whole number from 0 to {MAX_SEED}, not {seed!r}")
    return seed


def check_order(kind: object, where: str = "--order") -> OrderKind:
    if kind not in ORDERS:
        raise ConfigError(f"{where} must be one of {', '.join(ORDERS)}, not {kind!r}")
    return kind  # type: ignore[return-value]


@dataclass(frozen=True)
class Order:
    """A dataset's order: its kind, and its seed when shuffled (None in file order)."""

    kind: OrderKind = DEFAULT_ORDER
    seed: int | None = 0

    def __post_init__(self) -> None:
        check_order(self.kind, "order")
        if self.kind == "file":
            object.__setattr__(self, "seed", None)
        else:
            check_seed(self.seed, "seed")

    def describe(self) -> str:
        return "file order" if self.seed is None else f"shuffled with seed {self.seed}"

    def arrange(self, items: Iterable[T], sample_id: Callable[[T], str]) -> Iterator[tuple[int, T]]:
        """``items`` with their ranks, in publishing order. In file order they stream as
        they come; shuffled, all of them are read first (their ranks are known only then)."""
        if self.seed is None:
            return enumerate(items)
        seed = self.seed
        ranked = [(shuffle_rank(seed, sample_id(item)), item) for item in items]
        ranked.sort(key=lambda pair: (pair[0], sample_id(pair[1])))
        return iter(ranked)


@dataclass(frozen=True)
class OrderRequest:
    """The order a run asks for a dataset; None where it does not say."""

    kind: OrderKind | None = None
    seed: int | None = None
    # The seed of a new dataset whose run gives none (DATAGEN_DEFAULT_SEED).
    default_seed: int = 0

    def resolve(self, name: str, stored: Order | None, has_prompts: bool) -> Order:
        """The dataset's order for this run: the stored one where the run does not say;
        ConfigError where it asks for another one and the dataset holds prompts."""
        if stored is None or not has_prompts:
            kind = self.kind or DEFAULT_ORDER
            return Order(kind, self.default_seed if self.seed is None else self.seed)
        kind = self.kind or stored.kind
        seed = stored.seed if self.seed is None else self.seed
        wanted = Order(kind, seed if seed is not None else self.default_seed)
        if wanted != stored:
            raise ConfigError(
                f"dataset {name} holds prompts {stored.describe()}; this run asks for "
                f"{wanted.describe()}, which would re-draw the samples its budget keeps. "
                "Leave out --order and --seed (the stored order is kept) or use a new "
                "dataset name.")
        return stored
