"""Per-record checks of ``datagen validate``: a record's own shape, and how it differs
from the record SQL says it should be."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ops.export_specforge import SpecForgeBuilder
from ops.export_speculators import SpeculatorsBuilder
from ops.specforge_check import row_error

MAX_SHOWN = 20
_SHORT = 60


@dataclass
class Findings:
    """Mismatches counted by kind; the first ``MAX_SHOWN`` are kept to print."""

    counts: Counter[str] = field(default_factory=Counter)
    shown: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def mismatch(self, kind: str, message: str) -> None:
        self.counts[kind] += 1
        if len(self.shown) < MAX_SHOWN:
            self.shown.append(f"[{kind}] {message}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def record_id(fmt: str, builder: Any, record: dict[str, Any]) -> str | None:
    """The stored sample a record names (a SpecForge turn row: by its source and turn;
    an id the export prefixed with its dataset: without it)."""
    if isinstance(builder, SpecForgeBuilder | SpeculatorsBuilder):
        return builder.sample_id_of(record)
    sid = record.get("sample_id" if fmt == "parquet" else "id")
    return sid if isinstance(sid, str) else None


def mask_error(record: dict[str, Any], conversation: bool = False) -> str | None:
    """A speculators loss mask must be 0s over the prompt then 1s over the output; a
    conversation row's prompt may hold runs of 1s too (its own earlier answers), and
    starts with 0s (the template's opening, the first user message)."""
    ids, mask = record.get("input_ids"), record.get("loss_mask")
    if not isinstance(ids, list) or not isinstance(mask, list):
        return "input_ids and loss_mask must be lists"
    if len(mask) != len(ids):
        return f"loss_mask has {len(mask)} entries for {len(ids)} input_ids"
    if any(bit not in (0, 1) or isinstance(bit, bool) for bit in mask):
        return "loss_mask holds values other than 0 and 1"
    if conversation:
        return None if mask and mask[0] == 0 and mask[-1] == 1 else \
            "loss_mask does not start with 0 (the prompt) and end with 1 (the output)"
    ones = mask.count(1)
    if ones == 0 or mask[len(mask) - ones :] != [1] * ones:
        return "loss_mask is not 0s over the prompt followed by 1s over the output"
    return None


def shape_error(fmt: str, builder: Any, record: dict[str, Any]) -> tuple[str, str] | None:
    """(kind, message) of the first rule the record breaks on its own, before SQL."""
    if fmt == "specforge" and isinstance(builder, SpecForgeBuilder):
        error = row_error(record, **builder.expectations(record))
        return None if error is None else ("specforge-checker", error)
    if fmt == "speculators":
        error = mask_error(record, getattr(builder, "rows", None) == "conversation")
        return None if error is None else ("loss-mask", error)
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHORT else text[: _SHORT - 3] + "..."


def _value_diff(actual: Any, expected: Any) -> str:
    if isinstance(actual, list) and isinstance(expected, list):
        for i, (a, e) in enumerate(zip(actual, expected, strict=False)):
            if a != e:
                return f"at [{i}]: file {_short(a)}, SQL {_short(e)}"
        return f"length {len(actual)} in the file, {len(expected)} from SQL"
    return f"file {_short(actual)}, SQL {_short(expected)}"


def describe_diff(expected: dict[str, Any], actual: dict[str, Any]) -> str | None:
    """Each field where ``actual`` differs from ``expected``, briefly; None if equal."""
    parts = []
    for key in [*expected, *(k for k in actual if k not in expected)]:
        if key not in actual:
            parts.append(f"{key} missing")
        elif key not in expected:
            parts.append(f"unexpected field {key}")
        elif actual[key] != expected[key]:
            parts.append(f"{key} differs {_value_diff(actual[key], expected[key])}")
    return "; ".join(parts) or None
