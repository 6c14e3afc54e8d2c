"""Progress of a long command on stderr: a bar on a terminal, a line every few seconds
elsewhere, nothing when quiet.

    with ProgressBar("export", "rows", total, every_s=settings.progress_every_s) as bar:
        bar.label("B1")
        for row in rows:
            ...
            bar.advance()

On a terminal rich draws the bar: what is being done, the count, the rate and the time
left. When stderr is a pipe or a file (compose logs, CI) one line every ``every_s``
seconds says the same (``export: 120,000/200,000 rows, 9,800/s, ETA 8 s (B2)``), and a
last line the total and the time taken, written only when a line was written before it
so that a short command stays silent. ``advance`` is called once per row by commands that
move tens of thousands of rows a second, so it only adds and reads the clock; the bar and
the lines take the count at their own pace.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from common.console import make_console

# How often rich redraws the bar (each redraw renders it in a thread of its own, with
# the GIL), and how often the count is handed to it.
BAR_REDRAWS_PER_S = 4
BAR_UPDATE_S = 1 / BAR_REDRAWS_PER_S


def human_seconds(seconds: float) -> str:
    """``8 s``, ``3 min 20 s``, ``2 h 05 min``: a time left, as a person reads it."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class CountColumn(ProgressColumn):
    """``120,000/200,000``: rich's M/N column without thousands separators is hard to read
    at these counts."""

    def render(self, task: Task) -> Text:
        total = "?" if task.total is None else f"{int(task.total):,}"
        return Text(f"{int(task.completed):,}/{total}", style="progress.download")


class RateColumn(ProgressColumn):
    """Items per second over rich's recent samples, in the command's own unit."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        speed = task.speed
        shown = "?" if speed is None else f"{speed:,.0f}"
        return Text(f"{shown} {self.unit}/s", style="progress.data.speed")


class ProgressBar:
    """The progress of one command over ``total`` items of ``unit`` (None: not known)."""

    def __init__(
        self,
        command: str,
        unit: str,
        total: int | None,
        *,
        quiet: bool = False,
        every_s: float = 5.0,
        console: Console | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.command, self.unit, self.total = command, unit, total
        self.every_s, self.clock = every_s, clock
        self.done = 0
        self.what = ""
        self.console = console or make_console(stderr=True)
        self.mode = "off" if quiet else "bar" if self.console.is_terminal else "lines"
        self.started = clock()
        self.lines_written = 0
        self._next = math.inf if self.mode == "off" else self.started + (
            BAR_UPDATE_S if self.mode == "bar" else every_s)
        self._bar: Progress | None = None
        if self.mode == "bar":
            self._bar = Progress(
                TextColumn("{task.description}"), BarColumn(), CountColumn(),
                RateColumn(unit), TextColumn("ETA"), TimeRemainingColumn(),
                console=self.console, refresh_per_second=BAR_REDRAWS_PER_S,
            )
            self._task = self._bar.add_task(command, total=total)

    def label(self, what: str) -> None:
        """Name what is being worked on now (a dataset), shown beside the count."""
        self.what = what
        if self._bar is not None:
            self._bar.update(self._task, description=f"{self.command} {what}")

    def grow(self, n: int) -> None:
        """Add ``n`` to the total: work found while the command runs."""
        self.total = (self.total or 0) + n
        if self._bar is not None:
            self._bar.update(self._task, total=self.total)

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = self.clock()
        if now >= self._next:
            self._show(now)

    def complete(self) -> None:
        """Count the whole total as done: the command is through all of it, though some
        steps were never counted (the bad and blank lines of a prompt file)."""
        if self.total is not None and self.done < self.total:
            self.advance(self.total - self.done)

    def _show(self, now: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
            self._next = now + BAR_UPDATE_S
        else:
            self._write(self.line(now))
            self._next = now + self.every_s

    def line(self, now: float) -> str:
        """``export: 120,000/200,000 rows, 9,800/s, ETA 8 s (B2)``: the count so far."""
        elapsed = now - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        count = f"{self.done:,}" if self.total is None else f"{self.done:,}/{self.total:,}"
        text = f"{self.command}: {count} {self.unit}, {rate:,.0f}/s"
        if self.total is not None:
            left = max(0, self.total - self.done)
            text += f", ETA {human_seconds(left / rate) if rate > 0 else '?'}"
        return text + (f" ({self.what})" if self.what else "")

    def final_line(self, now: float) -> str:
        elapsed = now - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        return (f"{self.command}: {self.done:,} {self.unit} in {human_seconds(elapsed)}, "
                f"{rate:,.0f}/s")

    def _write(self, text: str) -> None:
        print(text, file=self.console.file, flush=True)
        self.lines_written += 1

    def __enter__(self) -> ProgressBar:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
            self._bar.stop()
        elif self.mode == "lines" and self.lines_written and kind is None:
            self._write(self.final_line(self.clock()))
