"""py-spy sampling of a running process, and a summary of where its samples fall.

``record`` attaches ``py-spy record --format raw`` (collapsed stacks) to a pid; ``stop``
ends it with SIGINT so the file is written. ``summarize`` turns the stacks into the
functions with the largest self and inclusive shares, and shares per library.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import Processes

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")
# Library buckets, matched against a frame's file path, most specific first.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("sqlalchemy", "/sqlalchemy/"), ("sqlite3", "/sqlite3/"), ("psycopg", "/psycopg"),
    ("redis-py", "/redis/"), ("kombu", "/kombu/"), ("celery", "/celery/"),
    ("billiard", "/billiard/"), ("requests", "/requests/"), ("urllib3", "/urllib3/"),
    ("http.client", "/http/client.py"), ("email (HTTP header parsing)", "/email/"),
    ("urllib.parse/request", "/urllib/"), ("os.environ (requests proxies)", "<frozen os>"),
    ("json", "/json/"), ("logging", "/logging/"), ("socket", "/socket.py"),
    ("selectors", "/selectors.py"), ("uuid", "/uuid.py"), ("threading", "/threading.py"),
    ("concurrent.futures", "/concurrent/"), ("queue", "/queue.py"),
    ("datagen common/", "/common/"), ("datagen workers/", "/workers/"),
    ("datagen producer/", "/producer/"), ("simulator", "/sim/"), ("aiohttp", "/aiohttp/"),
    ("asyncio", "/asyncio/"), ("jinja2", "/jinja2/"), ("transformers", "/transformers/"),
    ("tokenizers", "/tokenizers/"), ("hashlib", "/hashlib.py"),
)


def py_spy() -> str:
    exe = Path(sys.executable).parent / "py-spy"
    found = str(exe) if exe.exists() else shutil.which("py-spy")
    if not found:
        raise RuntimeError("py-spy is not installed: .venv/bin/pip install py-spy")
    return found


def record(procs: Processes, pid: int, out: Path, *, rate: int = 100,
           gil: bool = False, subprocesses: bool = False) -> subprocess.Popen[bytes]:
    """Start sampling ``pid``; ``gil``: only the thread holding the GIL; ``subprocesses``:
    its child processes too, as they start.

    Blocking mode (py-spy pauses the target for each sample): slower, but non-blocking
    reads of a busy process return torn stacks.
    """
    argv = [py_spy(), "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
            "--output", str(out)]
    if gil:
        argv.append("--gil")
    if subprocesses:
        argv.append("--subprocesses")
    return procs.start(argv, log=out.with_suffix(".log"))


def stop(procs: Processes, proc: subprocess.Popen[bytes]) -> None:
    """SIGINT makes py-spy write its file; the stack stops it harder if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
    procs.stop(proc, grace_s=5)


@dataclass
class Profile:
    samples: int = 0
    self_: Counter[str] = field(default_factory=Counter)
    inclusive: Counter[str] = field(default_factory=Counter)
    categories: Counter[str] = field(default_factory=Counter)
    stacks: list[tuple[list[str], int]] = field(default_factory=list)

    def top(self, which: str, n: int = 12, contains: str = "") -> list[tuple[str, float]]:
        counter = self.self_ if which == "self" else self.inclusive
        rows = [(k, v) for k, v in counter.most_common() if contains in k]
        return [(k, 100.0 * v / max(1, self.samples)) for k, v in rows[:n]]

    def category_shares(self) -> list[tuple[str, float]]:
        total = max(1, self.samples)
        return [(k, 100.0 * v / total) for k, v in self.categories.most_common()]

    def attribute(self, rules: Sequence[tuple[str, str]],
                  fallback: Sequence[tuple[str, str]] = ()) -> list[tuple[str, float]]:
        """Share of samples per label: the innermost frame matching a rule wins; the
        fallback rules apply only to stacks no rule matches."""
        counts: Counter[str] = Counter()
        for frames, n in self.stacks:
            label = _first_match(frames, rules)
            if label == "other" and fallback:
                label = _first_match(frames, fallback)
            counts[label] += n
        total = max(1, self.samples)
        return [(k, 100.0 * v / total) for k, v in counts.most_common()]


def _first_match(frames: list[str], rules: Sequence[tuple[str, str]]) -> str:
    for name in reversed(frames):
        for label, needle in rules:
            if needle in name:
                return label
    return "other"


def _frame(raw: str) -> tuple[str, str]:
    m = _FRAME.match(raw.strip())
    if not m:
        return raw.strip(), ""
    path = m.group("file")
    return f"{m.group('func')} ({_short(path)})", path


def _short(path: str) -> str:
    for marker in ("site-packages/", "/lib/python3.11/", "/work/main/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def category(path: str) -> str:
    path = "/" + path
    for name, needle in CATEGORIES:
        if needle in path:
            return name
    return "other python"


def summarize(raw_file: Path) -> Profile:
    """Self share = samples whose innermost frame is the function; inclusive = anywhere."""
    prof = Profile()
    if not raw_file.exists():
        return prof
    for line in raw_file.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_frame(f) for f in stack.split(";") if f]
        frames = [f for f in frames if not f[0].startswith(("process ", "thread "))]
        if not frames:
            continue
        prof.samples += n
        prof.self_[frames[-1][0]] += n
        for name in {f[0] for f in frames}:
            prof.inclusive[name] += n
        prof.categories[category(frames[-1][1])] += n
        prof.stacks.append(([f[0] for f in frames], n))
    return prof
