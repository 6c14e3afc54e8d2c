"""The sampling values a dataset may be stored with: the ranges SGLang enforces, checked
at the door.

SGLang checks a request's sampling in ``SamplingParams.verify()``
(python/sglang/srt/sampling/sampling_params.py) and answers HTTP 400 to a value out of
range. A 400 is permanent, so a value it refuses, once stored, fails every sample of
the dataset: ``datagen enqueue`` and ``datagen retry`` refuse it before anything is
stored instead. The texts are SGLang's own.

| key            | type  | SGLang's rule                                             |
| -------------- | ----- | --------------------------------------------------------- |
| temperature    | float | finite and >= 0 (below 1e-6: greedy, top_k forced to 1)   |
| top_p          | float | in (0, 1]                                                 |
| top_k          | int   | -1 (the whole vocabulary) or >= 1; not checked when greedy |
| min_p          | float | in [0, 1]                                                 |
| max_new_tokens | int   | >= 0 in SGLang; datagen asks >= 1, since 0 generates nothing |
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from common.errors import ConfigError

# SGLang's _SAMPLING_EPS: a temperature below it means greedy decoding.
GREEDY_BELOW = 1e-6


@dataclass(frozen=True)
class Rule:
    key: str
    kind: type[int] | type[float]
    says: str  # what the value must be, in SGLang's words
    ok: Callable[[float], bool]
    what: str  # what the value is, for --help


RULES: tuple[Rule, ...] = (
    Rule("temperature", float, "must be a non-negative finite number",
         lambda v: math.isfinite(v) and v >= 0.0, "sampling temperature"),
    Rule("top_p", float, "must be in (0, 1]", lambda v: 0.0 < v <= 1.0,
         "nucleus sampling mass"),
    Rule("top_k", int, "must be -1 (disable) or at least 1", lambda v: v == -1 or v >= 1,
         "top-k cut-off, -1 for none"),
    Rule("min_p", float, "must be in [0, 1]", lambda v: 0.0 <= v <= 1.0, "min-p cut-off"),
    Rule("max_new_tokens", int, "must be at least 1", lambda v: v >= 1,
         "output cap of one request, in tokens"),
)
SAMPLING_KEYS = tuple(r.key for r in RULES if r.key != "max_new_tokens")


def as_flag(key: str) -> str:
    """How ``datagen enqueue`` and ``datagen retry`` spell the key: ``--top-p``."""
    return "--" + key.replace("_", "-")


def add_sampling_flags(parser: argparse.ArgumentParser, help: str | None = None,
                       defaults: Mapping[str, Any] | None = None) -> None:
    """``--temperature``, ``--top-p``, ``--top-k``, ``--min-p``, each of its rule's type;
    their help says what each is and, given ``defaults``, the value used without it."""
    for rule in RULES:
        if rule.key in SAMPLING_KEYS:
            text = help or f"{rule.what}, sent on every request"
            if defaults is not None and rule.key in defaults:
                text += f" (default: {defaults[rule.key]}, SGLang's own)"
            parser.add_argument(as_flag(rule.key), type=rule.kind, help=text)


def sampling_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags given, checked: a value SGLang refuses raises ConfigError."""
    given = {k: getattr(args, k, None) for k in SAMPLING_KEYS}
    flags = {k: v for k, v in given.items() if v is not None}
    check_sampling(flags)
    return flags


def check_sampling(values: Mapping[str, Any],
                   name: Callable[[str], str] = as_flag) -> None:
    """Raise ConfigError for the first value SGLang would refuse, named by ``name(key)``.

    Keys without a rule are left to their caller; a key absent is SGLang's default.
    """
    greedy = _is_greedy(values.get("temperature"))
    for rule in RULES:
        if rule.key not in values or (rule.key == "top_k" and greedy):
            continue
        value = values[rule.key]
        if not _of_kind(value, rule.kind):
            kind = "an integer" if rule.kind is int else "a number"
            raise ConfigError(f"{name(rule.key)} must be {kind}, got {value!r}")
        if not rule.ok(value):
            raise ConfigError(f"{name(rule.key)} {rule.says}, got {_shown(value)}")


def _of_kind(value: Any, kind: type) -> bool:
    if isinstance(value, bool):  # a TOML true is an int to Python, not to SGLang
        return False
    return isinstance(value, int) if kind is int else isinstance(value, int | float)


def _is_greedy(temperature: Any) -> bool:
    # SGLang's __post_init__ turns 0 <= temperature < 1e-6 into top_k = 1 before verify().
    return _of_kind(temperature, float) and 0.0 <= temperature < GREEDY_BELOW


def _shown(value: float) -> str:
    """7.0 as 7, as the user typed it; nan and inf as Python spells them."""
    return f"{value:g}"
