"""The datagen command as users run it: exit codes, summaries, status keys, manifests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from common.ledger import Ledger
from common.settings import Settings
from common.store import Store
from ops.cli import main
from tests.conftest import EXAMPLES
from tests.helpers import running_worker, wait_settled, write_dataset
from tests.test_status_plan import STATUS_KEYS


@pytest.fixture
def env(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Settings:
    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    return settings


def test_enqueue_reports_bad_lines_and_prints_a_summary(
    env: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["enqueue", str(EXAMPLES), "-q", "--max-new-tokens", "256"]) == 0
    out, err = capsys.readouterr()
    assert "math.jsonl:19: invalid JSON" in err
    assert "math.jsonl:44: unknown role 'narrator'" in err
    assert "180 enqueued" in out
    store = Store(env.database_url)
    assert store.prompt_counts("math") == {"queued": 60}


def test_status_json_has_exactly_the_documented_keys(
    env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["enqueue", str(write_dataset(tmp_path, "st", 4)), "-q", "--budget-tokens", "50k"])
    capsys.readouterr()
    with running_worker(env, concurrency=4):
        wait_settled(Store(env.database_url), ["st"])
    assert main(["status", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["datasets"]
    assert len(rows) == 1 and set(rows[0]) == STATUS_KEYS
    row = rows[0]
    assert (row["name"], row["state"], row["prompts"], row["done"]) == ("st", "open", 4, 4)
    assert row["budget_tokens"] == 50_000 and row["closed_at"] is None
    assert row["used_tokens"] == Store(env.database_url).used_tokens(
        "st", Store(env.database_url).dataset("st").budget)


def test_manifest_sets_per_dataset_budgets_and_sampling(
    env: Settings, tmp_path: Path
) -> None:
    write_dataset(tmp_path, "m1", 3)
    write_dataset(tmp_path, "m2", 3)
    manifest = tmp_path / "datasets.toml"
    manifest.write_text(
        '[datasets.m1]\nfiles = ["m1.jsonl"]\nbudget_tokens = "2M"\npolicy = "exact"\n'
        '[datasets.m2]\nfiles = ["m2.jsonl"]\ntemperature = 0.6\nbasis = "total"\n'
    )
    assert main(["enqueue", "--manifest", str(manifest), "-q"]) == 0
    store = Store(env.database_url)
    m1, m2 = store.dataset("m1"), store.dataset("m2")
    assert (m1.budget.tokens, m1.budget.policy) == (2_000_000, "exact")
    assert (m2.budget.tokens, m2.budget.basis, m2.sampling["temperature"]) == (
        10_000_000, "total", 0.6)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["enqueue", "nowhere.jsonl"], "no such file"),
        (["enqueue", "x.jsonl", "--budget-tokens", "-5"], "positive"),
        (["enqueue", "x.jsonl", "--budget-tokens", "lots"], "not a number"),
        (["enqueue", "x.jsonl", "--chat-template-kwargs", "{bad"], "not JSON"),
        (["enqueue", "x.jsonl", "--tokenizer", "/no/such/dir"], "tokenizer"),
        (["reopen", "nosuch", "--budget-tokens", "5M"], "unknown dataset"),
    ],
)
def test_bad_invocations_exit_2_with_a_clear_message(
    env: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    write_dataset(tmp_path, "x", 1)
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_unreachable_redis_is_named(
    env: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("DATAGEN_REDIS_URL", "redis://:secret@127.0.0.1:1/0")
    assert main(["enqueue", str(write_dataset(tmp_path, "r", 1)), "-q"]) == 3
    err = capsys.readouterr().err
    assert "does not answer" in err and "secret" not in err


def test_reopen_raises_the_budget_and_enqueues_what_remains(
    env: Settings, tmp_path: Path, redis_client: redis.Redis,
    capsys: pytest.CaptureFixture[str],
) -> None:
    main(["enqueue", str(write_dataset(tmp_path, "ro", 30)), "-q", "--budget-tokens", "600"])
    store, ledger = Store(env.database_url), Ledger(redis_client)
    with running_worker(env, concurrency=2):
        wait_settled(store, ["ro"])
        assert store.dataset("ro").state == "closed"
        left = store.prompt_counts("ro").get("queued", 0)
        assert left > 0
        capsys.readouterr()
        assert main(["reopen", "ro", "--budget-tokens", "10M"]) == 0
        assert f"{left} prompts enqueued" in capsys.readouterr().out
        wait_settled(store, ["ro"])
    assert store.prompt_counts("ro") == {"done": 30}
    assert ledger.state("ro").used_tokens == store.used_tokens("ro", store.dataset("ro").budget)


def test_commands_other_than_export_do_not_load_pyarrow() -> None:
    # Every command builds the whole parser, export's and report's included; pyarrow,
    # numpy and matplotlib would add 40 MB and more to each worker's resident memory.
    code = ("import sys; from ops.cli import build_parser; import workers.celery; "
            "build_parser().parse_args(['worker']); "
            "print(sorted(m for m in ('pyarrow', 'numpy', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1]).stdout
    assert out.strip() == "[]"
