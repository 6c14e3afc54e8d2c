"""A finished run's database written through the store API (bench/synth_results.py), and
``datagen export`` of it, for the tests of what an export writes beside its files."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.synth_results import Shape, add_dataset
from common.settings import Settings
from common.store import Store
from ops.argtypes import Parser
from ops.export import add_export_parser, run_export

# name: (prompts, options). R1 reasons (some outputs never close the block) and was closed
# by its budget; T2's prompts carry tools half the time; E4's prompts all failed.
RUN = {
    "R1": (150, {"reasoning": True, "close": True}),
    "T2": (100, {"tools": True}),
    "P3": (60, {}),
    "E4": (12, {"shape": Shape(failed=1.0)}),
}


def write_run(url: str) -> None:
    store = Store(url)
    try:
        for name, (n, options) in RUN.items():
            add_dataset(store, name, n, **options)  # type: ignore[arg-type]
    finally:
        store.engine.dispose()


def export(url: str, fmt: str, out: Path, *names: str) -> int:
    """``datagen export --format FMT --out OUT --allow-empty -q [--dataset NAME...]``."""
    parser = Parser(prog="datagen")
    add_export_parser(parser.add_subparsers(dest="command"))
    argv = ["export", "--format", fmt, "--out", str(out), "--allow-empty", "-q"]
    args: argparse.Namespace = parser.parse_args(argv + (["--dataset", *names] if names else []))
    return run_export(args, Settings(database_url=url))
