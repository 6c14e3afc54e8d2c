"""The headline figure of each benchmark against its target, from ``bench-result`` JSON."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.memory import LONG_DBS, long_key

Row = tuple[str, str, str, str, str]


def _get(d: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _med(d: Any, *path: str) -> float | None:
    v = _get(d, *path)
    if isinstance(v, dict):
        v = v.get("median")
    return float(v) if isinstance(v, int | float) else None


def _row(bench: str, figure: str, value: float | None, fmt: str, target: str,
         ok: Callable[[float], bool] | None) -> Row:
    if value is None:
        return (bench, figure, "-", target, "not run")
    verdict = "-" if ok is None else ("met" if ok(value) else "MISSED")
    return (bench, figure, format(value, fmt), target, verdict)


def _saturation(r: Any) -> list[Row]:
    return [_row("saturation", "pipeline / bare tokens/s", _med(r, "ratio"), ".3f", ">= 0.97",
                 lambda v: v >= 0.97)]


def _overhead(r: Any, bench: str = "overhead", where: str = "") -> list[Row]:
    rows = [_row(bench, f"bare Celery task (requests), completions/s{where}",
                 _med(r, "bare", "rate"), ",.0f", "-", None)]
    for kind in ("sqlite", "postgresql"):
        rows.append(_row(bench, f"pipeline {kind}, completions/s{where}",
                         _med(r, kind, "rate"), ",.0f", ">= 400", lambda v: v >= 400))
        rows.append(_row(bench, f"pipeline {kind} / bare (requests){where}",
                         _med(r, kind, "ratio_to_bare"), ".3f", ">= 0.8", lambda v: v >= 0.8))
    return rows


def _overhead_per_core(r: Any) -> list[Row]:
    n = _get(r, "workers")
    return _overhead(r, "overhead-per-core", f", {n if n else '?'} worker processes")


def _routing(r: Any) -> list[Row]:
    return [_row("routing", "load-aware, output tok/s / capacity", _med(r, "ratio"), ".3f",
                 ">= 0.95", lambda v: v >= 0.95),
            _row("routing", "round robin, % of capacity",
                 _med(r, "round robin", "pct_of_capacity"), ".1f", "-", None)]


def _concurrency(r: Any) -> list[Row]:
    return [_row("concurrency", "auto / best fixed, output stored a second (worst shape)",
                 _med(r, "worst_ratio"), ".3f", ">= 0.98", lambda v: v >= 0.98),
            _row("concurrency", "auto in flight / running capacity (worst shape)",
                 _med(r, "worst_inflight_vs_capacity"), ".2f", "<= 1.25",
                 lambda v: v <= 1.25)]


def _producer(r: Any) -> list[Row]:
    return [_row("producer", "prompts/s (SQLite)", _med(r, "sqlite", "rate"), ",.0f",
                 ">= 5,000", lambda v: v >= 5000)]


def _guard(r: Any) -> list[Row]:
    rows = []
    for case, v in (_get(r, "cases") or {}).items():
        if _get(v, "reference"):  # the code before, for comparison: not a target
            rows.append(_row("guard", f"p99 ms, {case} (reference)", _med(v, "p99_ms"),
                             ".1f", "-", None))
        elif "crossing" in case or "after_close" in case:
            rows.append(_row("guard", f"p99 ms, {case}", _med(v, "p99_ms"), ".1f", "< 50",
                             lambda x: x < 50))
    return rows


def _overshoot(r: Any) -> list[Row]:
    budget = _get(r, "budget") or 0
    return [
        _row("overshoot", "drain, % of budget", _med(r, "drain", "overshoot_pct"), ".2f",
             "<= 1%", lambda v: v <= 1.0),
        _row("overshoot", "abort, tokens over budget", _med(r, "abort", "overshoot"), ",.0f",
             "<= one response", lambda v: _get(r, "abort", "target") == "met"),
        _row("overshoot", "abort, tokens wasted (partial outputs)",
             _med(r, "abort", "wasted_tokens"), ",.0f", "-", None),
        _row("overshoot", "exact, tokens over budget", _med(r, "exact", "overshoot"), ",.0f",
             "0", lambda v: v <= 0),
        _row("overshoot", "budget per dataset", float(budget) if budget else None, ",.0f",
             "-", None),
    ]


def _memory(r: Any) -> list[Row]:
    return [
        _row("memory", "worker RSS MB after warm run, c=64", _med(r, "rss_c64", "end"), ".0f",
             "<= 250", lambda v: v <= 250),
        _row("memory", "worker RSS MB after warm run, c=256", _med(r, "rss_c256", "end"),
             ".0f", "-", None),
        *(row for kind, label in LONG_DBS.items() for row in _long(r, kind, label)),
        _row("memory", "Redis bytes per queued task",
             _med(r, "redis_bytes_per_task", "info_delta"), ",.0f", "<= 1,200",
             lambda v: v <= 1200),
    ]


def _long(r: Any, kind: str, label: str) -> list[Row]:
    key = long_key(kind)
    samples = _med(r, key, "samples")
    count = f" ({samples:,.0f} samples)" if samples else ""
    return [
        _row("memory", f"worker RSS MB after the long run{count}, c=64, {label}",
             _med(r, key, "end"), ".0f", "<= 250", lambda v: v <= 250),
        _row("memory", f"worker RSS growth, MB per 10,000 samples (the long run's second "
             f"half), {label}", _med(r, key, "growth_mb_per_10k"), ".1f", "-", None),
    ]


def _scaling(r: Any) -> list[Row]:
    rows = []
    for key in sorted(k for k in (r or {}) if "_x" in k and not k.startswith("costs")):
        rows.append(_row("scaling", f"completions/s, {key.replace('_x', ' x')} workers",
                         _med(r, key, "rate"), ",.0f", "-", None))
    return rows


EXTRACTORS: dict[str, Callable[[Any], list[Row]]] = {
    "saturation": _saturation, "overhead": _overhead,
    "overhead-per-core": _overhead_per_core, "producer": _producer, "guard": _guard,
    "overshoot": _overshoot, "memory": _memory, "scaling": _scaling, "routing": _routing,
    "concurrency": _concurrency,
}


def headline(results: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for name, result in results.items():
        extract = EXTRACTORS.get(name)
        if extract is None:
            continue
        rows += extract(result) if result else [(name, "-", "-", "-", "failed")]
    return rows
