"""Export ids unique across datasets, on SQLite and PostgreSQL, results from a real
worker and the simulator: two datasets made from one file hold the same ids, and an
export of both writes each shared line's rows as ``<dataset>/<id>`` (``id``,
``primary_id``, ``source_id``), every other id as stored; an export of one dataset keeps
its ids; ``validate`` finds the same lines shared and an id repeated across files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.ledger import Ledger
from common.settings import Settings
from common.store import Store
from ops.cli import main
from tests.helpers import assert_invariants, enqueue_paths, running_worker, wait_settled

LINES: list[dict[str, Any]] = [
    *({"id": f"p{i}", "messages": [{"role": "user", "content": f"Prompt {i}?"}]}
      for i in range(4)),
    {"id": "talk", "messages": [{"role": "user", "content": "Hi?"},
                                {"role": "assistant", "content": "Hello."},
                                {"role": "user", "content": "And then?"}]},
]
OTHER = [{"id": f"o{i}", "messages": [{"role": "user", "content": f"Other {i}?"}]}
         for i in range(3)]


def _write(path: Path, lines: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return str(path)


def _rows(out: Path, fmt: str) -> dict[str, list[dict[str, Any]]]:
    return {path.name.split(".")[0]: [json.loads(x) for x in path.read_text().splitlines()]
            for path in sorted(out.glob(f"*.{fmt}.jsonl"))}


@pytest.fixture
def three(settings: Settings, store: Store, ledger: Ledger, tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> Path:
    """Datasets ``a`` and ``b`` from one file (a conversation among its lines), ``c``
    from another."""
    paths = [_write(tmp_path / "a.jsonl", LINES), _write(tmp_path / "b.jsonl", LINES),
             _write(tmp_path / "c.jsonl", OTHER)]
    enqueue_paths(settings, paths, max_new_tokens=400, turns="all")
    with running_worker(settings, concurrency=4):
        wait_settled(store, ["a", "b", "c"], client=ledger.redis)
    assert_invariants(store, ledger, ["a", "b", "c"])
    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    return tmp_path


@pytest.mark.parametrize("flags", [("speculators",), ("speculators", "--rows", "conversation"),
                                   ("specforge",), ("specforge", "--rows", "turn")])
def test_datasets_from_one_file_get_ids_unique_across_the_export(
    three: Path, flags: tuple[str, ...],
) -> None:
    fmt, out = flags[0], three / "all"
    assert main(["export", "--format", *flags, "--out", str(out)]) == 0
    rows = _rows(out, fmt)
    ids = [r["id"] for file in rows.values() for r in file]
    assert len(ids) == len(set(ids)) and rows["a"] and rows["c"]
    for name in ("a", "b"):  # every line shared: each row's keys name its dataset
        for r in rows[name]:
            assert r["id"].startswith(f"{name}/")
            for key in ("primary_id", "source_id"):
                assert r.get(key, f"{name}/")[: len(name) + 1] == f"{name}/"
    # c's ids as stored (a SpecForge turn row's: the line's, its turn numbered from 0).
    assert {r["id"].partition("#")[0] for r in rows["c"]} == {f"o{i}" for i in range(3)}
    manifest = json.loads((out / "manifest.datagen").read_text())
    assert manifest["shared_lines"] == len(LINES)
    assert f"the {len(LINES)} lines that more than one dataset holds" in \
        (out / "README.md").read_text()
    assert main(["validate", str(out)]) == 0
    assert main(["validate", str(out), "--dataset", "b"]) == 0  # b checked as exported

    # One dataset alone: its ids as stored, as any earlier export wrote them.
    alone = three / "alone"
    assert main(["export", "--format", *flags, "--out", str(alone), "--dataset", "a"]) == 0
    plain = _rows(alone, fmt)["a"]
    assert [r["id"] for r in plain] == [r["id"].removeprefix("a/") for r in rows["a"]]
    assert json.loads((alone / "manifest.datagen").read_text())["shared_lines"] == 0
    assert main(["validate", str(alone)]) == 0


def test_an_id_repeated_across_files_fails_validation(
    three: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    out = three / "all"
    assert main(["export", "--format", "speculators", "--out", str(out)]) == 0
    path = out / "b.speculators.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    rows[0]["id"] = "a/" + rows[0]["id"].removeprefix("b/")  # a's id, in b's file
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert main(["validate", str(out)]) == 1
    assert f"id {rows[0]['id']!r} is also an id of a's file" in capsys.readouterr().out
