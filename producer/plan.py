"""What to enqueue: per dataset its files, budget, sampling (and mixtures), order and
generations, from flags or a manifest."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from common.budget import Budget, parse_budget_tokens
from common.conversation import TURN_MODES
from common.draws import Mixtures
from common.errors import ConfigError
from common.names import validate_dataset_name
from common.order import OrderRequest, check_order, check_seed
from common.sampling_rules import SAMPLING_KEYS, check_sampling
from producer.generations import check_generations
from producer.mixes import check_mixtures, merged, mixes_from_table
from producer.reader import discover

# SGLang's own defaults, sent explicitly: /generate does not read generation_config.
DEFAULT_SAMPLING: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}


@dataclass(frozen=True)
class DatasetPlan:
    name: str
    files: tuple[Path, ...]
    budget: Budget = field(default_factory=Budget)
    sampling: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_SAMPLING))
    max_new_tokens: int = 16384
    # "all": every assistant turn regenerated (common/conversation.py); None: the dataset's
    # stored mode, else "all" (producer/enqueue.py).
    turns: str | None = "last"
    order: OrderRequest = field(default_factory=OrderRequest)
    mixtures: Mixtures = field(default_factory=Mixtures)  # common/draws.py
    generations: int | None = None  # None: the dataset's stored number, else 1
    # SGLang's --tool-call-parser name: tool-calling turns are parsed by the server with it.
    tool_call_parser: str | None = None


@dataclass(frozen=True)
class Draws:
    """What the flags say of each sample's draws: its mixtures, and its generations."""

    mixtures: Mixtures = field(default_factory=Mixtures)
    generations: int | None = None


def plans_from_paths(
    paths: list[str], budget: Budget, sampling: dict[str, Any], max_new_tokens: int,
    turns: str | None = "last",
    order: OrderRequest | None = None,
    draws: Draws | None = None,
    tool_call_parser: str | None = None,
) -> list[DatasetPlan]:
    draws = draws or Draws()
    check_mixtures(draws.mixtures, sampling, name=lambda k: f"--mix {k}")
    return [
        DatasetPlan(name, tuple(files), budget, _fixed(sampling, draws.mixtures),
                    max_new_tokens, turns, order or OrderRequest(), draws.mixtures,
                    draws.generations, tool_call_parser)
        for name, files in discover(paths).items()
    ]


def _fixed(sampling: dict[str, Any], mixtures: Mixtures) -> dict[str, Any]:
    """The sampling sent as it is: a mixed key is drawn per sample instead."""
    return {k: v for k, v in sampling.items() if k not in mixtures.choices}


def plans_from_manifest(
    path: str, budget: Budget, sampling: dict[str, Any], max_new_tokens: int,
    turns: str | None = "last",
    order: OrderRequest | None = None,
    draws: Draws | None = None,
    tool_call_parser: str | None = None,
) -> list[DatasetPlan]:
    """A TOML manifest: one ``[datasets.NAME]`` table per dataset.

        [datasets.B2]
        files = ["prompts/B2.jsonl"]     # relative to the manifest
        budget_tokens = "10M"
        policy = "drain"                 # drain | abort | exact
        basis = "output"                 # output | total
        max_new_tokens = 16384
        turns = "all"                    # all | last
        tool_call_parser = "kimi_k2"     # SGLang's parser name, for tool-calling turns
        temperature = 0.6                # also top_p, top_k, min_p
        order = "shuffle"                # shuffle | file
        seed = 7
        generations = 3                  # ids <id>_gen0 .. <id>_gen2

        [datasets.B2.mix]                # drawn per sample (producer/mixes.py)
        reasoning_effort = [{value = "low", weight = 4}, {value = "high", weight = 2}]
    """
    source = Path(path)
    try:
        doc = tomllib.loads(source.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"manifest {path}: {exc}") from None
    tables = doc.get("datasets")
    if not isinstance(tables, dict) or not tables:
        raise ConfigError(f"manifest {path}: no [datasets.NAME] tables")
    return [
        replace(_plan_from_table(source, name, spec, budget, sampling, max_new_tokens, turns,
                                 order or OrderRequest(), draws or Draws()),
                tool_call_parser=_parser_from_table(source, name, spec, tool_call_parser))
        for name, spec in tables.items()
    ]


def _plan_from_table(
    source: Path, name: str, spec: Any, budget: Budget, sampling: dict[str, Any], max_new: int,
    turns: str | None,
    order: OrderRequest,
    draws: Draws,
) -> DatasetPlan:
    where = f"manifest {source} [datasets.{name}]"
    validate_dataset_name(name, source=where)
    if not isinstance(spec, dict) or not isinstance(spec.get("files"), list) or not spec["files"]:
        raise ConfigError(f"{where}: needs files = [\"...jsonl\", ...]")
    files = [source.parent / str(f) for f in spec["files"]]
    for f in files:
        if not f.is_file():
            raise ConfigError(f"{where}: file {f} does not exist")
    unknown = set(spec) - {"files", "budget_tokens", "policy", "basis", "max_new_tokens",
                           "turns", "order", "seed", "generations", "mix", "tool_call_parser",
                           *SAMPLING_KEYS}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {', '.join(sorted(unknown))}")
    try:
        terms = replace(
            budget,
            tokens=parse_budget_tokens(spec.get("budget_tokens", budget.tokens)),
            policy=spec.get("policy", budget.policy),
            basis=spec.get("basis", budget.basis),
        )
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    fixed = {**sampling, **{k: spec[k] for k in SAMPLING_KEYS if k in spec}}
    max_new_tokens = spec.get("max_new_tokens", max_new)
    # Refused here, before anything is stored: SGLang would refuse every sample.
    check_sampling({**fixed, "max_new_tokens": max_new_tokens}, name=lambda k: f"{where}: {k}")
    mode = spec.get("turns", turns)
    if mode is not None and mode not in TURN_MODES:
        raise ConfigError(f"{where}: turns must be one of {', '.join(TURN_MODES)} "
                          f"(got {mode!r})")
    mixtures = _mixtures_from_table(where, spec, fixed, draws.mixtures)
    generations = (check_generations(spec["generations"], f"{where}: generations")
                   if "generations" in spec else draws.generations)
    return DatasetPlan(name, tuple(files), terms, _fixed(fixed, mixtures), max_new_tokens, mode,
                       _order_from_table(where, spec, order), mixtures, generations)


def _mixtures_from_table(where: str, spec: dict[str, Any], fixed: dict[str, Any],
                         flags: Mixtures) -> Mixtures:
    """The table's mixtures over the flags' ones; a key both fixed and mixed in the table
    is refused, as it could mean either."""
    own = mixes_from_table(where, spec["mix"]) if "mix" in spec else Mixtures()
    both = sorted(set(own.choices) & {k for k in SAMPLING_KEYS if k in spec})
    if both:
        raise ConfigError(f"{where}: {', '.join(both)} is both a value and a mix; give one")
    mixtures = merged(flags, own)
    check_mixtures(mixtures, fixed, name=lambda k: f"{where}: mix.{k}")
    return mixtures


def _parser_from_table(source: Path, name: str, spec: Any, default: str | None) -> str | None:
    parser = spec.get("tool_call_parser", default) if isinstance(spec, dict) else default
    if parser is not None and (not isinstance(parser, str) or not parser.strip()):
        raise ConfigError(f"manifest {source} [datasets.{name}]: tool_call_parser must be "
                          f"SGLang's parser name, e.g. \"kimi_k2\" (got {parser!r})")
    return parser


def _order_from_table(where: str, spec: dict[str, Any], order: OrderRequest) -> OrderRequest:
    """The table's order and seed over the flags' ones."""
    kind = check_order(spec["order"], f"{where}: order") if "order" in spec else order.kind
    seed = check_seed(spec["seed"], f"{where}: seed") if "seed" in spec else order.seed
    return replace(order, kind=kind, seed=seed)
