"""Sampling values SGLang refuses are refused at the door: exit 2, a clear message, and
nothing stored in SQL or Redis."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from common.errors import ConfigError
from common.sampling_rules import check_sampling
from common.schema import datasets, prompts
from common.settings import Settings
from ops.cli import main
from tests.helpers import write_dataset


@pytest.fixture
def env(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Settings:
    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    return settings


BAD_FLAGS = [
    (["--top-p", "7"], "--top-p must be in (0, 1], got 7"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0"),
    (["--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
    (["--temperature", "-1"], "--temperature must be a non-negative finite number, got -1"),
    (["--temperature", "inf"], "--temperature must be a non-negative finite number, got inf"),
    (["--top-k", "-5"], "--top-k must be -1 (disable) or at least 1, got -5"),
    (["--top-k", "0"], "--top-k must be -1 (disable) or at least 1, got 0"),
    (["--min-p", "3"], "--min-p must be in [0, 1], got 3"),
    (["--min-p", "-0.1"], "--min-p must be in [0, 1], got -0.1"),
]

BAD_MANIFEST = [
    ("top_p = 7", "[datasets.m]: top_p must be in (0, 1], got 7"),
    ("temperature = -1.5", "[datasets.m]: temperature must be a non-negative finite number"),
    ("top_k = -5", "[datasets.m]: top_k must be -1 (disable) or at least 1, got -5"),
    ("min_p = 3", "[datasets.m]: min_p must be in [0, 1], got 3"),
    ('temperature = "hot"', "[datasets.m]: temperature must be a number, got 'hot'"),
    ("top_k = 2.5", "[datasets.m]: top_k must be an integer, got 2.5"),
    ("top_p = true", "[datasets.m]: top_p must be a number, got True"),
    ("max_new_tokens = 0", "[datasets.m]: max_new_tokens must be at least 1, got 0"),
    ('max_new_tokens = "lots"', "[datasets.m]: max_new_tokens must be an integer"),
]


def assert_nothing_stored(settings: Settings, client: redis.Redis) -> None:
    engine = sa.create_engine(settings.database_url)
    try:
        with engine.connect() as conn:
            for table in (datasets, prompts):
                if sa.inspect(conn).has_table(table.name):
                    assert conn.scalar(sa.select(sa.func.count()).select_from(table)) == 0
    finally:
        engine.dispose()
    assert client.dbsize() == 0, client.keys()


@pytest.mark.parametrize(("flags", "needle"), BAD_FLAGS)
def test_bad_sampling_flags_exit_2_and_store_nothing(
    env: Settings, tmp_path: Path, redis_client: redis.Redis,
    capsys: pytest.CaptureFixture[str], flags: list[str], needle: str,
) -> None:
    path = write_dataset(tmp_path, "d", 3)
    assert main(["enqueue", str(path), "-q", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("datagen enqueue: ") and needle in err, err
    assert_nothing_stored(env, redis_client)


@pytest.mark.parametrize(("line", "needle"), BAD_MANIFEST)
def test_bad_sampling_in_a_manifest_exits_2_and_stores_nothing(
    env: Settings, tmp_path: Path, redis_client: redis.Redis,
    capsys: pytest.CaptureFixture[str], line: str, needle: str,
) -> None:
    write_dataset(tmp_path, "ok", 3)
    write_dataset(tmp_path, "m", 3)
    manifest = tmp_path / "datasets.toml"
    # The good dataset comes first: it must not be stored either.
    manifest.write_text('[datasets.ok]\nfiles = ["ok.jsonl"]\n'
                        f'[datasets.m]\nfiles = ["m.jsonl"]\n{line}\n')
    assert main(["enqueue", "--manifest", str(manifest), "-q"]) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert_nothing_stored(env, redis_client)


def test_retry_refuses_bad_sampling_before_changing_anything(
    env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["enqueue", str(write_dataset(tmp_path, "r", 2)), "-q", "--top-p", "0.5"]) == 0
    capsys.readouterr()
    assert main(["retry", "r", "--top-p", "7"]) == 2
    assert "--top-p must be in (0, 1], got 7" in capsys.readouterr().err
    with sa.create_engine(env.database_url).connect() as conn:
        stored = conn.scalar(sa.select(datasets.c.sampling).where(datasets.c.name == "r"))
    assert stored["top_p"] == 0.5


@pytest.mark.parametrize("values", [
    {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0},
    {"temperature": 0.6, "top_p": 0.95, "top_k": 1, "min_p": 1.0},
    {"temperature": 2, "top_p": 1, "top_k": 50, "max_new_tokens": 1},
    # SGLang turns a temperature below 1e-6 into greedy decoding (top_k = 1) before its
    # checks, so it accepts any top_k then.
    {"temperature": 0.0, "top_k": 0},
])
def test_values_sglang_accepts_pass(values: dict[str, float]) -> None:
    check_sampling(values)


def test_the_first_value_refused_is_named() -> None:
    with pytest.raises(ConfigError, match=r"^--top-p must be in \(0, 1\], got 1.5$"):
        check_sampling({"temperature": 0.5, "top_p": 1.5, "min_p": 9})
