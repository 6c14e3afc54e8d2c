"""``datagen report``: the figures' numbers equal SQL on SQLite and PostgreSQL, and the page
opens offline in a real headless Chromium with every figure drawn and no error."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from common.budget import Budget
from common.rows import NewConversation, NewPrompt, ResultRow
from common.schema import prompts, results
from common.store import DatasetRow, Store
from ops.cli import main
from ops.report import write_report
from ops.report_data import build_report
from tests.browser import CHROMIUM, open_page

START = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
CLOSED_AT = START + timedelta(minutes=50)
CAP = 64
# alpha: (completion tokens, finish reason) of each result, one a minute from START
ALPHA = [(10 + 3 * k, "stop") for k in range(12)] + [(CAP, "length"), (20, "budget")]


def _prompt(name: str, k: int, state: str = "queued") -> NewPrompt:
    return NewPrompt(name, f"{name}-{k}", state, 5 + k, CAP, f"{name}.jsonl:{k}",
                     [{"role": "user", "content": "hi"}], [1, 2, 3])


def _result(name: str, k: int, tokens: int, reason: str) -> ResultRow:
    return ResultRow(name, f"{name}-{k}", f"rid-{name}-{k}", 5 + k, tokens, reason,
                     [7] * tokens, "x", "sim", "model")


def _stamp(store: Store, table: sa.Table, name: str, k: int, column: str,
           at: datetime) -> None:
    """Move a row in time: the store stamps rows with the clock of when they are written."""
    where = (table.c.dataset == name, table.c.sample_id == f"{name}-{k}")
    with store.engine.begin() as conn:
        conn.execute(table.update().where(*where).values({column: at}))


def _seed(store: Store) -> None:
    """alpha: closed at its budget, with results over an hour, failures, retries, prompts
    cut by the close and a skipped one; broken: open, every output at its cap."""
    store.upsert_dataset(DatasetRow("alpha", Budget(5000), {}, 4096, "/tok", "h"))
    store.upsert_dataset(DatasetRow("broken", Budget(10_000, "total"), {}, 4096, "/tok", "h"))
    store.insert_prompts([_prompt("alpha", k) for k in range(22)] + [_prompt("alpha", 22,
                         "skipped")] + [_prompt("broken", k) for k in range(6)])
    for k, (tokens, reason) in enumerate(ALPHA):
        if k in (3, 4):  # done after failed attempts
            store.record_attempt("alpha", f"alpha-{k}", "HTTP 503: busy")
        store.save_results([_result("alpha", k, tokens, reason)])
        _stamp(store, results, "alpha", k, "created_at", START + timedelta(minutes=k))
        _stamp(store, prompts, "alpha", k, "updated_at", START + timedelta(minutes=k))
    for k, error in ((14, "HTTP 400: too long"), (15, "HTTP 400: too long"), (16, "boom")):
        store.record_attempt("alpha", f"alpha-{k}", error)
        store.mark_failed("alpha", f"alpha-{k}", error)
        _stamp(store, prompts, "alpha", k, "updated_at", START + timedelta(minutes=20 + k))
    store.record_attempt("alpha", "alpha-17", "HTTP 503: busy")  # retrying
    _stamp(store, prompts, "alpha", 17, "updated_at", START + timedelta(minutes=45))
    store.record_close("alpha", "budget", CLOSED_AT, 4990)
    for k in range(6):
        store.save_results([_result("broken", k, CAP, "length")])
        _stamp(store, results, "broken", k, "created_at", START + timedelta(minutes=30 + k))


@pytest.fixture
def seeded(db_url: str) -> Store:
    store = Store(db_url)
    _seed(store)
    return store


def _sql(store: Store, text: str) -> list[tuple]:
    with store.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text(text))]


def test_the_numbers_drawn_equal_sql(seeded: Store) -> None:
    report = build_report(seeded.engine)
    alpha, broken = report.datasets
    assert (alpha.name, broken.name) == ("alpha", "broken")
    states = dict(_sql(seeded, "SELECT state, COUNT(*) FROM prompts WHERE dataset = 'alpha' "
                               "GROUP BY state"))
    assert alpha.selection == {"kept": states["done"], "waiting": 0, "cut": states["queued"],
                               "failed": states["failed"], "skipped": states["skipped"]}
    assert alpha.selection == {"kept": 14, "waiting": 0, "cut": 5, "failed": 3, "skipped": 1}
    assert alpha.kept_share == pytest.approx(14 / 23)
    assert broken.selection["waiting"] == 0 and broken.selection["kept"] == 6

    # The histogram counts every result once, in the bin its length falls in.
    for d in (alpha, broken):
        rows = _sql(seeded, "SELECT finish_reason, completion_tokens FROM results "
                            f"WHERE dataset = '{d.name}'")
        assert d.bin_width == -(-(CAP + 1) // 40)
        for reason, counts in d.lengths.items():
            expected = [0] * len(counts)
            for r, tokens in rows:
                if r == reason:
                    expected[tokens // d.bin_width] += 1
            assert counts == expected, (d.name, reason)
        assert sum(map(sum, d.lengths.values())) == d.results == len(rows)
    assert list(alpha.lengths) == ["stop", "length", "budget"]

    # Time buckets: one result a minute over the whole span, on the run's one axis.
    [(used,)] = _sql(seeded, "SELECT SUM(completion_tokens) FROM results "
                             "WHERE dataset = 'alpha'")
    assert sum(alpha.cost_tokens) == alpha.used_tokens == used
    assert sum(alpha.samples) == len(ALPHA)
    [(total,)] = _sql(seeded, "SELECT SUM(completion_tokens + prompt_tokens) FROM results "
                              "WHERE dataset = 'broken'")
    assert broken.used_tokens == sum(broken.cost_tokens) == total  # basis "total"
    first = report.axis.start_s
    assert first == int(START.timestamp())
    minute = report.axis.index(int((START + timedelta(minutes=7)).timestamp()))
    assert alpha.samples[minute] >= 1
    assert alpha.closed_at_s == int(CLOSED_AT.timestamp()) and alpha.used_at_close == 4990
    assert broken.closed_at_s is None

    # Failures by error; retries.
    failed = {label: sum(v) for label, v in alpha.failures.items()}
    assert failed == {"failed: HTTP 400: too long": 2, "failed: boom": 1,
                      "retrying: HTTP 503: busy": 1}
    assert sum(alpha.retried_done) == 2
    assert (alpha.broken, broken.broken) == (False, True)
    assert broken.length_share == 1.0


def _seed_conversations(store: Store) -> None:
    """talk, regenerated turn by turn: c1 with its 3 turns stored, c2 with 1 of 3, c3 with
    none of its 2 (its first turn still queued)."""
    store.upsert_dataset(DatasetRow("talk", Budget(50_000), {}, 4096, "/tok", "h"))
    turns = {"c1": (3, 3), "c2": (3, 1), "c3": (2, 0)}
    convs = [NewConversation("talk", c, [{"role": "user", "content": "hi"}], None, n, "t")
             for c, (n, _) in turns.items()]
    rows = [NewPrompt("talk", f"{c}#turn{t}", "queued", 5, CAP, "t", [], [1, 2],
                      conversation=c, turn=t)
            for c, (_, stored) in turns.items() for t in range(1, max(stored, 1) + 1)]
    store.insert_prompts(rows, conversations=convs)
    for c, (_, stored) in turns.items():
        for t in range(1, stored + 1):
            store.save_results([ResultRow("talk", f"{c}#turn{t}", f"rid-{c}-{t}", 5, 9, "stop",
                                          [7] * 9, "x", "sim", "model")])


def test_turns_per_conversation_are_counted_and_drawn(db_url: str, tmp_path: Path) -> None:
    store = Store(db_url)
    _seed(store)
    _seed_conversations(store)
    report = build_report(store.engine)
    by_name = {d.name: d for d in report.datasets}
    assert by_name["talk"].turns_stored == {0: 1, 1: 1, 3: 1}
    assert by_name["alpha"].turns_stored == {}  # not regenerated turn by turn
    # The same from SQL written here: stored turns per conversation, then counted.
    stored = _sql(store, "SELECT c.conversation, COUNT(r.id) FROM conversations c "
                  "LEFT JOIN prompt_inputs i ON i.dataset = c.dataset "
                  "AND i.conversation = c.conversation LEFT JOIN results r "
                  "ON r.dataset = i.dataset AND r.sample_id = i.sample_id "
                  "GROUP BY c.conversation")
    expected: dict[int, int] = {}
    for _, n in stored:
        expected[int(n)] = expected.get(int(n), 0) + 1
    assert by_name["talk"].turns_stored == expected
    page = write_report(store, tmp_path / "r").page.read_text(encoding="utf-8")
    assert "talk: turns stored per conversation" in page
    assert "alpha: turns stored per conversation" not in page


def test_the_page_embeds_the_numbers_and_the_pngs_are_written(
    seeded: Store, tmp_path: Path
) -> None:
    written = write_report(seeded, tmp_path / "out")
    html = written.page.read_text(encoding="utf-8")
    block = re.search(r'<script type="application/json" id="report-data">(.*?)</script>',
                      html, re.S)
    assert block
    data = json.loads(block.group(1))
    assert data == json.loads(json.dumps(written.report.as_json()))
    assert [d["kept_share"] for d in data["datasets"]] == pytest.approx([14 / 23, 1.0])
    assert sorted(p.name for p in written.pngs) == ["alpha.png", "broken.png", "overview.png"]
    for png in written.pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert not re.search(r'(src|href)="(https?:)?//', html)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed "
                    "(apt-get install chromium)")
def test_the_page_opens_offline_in_chromium(sqlite_url: str, tmp_path: Path) -> None:
    store = Store(sqlite_url)
    _seed(store)
    page = write_report(store, tmp_path / "out").page
    checks = {
        "figures": "[...document.querySelectorAll('figure')].map(f => f.id)",
        "svgs": "document.querySelectorAll('figure svg').length",
        "close": "[...document.querySelectorAll('[id^=\"close-\"]')].map(e => e.id)",
        "titles": "[...document.querySelectorAll('svg text')].map(t => t.textContent)"
                  ".filter(t => t.includes(': '))",
        "warning": "document.getElementById('warnings')?.textContent ?? ''",
        "drawn": "document.querySelector('#figure-alpha svg').getBoundingClientRect().height",
    }
    visit = open_page(page, list(checks.values()))
    got = {name: visit.values[expr] for name, expr in checks.items()}
    assert visit.errors == []
    assert visit.requests == [page.resolve().as_uri()]  # nothing fetched from anywhere
    assert visit.screenshot[:8] == b"\x89PNG\r\n\x1a\n" and len(visit.screenshot) > 20_000
    assert got["figures"] == ["figure-overview", "figure-alpha", "figure-broken"]
    assert got["svgs"] == 3
    assert got["close"] == ["close-alpha"]  # broken is open: no close to mark
    for title in ("alpha: tokens used against the budget", "alpha: output tokens by finish "
                  "reason", "alpha: failures and retries by error", "broken: throughput"):
        assert any(t.startswith(title) for t in got["titles"]), title
    assert "broken" in got["warning"] and "alpha" not in got["warning"]
    assert got["drawn"] > 300
    (tmp_path / "screenshot.png").write_bytes(visit.screenshot)


def test_the_command_writes_the_report_and_refuses_an_empty_database(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("DATAGEN_DATABASE_URL", sqlite_url)
    assert main(["report", "--out", str(tmp_path / "empty")]) == 2
    assert "no datasets in sqlite:///" in capsys.readouterr().err
    _seed(Store(sqlite_url))
    assert main(["report", "--out", str(tmp_path / "r")]) == 0
    assert "wrote " in capsys.readouterr().out
    (tmp_path / "a-file").write_text("")
    assert main(["report", "--out", str(tmp_path / "a-file")]) == 2
    assert capsys.readouterr().err.startswith("datagen report: error: --out ")
    assert {p.name for p in (tmp_path / "r").iterdir()} == {
        "index.html", "overview.png", "alpha.png", "broken.png"}


def test_the_report_shows_its_progress_unless_quiet(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Into a pipe, a line at every step when asked (no terminal here): the queries, then
    the figures, ending at the full count."""
    monkeypatch.setenv("DATAGEN_DATABASE_URL", sqlite_url)
    monkeypatch.setenv("DATAGEN_PROGRESS_EVERY_S", "0")
    _seed(Store(sqlite_url))
    assert main(["report", "--out", str(tmp_path / "r")]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("report")]
    assert any("(alpha)" in line for line in lines) and any("(page)" in line for line in lines)
    last = next(line for line in reversed(lines) if "/" in line.split()[1])
    done, total = last.split()[1].split("/")
    assert done == total
    assert main(["report", "--out", str(tmp_path / "q"), "--quiet"]) == 0
    assert not [line for line in capsys.readouterr().err.splitlines()
                if line.startswith("report")]
