"""What every export format's builder shares: why a sample is left out, and the parts
of a row common to the formats (what a request was sent, a conversation's earlier turns).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from common.errors import ConfigError
from common.kept import sample_closer
from common.store import DatasetRow
from ops.export_rows import ExportRow

# Why a sample was left out, by the key the manifest and the summary count it under.
REASONS = {
    "missing_prompt": "its prompt row is missing from SQL",
    "invalid_id": "its id is blank, which SpecForge rejects",
    "cut_while_reasoning": "cut off while still reasoning: no closing marker, so no answer",
    "cut_at_budget": "cut to fill the budget (the exact policy): the answer ends mid-way",
    "empty_answer": "the answer after the reasoning (or the whole output) is empty",
    "think_marker": "a reasoning marker is left in the answer or the reasoning",
    "prompt_breaks_checker": "its prompt turns break SpecForge's checker",
    "empty_output": "no output tokens: nothing to train on",
    "earlier_turn": "an earlier turn of a conversation: the row of its last stored turn "
                    "carries it",
    "tool_calls_differ": "its tool calls were not the line's: they ended the conversation "
                         "unparsed, so no row can carry them as calls",
    "answers_unplaced": "its prompt's own earlier answers cannot be placed exactly in its "
                        "ids (the template or tokenizer differs from the run's)",
}


@dataclass(frozen=True)
class LeftOut:
    reason: str  # a key of REASONS
    detail: str


class Builder(Protocol):
    answers: bool  # reads each turn's own answer as stored (ExportRow.answer)

    def build(self, row: ExportRow) -> dict[str, Any] | LeftOut: ...


def earlier_turn(row: ExportRow, latest: Mapping[str, int]) -> LeftOut | None:
    """A turn before its conversation's last stored one, which that one's row carries."""
    if row.conversation is None or row.turn is None \
            or row.turn >= latest.get(row.conversation, row.turn):
        return None
    return LeftOut("earlier_turn", f"turn {row.turn} of {row.conversation}, carried by "
                   f"turn {latest[row.conversation]}")


def reasoning_close(ds: DatasetRow, drawn: Mapping[str, Any] | None = None) -> str | None:
    """The marker closing the reasoning block of the dataset's prompts rendered with the
    template arguments ``drawn`` (its own draw's, common/kept.py), None when they opened
    none."""
    try:
        return sample_closer(ds, drawn)
    except ConfigError as exc:
        raise ConfigError(f"dataset {ds.name}: {exc}") from None


def dataset_sampling(ds: DatasetRow) -> dict[str, Any]:
    return {k: v for k, v in ds.sampling.items() if k != "max_new_tokens"}


def sent(row: ExportRow, sampling: dict[str, Any], key: str) -> dict[str, Any]:
    """``{key: the sampling_params the request sent}``, and the chat template arguments
    drawn for its prompt, if any. A result stored before requests' sampling was recorded
    was sent its dataset's (``sampling``, mixtures came later) with its prompt's cap."""
    used = row.sampling
    if used is None:
        used = {**sampling, "max_new_tokens": row.max_new_tokens}
    out: dict[str, Any] = {key: used}
    if row.template_kwargs:
        out["chat_template_kwargs"] = row.template_kwargs
    return out


def string_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None
