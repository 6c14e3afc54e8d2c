"""The command line's parser class and its number types: a bad flag is one line, exit 2.

argparse prints its usage before an error, and a type that raises anything but
``ArgumentTypeError``/``ValueError`` becomes a traceback; here every bad value is one line
on stderr naming the flag, the bound and the value given.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

from common.settings import AUTO


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line; its subparsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_quiet_flag(p: argparse.ArgumentParser) -> None:
    """``-q/--quiet``, the same on every command that shows progress."""
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress on stderr (default: a bar on a terminal, else a line "
                        "every DATAGEN_PROGRESS_EVERY_S seconds)")


def whole(least: int, most: int | None = None) -> Callable[[str], int]:
    """A whole number of at least ``least`` (and at most ``most``)."""

    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number") from None
        if value < least:
            bound = "positive" if least == 1 else f"at least {least}"
            raise argparse.ArgumentTypeError(f"must be {bound}, not {value}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most}, not {value}")
        return value

    parse.__name__ = "whole number"
    return parse


def number(least: float, *, inclusive: bool = True,
           most: float | None = None) -> Callable[[str], float]:
    """A finite number above ``least`` (or equal to it if ``inclusive``), at most ``most``."""

    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{raw!r} is not a finite number")
        if value < least or (value == least and not inclusive):
            bound = f"at least {least:g}" if inclusive else \
                "positive" if least == 0 else f"above {least:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}, not {raw}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most:g}, not {raw}")
        return value

    parse.__name__ = "number"
    return parse


def whole_or_auto(least: int) -> Callable[[str], int | str]:
    """``auto``, or a whole number of at least ``least``."""
    number = whole(least)

    def parse(raw: str) -> int | str:
        if raw.strip().lower() == AUTO:
            return AUTO
        try:
            int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number or auto") from None
        return number(raw)

    parse.__name__ = "whole number or auto"
    return parse
