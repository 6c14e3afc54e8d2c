"""What a dataset's budget means: its size, its basis and its overshoot policy.

How the counters are stored and changed atomically lives in common.ledger; this module
only holds the terms and the arithmetic users see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from common.errors import ConfigError

Basis = Literal["output", "total", "kept"]
Policy = Literal["drain", "abort", "exact"]
BASES: tuple[Basis, ...] = ("output", "total", "kept")
POLICIES: tuple[Policy, ...] = ("drain", "abort", "exact")
DEFAULT_BUDGET_TOKENS = 10_000_000
# Token counts, or SQL expressions of them: the same arithmetic serves both.
Tokens = TypeVar("Tokens", int, Any)


def counts_prompt(basis: str) -> bool:
    """Whether a sample's prompt tokens count against the budget: only on "total"."""
    return basis == "total"


def charges_kept_only(basis: str) -> bool:
    """Whether only kept samples (common.kept) are charged: only on "kept"."""
    return basis == "kept"


def cost_on(basis: str, prompt_tokens: Tokens, completion_tokens: Tokens,
            kept_completion_tokens: Tokens) -> Tokens:
    """A sample's cost on a budget basis: its completion, plus its prompt on "total"; on
    "kept" its completion if it is kept, else nothing (``kept_completion_tokens``: the
    completion of a kept sample, 0 for one not kept; summed, the kept ones' completions).

    The one definition of the basis: the store's SQL sums, status and plan use it, and the
    ledger's scripts get it as ``Budget.prompt_weight`` and ``Budget.kept_only`` (checked
    against this by tests/test_ledger.py)."""
    if charges_kept_only(basis):
        return kept_completion_tokens
    if counts_prompt(basis):
        return completion_tokens + prompt_tokens
    return completion_tokens


@dataclass(frozen=True)
class Budget:
    """The terms of one dataset's budget.

    basis "output" counts completion tokens; "total" counts prompt + completion; "kept"
    counts the completion tokens of kept samples only (common.kept), the others are stored
    uncharged.
    policy, for requests still in flight when the dataset closes:
      drain  they finish and are kept and counted (overshoot bounded by admission),
      abort  they are aborted on the server and not kept,
      exact  the crossing sample is cut to fill the budget, the rest are aborted.
    """

    tokens: int = DEFAULT_BUDGET_TOKENS
    basis: Basis = "output"
    policy: Policy = "drain"

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens <= 0:
            raise ConfigError(
                f"budget must be a positive whole number of tokens, got {self.tokens!r}"
            )
        if self.basis not in BASES:
            raise ConfigError(f"unknown budget basis {self.basis!r}; use one of {', '.join(BASES)}")
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}; use one of {', '.join(POLICIES)}")

    @property
    def streams_requests(self) -> bool:
        """Whether this budget's requests are streamed: under drain a close aborts the
        requests still queued on a server, so each one's start must be known
        (common/sglang_stream.py)."""
        return self.policy == "drain"

    @property
    def prompt_weight(self) -> int:
        """1 when prompt tokens count, else 0: the ledger's Lua charges
        ``prompt_weight * prompt + completion``, so it needs no notion of a basis."""
        return int(counts_prompt(self.basis))

    @property
    def kept_only(self) -> int:
        """1 when only kept samples are charged, else 0: the ledger's Lua charges a sample
        it is told is not kept nothing when this is 1."""
        return int(charges_kept_only(self.basis))

    def cost(self, prompt_tokens: int, completion_tokens: int, kept: bool) -> int:
        """One sample's cost; ``kept`` as common.kept decides it."""
        return cost_on(self.basis, prompt_tokens, completion_tokens,
                       completion_tokens if kept else 0)

    def overshoot(self, used_tokens: int) -> int:
        return max(0, used_tokens - self.tokens)


def parse_budget_tokens(raw: str | int) -> int:
    """Accept 10000000, "10_000_000", "10M" or "500k"; anything else is a ConfigError."""
    text = str(raw).strip().lower().replace("_", "").replace(",", "")
    scale = 1
    if text.endswith(("k", "m", "g")):
        scale = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}[text[-1]]
        text = text[:-1]
    try:
        value = float(text) * scale if "." in text else int(text) * scale
    except ValueError:
        raise ConfigError(
            f"budget {raw!r} is not a number of tokens (e.g. 10000000 or 10M)"
        ) from None
    if value <= 0 or value != int(value):
        raise ConfigError(f"budget {raw!r} must be a positive whole number of tokens")
    return int(value)
