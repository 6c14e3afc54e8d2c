"""Summaries (median and spread of repeated runs), tables, and the machine-readable line."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bench.harness import machine

RESULT_PREFIX = "bench-result "


@dataclass(frozen=True)
class Summary:
    """Median and range of repeated measurements."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        if not values:
            return cls(float("nan"), float("nan"), float("nan"), 0)
        return cls(statistics.median(values), min(values), max(values), len(values))

    def fmt(self, digits: int = 1) -> str:
        if self.n == 0:
            return "-"
        if self.n == 1:
            return f"{self.median:,.{digits}f}"
        return f"{self.median:,.{digits}f} [{self.low:,.{digits}f}-{self.high:,.{digits}f}]"

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "min": self.low, "max": self.high, "n": self.n}


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    t = Table(title=escape(title), title_justify="left")
    for i, col in enumerate(header):
        t.add_column(escape(col), justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*(escape(str(v)) for v in row))
    Console(width=160).print(t)


def emit(bench: str, args: argparse.Namespace, figures: dict[str, Any]) -> None:
    """The one line tests and ``python -m bench`` read: ``bench-result {json}``, with
    the date and the machine it ran on."""
    payload = {"bench": bench, "quick": bool(getattr(args, "quick", False)),
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "machine": machine(), **figures}
    print(RESULT_PREFIX + json.dumps(payload, default=_plain), flush=True)


def _plain(value: Any) -> Any:
    if isinstance(value, Summary):
        return value.as_dict()
    raise TypeError(f"not JSON: {type(value).__name__}")


def verdict(value: float, target: float, higher_is_better: bool = True) -> str:
    ok = value >= target if higher_is_better else value <= target
    return "met" if ok else "MISSED"
