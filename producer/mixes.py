"""Sampling mixtures as the user writes them, checked at the door (common/draws.py draws).

  flag      --mix KEY=VALUE:WEIGHT,VALUE:WEIGHT,...   (repeatable; every dataset)
            e.g. --mix temperature=0.6:1,0.8:1,1.0:1 --mix reasoning_effort=low:4,medium:4,high:2
            A value is read as JSON when it is JSON (0.6, true, "a:b"), else as a string.
  manifest  [datasets.NAME.mix]
            temperature = [{value = 0.6, weight = 1}, {value = 0.8, weight = 1}]

KEY is a sampling parameter (temperature, top_p, top_k, min_p: each choice checked
against SGLang's rules) or any other name, which is then a chat template argument.
``max_new_tokens`` is a prompt's own allowance and is never mixed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from common.draws import Choice, Mixture, Mixtures
from common.errors import ConfigError
from common.sampling_rules import check_sampling

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def parse_mix_flags(texts: list[str] | None) -> Mixtures:
    """Every ``--mix`` flag, checked; a key given twice is refused."""
    found: dict[str, Mixture] = {}
    for text in texts or []:
        key, mixture = parse_mix_flag(text)
        if key in found:
            raise ConfigError(f"--mix {key} is given twice")
        found[key] = mixture
    return Mixtures.of(found)


def parse_mix_flag(text: str) -> tuple[str, Mixture]:
    """``KEY=VALUE:WEIGHT,...`` as (key, choices)."""
    key, eq, rest = text.partition("=")
    where = f"--mix {key.strip()}"
    if not eq or not rest.strip():
        raise ConfigError(f"--mix wants KEY=VALUE:WEIGHT,VALUE:WEIGHT,..., got {text!r}")
    key = _checked_key(key.strip(), "--mix")
    choices = []
    for part in rest.split(","):
        value, colon, weight = part.strip().rpartition(":")
        if not colon or not value:
            raise ConfigError(f"{where}: {part.strip()!r} is not VALUE:WEIGHT")
        choices.append(Choice(_flag_value(value), _weight(weight, where)))
    return key, _checked_choices(tuple(choices), where)


def mixes_from_table(where: str, table: Any) -> Mixtures:
    """A manifest's ``[datasets.NAME.mix]`` table, checked."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: mix must be a table of KEY = [{{value=..., weight=...}}]")
    found = {}
    for key, items in table.items():
        at = f"{where}: mix.{key}"
        _checked_key(key, at)
        if not isinstance(items, list) or not items:
            raise ConfigError(f"{at} must be a list of {{value = ..., weight = ...}} tables")
        found[key] = _checked_choices(tuple(_table_choice(at, i) for i in items), at)
    return Mixtures.of(found)


def check_mixtures(mixtures: Mixtures, fixed: Mapping[str, Any],
                   name: Callable[[str], str]) -> None:
    """Each sampling choice with the fixed values beside it, as SGLang checks a request."""
    for key in mixtures.sampling_keys:
        for choice in mixtures.choices[key]:
            check_sampling({**fixed, key: choice.value}, name=name)


def merged(base: Mixtures, over: Mixtures) -> Mixtures:
    """``over``'s keys over ``base``'s (a manifest table over the flags)."""
    return Mixtures.of({**base.choices, **over.choices})


def _checked_key(key: str, where: str) -> str:
    if key == "max_new_tokens":
        raise ConfigError(f"{where}: max_new_tokens is each prompt's own allowance; it "
                          "cannot be a mixture")
    if not _KEY.match(key):
        raise ConfigError(f"{where}: {key!r} is not a parameter name")
    return key


def _checked_choices(choices: Mixture, where: str) -> Mixture:
    seen: list[str] = []
    for choice in choices:
        try:
            frozen = json.dumps(choice.value, sort_keys=True)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: {choice.value!r} is not a JSON value") from None
        if frozen in seen:
            raise ConfigError(f"{where}: {frozen} is listed twice")
        seen.append(frozen)
    return choices


def _table_choice(where: str, item: Any) -> Choice:
    if not isinstance(item, dict) or "value" not in item or set(item) - {"value", "weight"}:
        raise ConfigError(f"{where}: each choice is {{value = ..., weight = ...}}, "
                          f"got {item!r}")
    return Choice(item["value"], _weight(item.get("weight", 1), where))


def _weight(raw: Any, where: str) -> float:
    try:
        weight = float(raw) if not isinstance(raw, bool) else math.nan
    except (TypeError, ValueError):
        weight = math.nan
    if not math.isfinite(weight) or weight <= 0:
        raise ConfigError(f"{where}: a weight must be a positive number, got {raw!r}")
    return weight


def _flag_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text

