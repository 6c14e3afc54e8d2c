"""The README's first command: ``datagen demo`` runs the whole job on its embedded defaults
(bundled prompts, the simulator, SQLite) and shows the result; run again, it resumes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import redis
import sqlalchemy as sa

from common.budget import Budget
from common.keys import DATASETS
from common.ledger import Ledger
from common.pairing import pair
from common.store import Store
from tests.conftest import REDIS_URL

ROOT = Path(__file__).resolve().parent.parent
DEMO_TIMEOUT_S = 300


def run_demo(db_file: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATAGEN_DATABASE_URL": f"sqlite:///{db_file}",
           "DATAGEN_REDIS_URL": REDIS_URL, "NO_COLOR": "1", "COLUMNS": "200"}
    env.pop("DATAGEN_SGLANG_URLS", None)
    return subprocess.run([sys.executable, "-m", "ops.cli", "demo"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=DEMO_TIMEOUT_S)


def stored(db_file: Path) -> dict[str, tuple[int, int, int]]:
    """Per dataset: result rows, distinct samples, output tokens."""
    engine = sa.create_engine(f"sqlite:///{db_file}")
    with engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT dataset, COUNT(*), COUNT(DISTINCT sample_id), SUM(completion_tokens) "
            "FROM results GROUP BY dataset")).all()
    engine.dispose()
    return {r[0]: (int(r[1]), int(r[2]), int(r[3])) for r in rows}


def test_the_demo_runs_end_to_end_then_resumes_without_generating_twice(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    db_file = tmp_path / "datagen.db"
    first = run_demo(db_file)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "SQL over results" in first.stdout
    after_first = stored(db_file)
    # examples/: chat and math finish all 60 prompts; code's 6,000-token budget closes it.
    assert after_first["chat"][:2] == (60, 60)
    assert after_first["math"][:2] == (60, 60)
    code_rows, code_samples, code_tokens = after_first["code"]
    assert code_rows == code_samples and 0 < code_samples < 60 and code_tokens >= 6000
    assert code_tokens == 6000  # the `exact` policy the README states: no overshoot

    again = run_demo(db_file)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert stored(db_file) == after_first


def test_the_demo_leaves_a_redis_of_another_database_alone_and_runs_on_its_own(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    # Another checkout's run on the same Redis database: its `code` closed at 9,000 tokens.
    elsewhere = Store(f"sqlite:///{tmp_path / 'elsewhere.db'}")
    ledger = Ledger(redis_client)
    pair(elsewhere, ledger)
    ledger.configure("code", Budget(tokens=6000))
    ledger.absorb("code", [(f"code-{i}", 300) for i in range(30)])
    ledger.close("code", "budget")
    before = ledger.state("code")

    db_file = tmp_path / "datagen.db"
    run = run_demo(db_file)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "holds another results database's queues and ledgers" in run.stdout
    assert "started a private one at redis://127.0.0.1:" in run.stdout
    results = stored(db_file)
    # This run's own ledgers: code generated until its own 6,000 tokens, not closed at 0.
    assert results["chat"][:2] == (60, 60) and results["math"][:2] == (60, 60)
    assert 0 < results["code"][1] < 60 and results["code"][2] >= 6000
    assert ledger.state("code") == before and ledger.paired_store() == elsewhere.store_id
    assert redis_client.scard(DATASETS) == 1
