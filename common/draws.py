"""Sampling mixtures: a parameter drawn per sample from weighted choices.

A dataset may give any sampling parameter (temperature, top_p, top_k, min_p) or any chat
template argument (``reasoning_effort``, ``thinking``, ...) as a list of choices with
weights. Each sample's draw is a pure function of (dataset seed, draw id, parameter name):

  u      = BLAKE2b of "<parameter name>\\0<draw id>" (UTF-8) with an 8-byte digest, keyed
           with the seed as 8 big-endian bytes, read big-endian, divided by 2**64
  choice = the first choice whose running sum of weights exceeds u * (sum of weights)

The draw id is the sample id, or for a conversation regenerated turn by turn its
conversation id, so every turn of a conversation has the conversation's draw. A re-run,
a resume, a re-enqueue after Redis lost its data or a ``reopen`` never re-draws; each
generation of a prompt (``<id>_gen<k>``) has an id, and so a draw, of its own.

Which choices a key has is stored with the dataset (``datasets.mixtures``); a key among
``common.sampling_rules.SAMPLING_KEYS`` is a sampling parameter, any other a chat
template argument.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common.sampling_rules import SAMPLING_KEYS

_SCALE = float(2**64)


@dataclass(frozen=True)
class Choice:
    value: Any
    weight: float


Mixture = tuple[Choice, ...]


def draw(seed: int, draw_id: str, key: str, choices: Mixture) -> Any:
    """The value ``key`` takes for ``draw_id`` under ``seed``: the same in every process."""
    digest = hashlib.blake2b(f"{key}\0{draw_id}".encode(), digest_size=8,
                             key=seed.to_bytes(8, "big")).digest()
    target = int.from_bytes(digest, "big") / _SCALE * sum(c.weight for c in choices)
    running = 0.0
    for choice in choices:
        running += choice.weight
        if target < running:
            return choice.value
    return choices[-1].value  # float rounding at the very top of the range


def draw_key(drawn: Mapping[str, Any]) -> str:
    """A draw's canonical text: what a draw's renderer and reasoning opener are kept by."""
    return json.dumps(drawn, sort_keys=True)


def draw_id(sample_id: str, conversation: str | None) -> str:
    """What a prompt's draw is keyed by: its conversation's id, else its own."""
    return conversation if conversation is not None else sample_id


@dataclass(frozen=True)
class Mixtures:
    """A dataset's mixtures: each key's choices, keys in sorted order."""

    choices: Mapping[str, Mixture] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.choices)

    @property
    def sampling_keys(self) -> tuple[str, ...]:
        return tuple(k for k in self.choices if k in SAMPLING_KEYS)

    @property
    def template_keys(self) -> tuple[str, ...]:
        return tuple(k for k in self.choices if k not in SAMPLING_KEYS)

    def sampling(self, seed: int, ident: str) -> dict[str, Any]:
        """The sampling parameters drawn for ``ident`` (a draw id)."""
        return {k: draw(seed, ident, k, self.choices[k]) for k in self.sampling_keys}

    def template(self, seed: int, ident: str) -> dict[str, Any]:
        """The chat template arguments drawn for ``ident`` (a draw id)."""
        return {k: draw(seed, ident, k, self.choices[k]) for k in self.template_keys}

    def template_draws(self) -> list[dict[str, Any]]:
        """Every combination of template arguments a sample may be drawn; none without
        template mixtures."""
        keys = self.template_keys
        if not keys:
            return []
        values = [[c.value for c in self.choices[k]] for k in keys]
        return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]

    def to_json(self) -> dict[str, list[dict[str, Any]]] | None:
        """As the ``datasets.mixtures`` column holds it; None without any."""
        if not self.choices:
            return None
        return {k: [{"value": c.value, "weight": c.weight} for c in mix]
                for k, mix in self.choices.items()}

    @classmethod
    def from_json(cls, value: Mapping[str, Any] | None) -> Mixtures:
        if not value:
            return cls()
        return cls.of({k: tuple(Choice(c["value"], float(c["weight"])) for c in mix)
                       for k, mix in value.items()})

    @classmethod
    def of(cls, choices: Mapping[str, Mixture]) -> Mixtures:
        return cls({k: tuple(choices[k]) for k in sorted(choices)})

    def describe(self) -> str:
        """``temperature 0.6:1,0.8:1; reasoning_effort "low":4,...``, for messages."""
        return "; ".join(
            f"{k} " + ",".join(f"{json.dumps(c.value)}:{c.weight:g}" for c in mix)
            for k, mix in self.choices.items())


def seed_of(seed: int | None) -> int:
    """The draws' seed: the dataset's; a dataset in file order has none, and draws with 0."""
    return 0 if seed is None else seed
