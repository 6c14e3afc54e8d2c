"""The typed rows that pass between the producer, the workers and the store.

Each is one row of a table in ``common/schema.py``, as the code that writes it knows it:
the store turns them into its statements, so no caller spells a column name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class NewPrompt:
    """A prompt the producer stores: its ``prompts`` row and its ``prompt_inputs`` row."""

    dataset: str
    sample_id: str
    state: str  # "queued", or "skipped" when it leaves no room to generate
    prompt_tokens: int
    max_new_tokens: int
    source: str
    messages: list[dict[str, Any]]
    input_ids: list[int]
    error: str | None = None
    tools: list[dict[str, Any]] | None = None  # the line's function schemas, as read
    conversation: str | None = None  # a turn of this conversation (common/conversation.py)
    turn: int | None = None
    rank: int | None = None  # its place in the dataset's publishing order (common/order.py)
    # The chat template arguments drawn for it (common/draws.py), rendered into its ids.
    template_kwargs: dict[str, Any] | None = None


def allowance(prompt_tokens: int, max_new_tokens: int, max_seq_len: int
              ) -> tuple[str, int, str | None]:
    """A prompt's (state, max_new_tokens, error) under ``max_seq_len``: skipped when it
    leaves no room to generate."""
    room = max_seq_len - prompt_tokens
    if room <= 0:
        return "skipped", 0, (f"prompt is {prompt_tokens} tokens; no room to generate "
                              f"within max_seq_len {max_seq_len}")
    return "queued", min(max_new_tokens, room), None


@dataclass(frozen=True)
class NewConversation:
    """A conversation regenerated turn by turn: its ``conversations`` row."""

    dataset: str
    conversation: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    turns: int
    source: str


@dataclass(frozen=True)
class ResultRow:
    """One sample's result, as its charge allows it to be kept."""

    dataset: str
    sample_id: str
    rid: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    output_ids: list[int]
    output_text: str
    server: str
    model: str
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    finish_detail: dict[str, Any] | None = field(default=None)
    e2e_latency_s: float | None = None
    sampling: dict[str, Any] | None = None  # the sampling_params its request was sent with
    kept: bool = True  # an answer the exports keep (common.kept)

    @property
    def key(self) -> tuple[str, str]:
        return self.dataset, self.sample_id
