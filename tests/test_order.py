"""The publishing order's rank function and its resolution against a dataset's stored
order; the flags, manifest keys and setting that ask for one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import ConfigError
from common.order import MAX_SEED, Order, OrderRequest, rank_key, shuffle_rank
from common.settings import Settings
from ops.cli import build_parser
from producer.command import build_plans
from tests.conftest import ROOT

# Written down once: a change of the function would re-draw every dataset's subset.
GOLDEN = [
    (0, "a", 6682486784888570269),
    (0, "B2-000001", 8537402545143996295),
    (7, "B2-000001", 6649571300368511726),
    (MAX_SEED, "ünï", 1291030699314641987),
]


@pytest.mark.parametrize(("seed", "sample_id", "rank"), GOLDEN)
def test_the_rank_is_a_fixed_function_of_seed_and_id(seed: int, sample_id: str,
                                                     rank: int) -> None:
    assert shuffle_rank(seed, sample_id) == rank
    assert 0 <= rank < 2**63  # a signed BIGINT holds it


def test_the_rank_is_the_same_in_other_processes_whatever_their_hash_seed() -> None:
    code = ("import json, sys; from common.order import shuffle_rank; "
            "print(json.dumps([shuffle_rank(s, i) for s, i, _ in json.load(sys.stdin)]))")
    for hash_seed in ("1", "2", "random"):
        out = subprocess.run(
            [sys.executable, "-c", code], input=json.dumps(GOLDEN), capture_output=True,
            text=True, check=True, cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert json.loads(out.stdout) == [rank for _, _, rank in GOLDEN]


def test_seeds_draw_different_orders_and_each_is_a_permutation() -> None:
    ids = [f"s{i}" for i in range(1000)]
    orders = [[sid for _, sid in Order("shuffle", seed).arrange(ids, str)] for seed in (0, 1)]
    assert sorted(orders[0]) == sorted(ids) == sorted(orders[1])
    assert orders[0] != orders[1] and orders[0] != ids
    # A shuffled head holds both halves of a sorted list about evenly.
    head = orders[0][:200]
    assert 70 <= sum(int(sid[1:]) >= 500 for sid in head) <= 130


def test_file_order_streams_with_positions() -> None:
    seen: list[str] = []

    def read() -> object:
        for i in range(3):
            seen.append(f"r{i}")
            yield f"r{i}"

    ranked = Order("file").arrange(read(), str)
    assert next(ranked) == (0, "r0") and seen == ["r0"]  # nothing read ahead
    assert list(ranked) == [(1, "r1"), (2, "r2")]
    assert Order("file", 5).seed is None


def test_rank_key_sorts_as_sql_does_nulls_first_then_ties_by_id() -> None:
    rows = [(5, "b"), (None, "z"), (5, "a"), (None, "c"), (2, "y")]
    assert sorted(rows, key=lambda r: rank_key(*r)) == [
        (None, "c"), (None, "z"), (2, "y"), (5, "a"), (5, "b")]


def test_a_dataset_keeps_its_stored_order_unless_it_holds_no_prompts() -> None:
    stored = Order("shuffle", 7)
    assert OrderRequest(default_seed=3).resolve("d", stored, True) == stored
    assert OrderRequest(seed=7).resolve("d", stored, True) == stored
    assert OrderRequest("file").resolve("d", Order("file"), True) == Order("file")
    assert OrderRequest(seed=9).resolve("d", Order("file"), True) == Order("file")
    assert OrderRequest(seed=9).resolve("d", stored, False) == Order("shuffle", 9)
    assert OrderRequest(default_seed=3).resolve("d", None, False) == Order("shuffle", 3)
    assert OrderRequest("file").resolve("d", None, False) == Order("file")
    for asked in (OrderRequest(seed=8), OrderRequest("file")):
        with pytest.raises(ConfigError, match="re-draw") as err:
            asked.resolve("d", stored, True)
        assert "shuffled with seed 7" in str(err.value)


def _plans(argv: list[str], settings: Settings | None = None) -> list:
    args = build_parser().parse_args(["enqueue", *argv])
    return build_plans(args, settings or Settings())


def test_flags_manifest_and_setting_ask_for_an_order(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    [plan] = _plans([str(data)])
    assert plan.order == OrderRequest(None, None, 0)
    [plan] = _plans([str(data), "--order", "file", "--seed", "4"], Settings(default_seed=9))
    assert plan.order == OrderRequest("file", 4, 9)
    manifest = tmp_path / "m.toml"
    manifest.write_text('[datasets.one]\nfiles = ["d.jsonl"]\norder = "file"\n'
                        '[datasets.two]\nfiles = ["d.jsonl"]\nseed = 11\n')
    one, two = _plans(["--manifest", str(manifest), "--seed", "5"])
    assert (one.order.kind, one.order.seed) == ("file", 5)
    assert (two.order.kind, two.order.seed) == (None, 11)
    manifest.write_text('[datasets.one]\nfiles = ["d.jsonl"]\nseed = -1\n')
    with pytest.raises(ConfigError, match=r"\[datasets.one\]: seed must be a whole number"):
        _plans(["--manifest", str(manifest)])
    manifest.write_text('[datasets.one]\nfiles = ["d.jsonl"]\norder = "random"\n')
    with pytest.raises(ConfigError, match="order must be one of shuffle, file"):
        _plans(["--manifest", str(manifest)])


def test_a_bad_seed_or_order_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--seed", "-1"], ["--seed", str(MAX_SEED + 1)], ["--order", "random"]):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(["enqueue", "x.jsonl", *argv])
        assert exit_.value.code == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
    with pytest.raises(ConfigError, match="DATAGEN_DEFAULT_SEED"):
        Settings.from_env({"DATAGEN_DEFAULT_SEED": str(MAX_SEED + 1)})
    with pytest.raises(ConfigError, match="DATAGEN_DEFAULT_SEED=-1 must be at least 0"):
        Settings.from_env({"DATAGEN_DEFAULT_SEED": "-1"})
    assert Settings.from_env({"DATAGEN_DEFAULT_SEED": "42"}).default_seed == 42
