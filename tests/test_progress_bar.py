"""Progress on long commands: a bar when stderr is a terminal (a real pty), a line per
interval when it is a pipe, nothing with --quiet; the count always reaches SQL's total.

The interval is a setting (``DATAGEN_PROGRESS_EVERY_S``); 0 writes a line at every step,
so the tests see lines without waiting on the clock.
"""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from rich.console import Console

from bench.synth_results import add_dataset
from common.progress_bar import ProgressBar, human_seconds
from common.store import Store
from tests.conftest import EXAMPLES, REDIS_URL

LINE = re.compile(r"^(\w+): ([\d,]+)/([\d,]+) (\w+), ([\d,]+)/s, ETA (.+?)(?: \((.+)\))?$")


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Two datasets of prompts in every state, 200 prompts in all (SQLite)."""
    url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'datagen.db'}"
    store = Store(url)
    add_dataset(store, "P1", 120, close=True)
    add_dataset(store, "P2", 80)
    store.engine.dispose()
    yield url


def stored_results(url: str) -> int:
    from ops.export_rows import result_counts

    store = Store(url)
    try:
        return sum(result_counts(store).values())
    finally:
        store.engine.dispose()


def run_env(url: str, every_s: str = "0") -> dict[str, str]:
    # rich reads these before it looks at the file: the test decides what stderr is.
    forcing = ("FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR")
    env = {k: v for k, v in os.environ.items()
           if k not in forcing and not k.startswith("DATAGEN_")}
    return {**env, "TERM": "xterm", "COLUMNS": "120", "DATAGEN_DATABASE_URL": url,
            "DATAGEN_REDIS_URL": REDIS_URL, "DATAGEN_PROGRESS_EVERY_S": every_s}


def datagen(*argv: str) -> list[str]:
    return [sys.executable, "-m", "ops.cli", *argv]


def piped(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240,
                          check=False)
    assert done.returncode == 0, done.stderr
    return done


def on_a_terminal(argv: list[str], env: dict[str, str]) -> tuple[str, str]:
    """(stderr as the terminal received it, stdout) of a run whose stderr is a pty."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    received = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        received += chunk
    os.close(master)
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    assert proc.wait(timeout=240) == 0, received.decode(errors="replace")
    return received.decode(errors="replace"), out


def check_lines(stderr: str, command: str, unit: str, total: int) -> list[re.Match[str]]:
    """Every stderr line is a progress line of ``command``, counting up to ``total``;
    the last is the closing one."""
    lines = stderr.splitlines()
    assert lines, "no progress line on stderr"
    *counting, last = lines
    matches = [LINE.match(line) for line in counting]
    strays = [ln for ln, m in zip(counting, matches, strict=True) if m is None]
    assert not strays, f"not progress lines: {strays}"
    found = [m for m in matches if m is not None]
    assert {m.group(1) for m in found} == {command}
    assert {m.group(4) for m in found} == {unit}
    done = [int(m.group(2).replace(",", "")) for m in found]
    assert done == sorted(done) and done[-1] == total
    assert {int(m.group(3).replace(",", "")) for m in found} == {total}
    assert re.fullmatch(rf"{command}: {total:,} {unit} in \d+ (s|min \d\d s), [\d,]+/s", last)
    return found


# -- the module on its own -------------------------------------------------------------------


def test_a_line_gives_count_rate_and_time_left_and_names_the_item() -> None:
    now = [100.0]
    stream = io.StringIO()
    bar = ProgressBar("export", "rows", 200_000, every_s=5, clock=lambda: now[0],
                      console=Console(file=stream, force_terminal=False))
    assert bar.mode == "lines"
    with bar:
        bar.label("B2")
        now[0] = 104.0
        bar.advance(40_000)  # before the first interval: nothing yet
        assert stream.getvalue() == ""
        now[0] = 110.0
        bar.advance(80_000)  # 120,000 in 10 s: 12,000/s, 80,000 left
    assert stream.getvalue().splitlines() == [
        "export: 120,000/200,000 rows, 12,000/s, ETA 7 s (B2)",
        "export: 120,000 rows in 10 s, 12,000/s",
    ]


def test_a_short_command_writes_no_line_and_quiet_writes_nothing() -> None:
    stream = io.StringIO()
    with ProgressBar("export", "rows", 10, every_s=3600,
                     console=Console(file=stream, force_terminal=False)) as bar:
        bar.advance(10)
    with ProgressBar("export", "rows", 10, every_s=0, quiet=True,
                     console=Console(file=stream, force_terminal=True)) as bar:
        assert bar.mode == "off"
        bar.advance(10)
    assert stream.getvalue() == ""


def test_on_a_terminal_it_draws_a_bar_with_rate_and_time_left() -> None:
    stream = io.StringIO()
    with ProgressBar("validate", "rows", 5_000, every_s=0,
                     console=Console(file=stream, force_terminal=True, width=120)) as bar:
        assert bar.mode == "bar"
        bar.label("B1 file")
        bar.advance(5_000)
    shown = stream.getvalue()
    assert "validate B1 file" in shown and "5,000/5,000" in shown
    assert "rows/s" in shown and "ETA" in shown and "━" in shown


@pytest.mark.parametrize(("seconds", "text"), [(0.2, "0 s"), (8.4, "8 s"), (200, "3 min 20 s"),
                                               (7_500, "2 h 05 min")])
def test_time_left_reads_as_a_person_says_it(seconds: float, text: str) -> None:
    assert human_seconds(seconds) == text


# -- the commands ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["specforge", "parquet"])
def test_export_writes_progress_lines_to_a_pipe_up_to_sqls_count(
    database: str, tmp_path: Path, fmt: str
) -> None:
    done = piped(datagen("export", "--format", fmt, "--out", str(tmp_path / "x")),
                 run_env(database))
    found = check_lines(done.stderr, "export", "rows", stored_results(database))
    assert {m.group(7) for m in found} == {"P1", "P2"}
    assert "exported" in done.stdout and "export:" not in done.stdout


def test_export_quiet_writes_nothing_on_stderr(database: str, tmp_path: Path) -> None:
    done = piped(datagen("export", "--format", "specforge", "--out", str(tmp_path / "x"),
                         "--quiet"), run_env(database))
    assert done.stderr == ""


def test_export_on_a_terminal_draws_a_bar_not_lines(database: str, tmp_path: Path) -> None:
    total = stored_results(database)
    shown, out = on_a_terminal(
        datagen("export", "--format", "speculators", "--out", str(tmp_path / "x")),
        run_env(database))
    assert "━" in shown and f"{total:,}/{total:,}" in shown and "rows/s" in shown
    assert "export P2" in shown
    assert not re.search(r"^export: ", shown, re.M), "plain lines written to a terminal"
    assert "exported speculators" in out


def test_validate_counts_the_file_then_sql_in_lines_and_a_bar(
    database: str, tmp_path: Path
) -> None:
    out = tmp_path / "x"
    piped(datagen("export", "--format", "specforge", "--out", str(out), "-q"), run_env(database))
    results = stored_results(database)
    exported = sum(1 for f in out.glob("*.jsonl") for _ in f.open())
    done = piped(datagen("validate", str(out)), run_env(database))
    found = check_lines(done.stderr, "validate", "rows", exported + results)
    assert found[0].group(7) == "P1 file"
    assert {m.group(7) for m in found} == {"P1 file", "P1 SQL", "P2 file", "P2 SQL"}
    assert "validation passed" in done.stdout
    shown, _ = on_a_terminal(datagen("validate", str(out)), run_env(database))
    assert "━" in shown and f"{exported + results:,}/{exported + results:,}" in shown
    quiet = piped(datagen("validate", str(out), "--quiet"), run_env(database))
    assert quiet.stderr == ""


def test_enqueue_writes_progress_lines_up_to_the_files_lines(
    tmp_path: Path, redis_client: redis.Redis
) -> None:
    url = f"sqlite:///{tmp_path / 'datagen.db'}"
    files = sorted(EXAMPLES.glob("*.jsonl"))
    lines = sum(1 for f in files for _ in f.open())
    done = piped(datagen("enqueue", *map(str, files), "--budget-tokens", "1M"), run_env(url))
    problems = [ln for ln in done.stderr.splitlines() if not ln.startswith("enqueue: ")]
    progress = "\n".join(ln for ln in done.stderr.splitlines() if ln.startswith("enqueue: "))
    check_lines(progress, "enqueue", "lines", lines)
    assert all(": " in p for p in problems)  # the bad lines of the examples, named
    redis_client.flushdb()
    again = piped(datagen("enqueue", *map(str, files), "--budget-tokens", "1M", "-q"),
                  run_env(f"sqlite:///{tmp_path / 'other.db'}"))
    assert not any(ln.startswith("enqueue: ") for ln in again.stderr.splitlines())
