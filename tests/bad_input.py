"""Bad values for every flag and setting, what ``datagen`` must answer, and the record of it.

Each case runs the real ``datagen`` command in a subprocess; ``tests/test_bad_input.py``
checks its exit code, that stderr is one line holding the case's fragment and no password,
and that the "Bad input" section of docs/RELIABILITY.md shows exactly what it answered.
``python -m tests.bad_input`` runs the cases and rewrites that section;
``python -m bench.reliability`` keeps it when it rewrites the rest of the file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from common.settings import LEAST, env_name

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "RELIABILITY.md"
HEADING = "## Bad input"
PASSWORD = "hunter2"  # in every URL that has one: no message may show it


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]
    fragment: str
    env: Mapping[str, str] = field(default_factory=dict)
    code: int = 2

    @property
    def label(self) -> str:
        env = " ".join(f"{k}={v!r}" if " " in v or not v else f"{k}={v}"
                       for k, v in self.env.items())
        return f"{env} datagen {' '.join(self.argv)}".strip()


@dataclass(frozen=True)
class Answer:
    code: int
    stderr: str


def _settings_cases() -> list[Case]:
    def status(name: str, value: str, fragment: str) -> Case:
        return Case(("status",), fragment, {name: value})

    cases = [
        status("DATAGEN_REDIS_URL", "notaurl", "is not a Redis URL"),
        status("DATAGEN_REDIS_URL", "http://127.0.0.1:6379/0", "is not a Redis URL"),
        status("DATAGEN_REDIS_URL", f"redis://:{PASSWORD}@127.0.0.1:port/0",
               "Port could not be cast"),
        status("DATAGEN_REDIS_URL", "redis://127.0.0.1:6379/zero", "must be a number"),
        status("DATAGEN_DATABASE_URL", f"mysql://datagen:{PASSWORD}@db/datagen",
               "unsupported database 'mysql'; datagen runs on sqlite and postgresql"),
        status("DATAGEN_DATABASE_URL", "notaurl", "is not a database URL"),
        status("DATAGEN_DATABASE_URL", "postgresql+psycopg2://db/datagen",
               "unsupported driver 'psycopg2'"),
        status("DATAGEN_DATABASE_URL", f"postgresql://u:{PASSWORD}@db:port/datagen",
               "is not a database URL"),
        status("DATAGEN_SGLANG_URL", "gpu-node:30000", "must start with http://"),
        status("DATAGEN_SGLANG_URL", "http://:30000", "names no host"),
        status("DATAGEN_SGLANG_URL", "http://gpu-node:port", "is not a URL"),
        status("DATAGEN_SGLANG_URL", " , ", "is empty"),
        status("DATAGEN_CONCURRENCY", "2.5", "is not a whole number"),
        status("DATAGEN_REQUEST_TIMEOUT_S", "soon", "is not a number"),
        status("DATAGEN_RETRY_MAX_S", "inf", "is not a finite number"),
        status("DATAGEN_METRICS_PORT", "70000", "is not a port: give 1-65535, or 0 for none"),
        status("DATAGEN_DEFAULT_SEED", str(2**63), "must be a whole number from 0 to"),
    ]
    for name, (least, allowed) in LEAST.items():
        value = f"{least - 1:g}" if allowed else f"{least:g}"
        bound = f"at least {least:g}" if allowed else f"above {least:g}"
        cases.append(status(env_name(name), value, f"must be {bound}"))
    return cases


FLAG_CASES = [
    Case(("worker", "-c", "-3"), "--concurrency/-c: must be positive, not -3"),
    Case(("worker", "-c", "0"), "must be positive, not 0"),
    Case(("worker", "-c", "many"), "'many' is not a whole number"),
    Case(("worker", "--loglevel", "LOUD"), "invalid choice: 'LOUD'"),
    Case(("enqueue", "x.jsonl", "--max-new-tokens", "0"), "must be positive, not 0"),
    Case(("enqueue", "x.jsonl", "--max-seq-len", "1"), "must be at least 2, not 1"),
    Case(("enqueue", "x.jsonl", "--budget-tokens", "-5"), "positive"),
    Case(("enqueue", "x.jsonl", "--budget-tokens", "lots"), "not a number"),
    Case(("enqueue", "x.jsonl", "--budget-basis", "input"), "invalid choice: 'input'"),
    Case(("enqueue", "x.jsonl", "--policy", "stop"), "invalid choice: 'stop'"),
    Case(("enqueue", "x.jsonl", "--order", "random"), "invalid choice: 'random'"),
    Case(("enqueue", "x.jsonl", "--seed", "-1"), "must be at least 0, not -1"),
    Case(("enqueue", "x.jsonl", "--chat-template-kwargs", "{bad"), "is not JSON"),
    Case(("enqueue", "x.jsonl", "--chat-template-kwargs", "[1]"), "must be a JSON object"),
    Case(("enqueue", "x.jsonl", "--top-p", "7"), "--top-p must be in (0, 1], got 7"),
    Case(("enqueue", "x.jsonl", "--temperature", "-1"), "--temperature must be a non-negative"),
    Case(("enqueue", "x.jsonl", "--top-k", "0"), "--top-k must be -1 (disable) or at least 1"),
    Case(("enqueue", "x.jsonl", "--min-p", "3"), "--min-p must be in [0, 1]"),
    Case(("enqueue", "nowhere.jsonl"), "no such file or folder"),
    Case(("enqueue",), "give prompt files or folders, or --manifest FILE"),
    Case(("enqueue", "x.jsonl", "--tokenizer", "/no/such/dir"), "nor a model id"),
    Case(("enqueue", "x.jsonl", "--tokenizer", "some-org/some-model"),
         "HF_HUB_OFFLINE is set", {"HF_HUB_OFFLINE": "1"}),
    Case(("plan", "--mean-tokens", "0"), "must be positive, not 0"),
    Case(("plan", "--tok-per-s", "-1"), "must be positive, not -1"),
    Case(("demo", "--workers", "0"), "must be positive, not 0"),
    Case(("demo", "--concurrency", "-1"), "must be positive, not -1"),
    Case(("export", "--format", "csv", "--out", "out"), "invalid choice: 'csv'"),
    Case(("export", "--format", "parquet", "--rows", "turn", "--out", "out"),
         "--rows turn does not apply to parquet"),
    Case(("export", "--format", "parquet", "--rows", "conversation", "--out", "out"),
         "--rows conversation does not apply to parquet: its rows are stored results"),
    Case(("reopen", "nosuch", "--budget-tokens", "5M"), "unknown dataset 'nosuch'"),
    Case(("retry", "nosuch", "--top-p", "0"), "--top-p must be in (0, 1], got 0"),
    Case(("healthcheck", "sglang", "--interval", "0"), "must be positive, not 0"),
    Case(("healthcheck", "http", "http://127.0.0.1:1/", "--status", "99"),
         "must be at least 100, not 99"),
    Case(("sim", "--port", "-1"), "--port must be from 0 to 65535, not -1"),
    Case(("sim", "--error-rate", "2"), "--error-rate must be from 0 to 1, not 2"),
    Case(("sim", "--nul-every", "-1"), "--nul-every must be at least 0, not -1"),
    Case(("sim", "--kv-tokens", "0"), "--kv-tokens must be at least 1, not 0"),
    Case(("nosuchcommand",), "invalid choice: 'nosuchcommand'"),
]

CASES: list[Case] = [*_settings_cases(), *FLAG_CASES]


def datagen_command() -> list[str]:
    """The installed ``datagen`` script beside this Python, else the module it runs."""
    script = Path(sys.executable).parent / "datagen"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "ops.cli"]


def base_env(redis_url: str, database_url: str) -> dict[str, str]:
    """The environment every case starts from: services of its own, nothing else set."""
    # The hub's offline switches would change which tokenizer message a case gets.
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATAGEN_")
           and k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(DATAGEN_REDIS_URL=redis_url, DATAGEN_DATABASE_URL=database_url,
               PYTHONPATH=str(ROOT))
    return env


def run_case(case: Case, env: Mapping[str, str], cwd: Path) -> Answer:
    done = subprocess.run([*datagen_command(), *case.argv], env={**env, **case.env},
                          cwd=cwd, capture_output=True, text=True, timeout=120)
    return Answer(done.returncode, done.stderr)


def run_all(cases: Sequence[Case], env: Mapping[str, str], cwd: Path) -> list[Answer]:
    """Every case's answer, a few at a time; ``cwd`` holds a one-prompt ``x.jsonl``."""
    (cwd / "x.jsonl").write_text('{"id": "1", "messages": [{"role": "user", "content": "hi"}]}\n')
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda c: run_case(c, env, cwd), cases))


def _cell(text: str) -> str:
    text = text.strip().replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def render(cases: Sequence[Case], answers: Sequence[Answer]) -> str:
    """The section of docs/RELIABILITY.md: each input and what ``datagen`` answered."""
    lines = [
        HEADING, "",
        "Every flag and setting given a value it cannot take. `tests/test_bad_input.py` runs "
        "each row as a `datagen` subprocess and checks that it exits with the code shown, "
        "that its message is this one line on stderr (no traceback, no password), and that "
        "this table is what it answered; `python -m tests.bad_input` rewrites it. Each "
        "environment starts from a valid Redis and SQLite database; `x.jsonl` holds one "
        "good prompt.", "",
        "| input | exit | message |",
        "| --- | ---: | --- |",
    ]
    lines += [f"| {_cell(c.label)} | {a.code} | {_cell(a.stderr)} |"
              for c, a in zip(cases, answers, strict=True)]
    return "\n".join(lines) + "\n"


def section_of(doc: str) -> str:
    """The Bad input section of ``doc`` (up to the next ``## `` heading), or ''."""
    start = doc.find(HEADING + "\n")
    if start < 0:
        return ""
    end = doc.find("\n## ", start + len(HEADING))
    # Up to its last line: the blank line before the next heading is the document's.
    return (doc[start:] if end < 0 else doc[start:end]).rstrip("\n") + "\n"


def with_section(doc: str, section: str, before: str = "## Runs") -> str:
    """``doc`` with its Bad input section replaced by ``section`` (or put before ``before``)."""
    old = section_of(doc)
    if old:
        return doc.replace(old, section)
    at = doc.find(before)
    return doc.rstrip() + "\n\n" + section if at < 0 else doc[:at] + section + "\n" + doc[at:]


def main() -> int:
    import redis

    from tests.conftest import REDIS_URL

    with tempfile.TemporaryDirectory() as tmp:
        client = redis.Redis.from_url(REDIS_URL)
        client.flushdb()
        try:
            answers = run_all(CASES, base_env(REDIS_URL, f"sqlite:///{tmp}/datagen.db"),
                              Path(tmp))
        finally:
            client.flushdb()
    DOC.write_text(with_section(DOC.read_text(), render(CASES, answers)))
    print(f"wrote the {HEADING[3:]} section of {DOC} ({len(CASES)} inputs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
