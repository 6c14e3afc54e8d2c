"""Bad input through the ``datagen`` command, as users type it: a clear message naming what
and where, a non-zero exit where the command cannot go on, and nothing already stored lost.

tests/test_reader.py covers each bad-line reason of the reader and tests/test_cli.py a
first set of bad invocations; these add what reaches users through the whole command.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import redis

from common.rows import ResultRow
from common.settings import Settings
from common.store import Store
from ops.cli import main
from producer.template import BUNDLED_TOKENIZER
from tests.conftest import make_settings
from tests.helpers import write_dataset

GOOD = {"messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture
def env(sqlite_url: str, sim: str, redis_client: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> Settings:
    settings = make_settings(sqlite_url, sim)
    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    return settings


def cli(*argv: str) -> int:
    """``datagen ARGV``'s exit status, argparse's own exits included."""
    try:
        return main(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)


def fake_result(store: Store, dataset: str, sample_id: str) -> None:
    store.save_result(ResultRow(
        dataset=dataset, sample_id=sample_id, rid="r-1", prompt_tokens=3,
        completion_tokens=2, finish_reason="stop", finish_detail={"type": "stop"},
        output_ids=[7, 8], output_text="ok", e2e_latency_s=0.1, server="s",
        model="m",
    ))


def test_bad_lines_are_named_by_file_and_line_and_nothing_stored_is_lost(
    env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mix.jsonl"
    path.write_text(json.dumps({"id": "g0", **GOOD}) + "\n")
    assert cli("enqueue", str(path), "-q") == 0
    store = Store(env.database_url)
    fake_result(store, "mix", "g0")  # g0 was generated and stored before the bad re-run
    with path.open("ab") as fh:
        fh.write(b'{"id": "broken", "messages": [\n')
        fh.write(b'{"id": "latin1", "messages": [{"role": "user", "content": "caf\xe9"}]}\n')
        fh.write(b'{"id": "huge", "x": "' + b"x" * (20 * 1024 * 1024) + b'"}\n')
        fh.write(json.dumps({"id": "g1", **GOOD}).encode() + b"\n")
    capsys.readouterr()
    assert cli("enqueue", str(path), "-q") == 0  # bad lines are skipped, not fatal
    out, err = capsys.readouterr()
    assert f"{path}:2: invalid JSON" in err
    assert f"{path}:3: invalid UTF-8 at byte" in err
    assert f"{path}:4: line is 20971" in err and "over the 16 MiB limit" in err
    assert "1 enqueued" in out
    assert store.prompt_counts("mix") == {"done": 1, "queued": 1}
    assert store.has_result("mix", "g0") and store.prompt("mix", "g1") is not None


def test_an_empty_file_says_so_and_enqueues_nothing(
    env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "void.jsonl").write_bytes(b"")
    assert cli("enqueue", str(tmp_path / "void.jsonl"), "-q") == 0
    out, err = capsys.readouterr()
    assert f"{tmp_path / 'void.jsonl'}: empty file" in err and "0 enqueued" in out


def test_a_folder_without_jsonl_exits_2_naming_it(
    env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("{}")
    assert cli("enqueue", str(tmp_path), "-q") == 2
    assert f"{tmp_path}: folder holds no .jsonl files" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["a/b", "../x", "x y", "q\x06\x163", "semi;colon", "*"])
def test_unsafe_dataset_names_in_a_manifest_are_refused_before_any_key_or_row(
    env: Settings, tmp_path: Path, redis_client: redis.Redis, name: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    write_dataset(tmp_path, "ok", 2)
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'[datasets.ok]\nfiles = ["ok.jsonl"]\n'
                        f'[datasets.{json.dumps(name)}]\nfiles = ["ok.jsonl"]\n')
    assert cli("enqueue", "--manifest", str(manifest), "-q") == 2
    err = capsys.readouterr().err
    assert f"dataset name {name!r} is not allowed" in err and str(manifest) in err
    assert Store(env.database_url).dataset_names() == []  # not even the good one
    assert redis_client.keys() == []


@pytest.mark.parametrize("stem", ["my data", "a:b", "q\x06\x163", "x" * 101])
def test_unsafe_file_stems_are_refused(
    env: Settings, tmp_path: Path, redis_client: redis.Redis, stem: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / f"{stem}.jsonl").write_text(json.dumps(GOOD) + "\n")
    assert cli("enqueue", str(tmp_path), "-q") == 2
    assert "is not allowed" in capsys.readouterr().err
    assert redis_client.keys() == []


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--budget-tokens", "0"], "positive"),
        (["--budget-tokens", "2.5"], "whole number"),
        (["--budget-tokens", "1e9"], "not a number"),
        (["--budget-tokens"], "expected one argument"),
        (["--policy", "yolo"], "invalid choice: 'yolo'"),
        (["--budget-basis", "input"], "invalid choice: 'input'"),
        (["--max-new-tokens", "0"], "must be positive"),
    ],
)
def test_bad_budget_and_policy_flags_exit_2(
    env: Settings, tmp_path: Path, flags: list[str], needle: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = write_dataset(tmp_path, "flags", 1)
    assert cli("enqueue", str(path), "-q", *flags) == 2
    assert needle in capsys.readouterr().err
    assert Store(env.database_url).dataset_names() == []


BAD_TERMS = [
    ('budget_tokens = "ten"', "not a number of tokens"),
    ("budget_tokens = -5", "positive"),
    ('policy = "yolo"', "unknown policy 'yolo'"),
    ('basis = "input"', "unknown budget basis 'input'"),
]


@pytest.mark.parametrize(("line", "needle"), BAD_TERMS)
def test_bad_terms_in_a_manifest_exit_2(
    env: Settings, tmp_path: Path, line: str, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    write_dataset(tmp_path, "terms", 1)
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'[datasets.terms]\nfiles = ["terms.jsonl"]\n{line}\n')
    assert cli("enqueue", "--manifest", str(manifest), "-q") == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("line", [line for line, _needle in BAD_TERMS])
def test_bad_terms_in_a_manifest_name_where_they_are(
    env: Settings, tmp_path: Path, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    write_dataset(tmp_path, "terms", 1)
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'[datasets.terms]\nfiles = ["terms.jsonl"]\n{line}\n')
    assert cli("enqueue", "--manifest", str(manifest), "-q") == 2
    assert f"manifest {manifest} [datasets.terms]" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["nosuch", "../../etc/passwd"])
@pytest.mark.parametrize("command", ["purge", "reopen", "export"])
def test_unknown_datasets_exit_2_and_list_the_known_ones(
    env: Settings, tmp_path: Path, command: str, name: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli("enqueue", str(write_dataset(tmp_path, "known", 1)), "-q") == 0
    capsys.readouterr()
    out = tmp_path / "exports"
    argv = {"purge": ["purge", name], "reopen": ["reopen", name, "--budget-tokens", "5M"],
            "export": ["export", "--format", "specforge", "--out", str(out), "--dataset", name]}
    assert cli(*argv[command]) == 2
    assert f"unknown dataset {name!r}; known datasets: known" in capsys.readouterr().err
    assert not out.exists() or list(out.iterdir()) == []
    assert Store(env.database_url).dataset("known").state == "open"


def test_a_tokenizer_without_a_chat_template_exits_2_naming_it(
    env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tok = tmp_path / "tok"
    shutil.copytree(BUNDLED_TOKENIZER, tok)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in tok.glob("*.jinja"):
        extra.unlink()
    path = write_dataset(tmp_path, "tpl", 1)
    assert cli("enqueue", str(path), "-q", "--tokenizer", str(tok)) == 2
    assert f"tokenizer at {tok} has no chat template" in capsys.readouterr().err
    assert Store(env.database_url).dataset_names() == []
