"""Terminal output shared by every command."""

from __future__ import annotations

from rich.console import Console


def make_console(stderr: bool = False) -> Console:
    """A console that keeps tables readable when output goes to a file or a pipe."""
    probe = Console(stderr=stderr)
    return probe if probe.is_terminal else Console(stderr=stderr, width=160)
