"""Sampling mixtures as written and as drawn: pure functions, no services."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from common.budget import Budget
from common.draws import Choice, Mixtures, draw, draw_key
from common.errors import ConfigError
from common.kept import sample_closer
from common.store import DatasetRow
from producer.generations import expand, generation_id
from producer.mixes import parse_mix_flag, parse_mix_flags
from producer.plan import Draws, plans_from_manifest, plans_from_paths
from producer.reader import MAX_ID_CHARS, PromptRecord, ReadReport

Z99 = 2.5758


def test_a_draw_is_a_pure_function_of_seed_id_and_name() -> None:
    choices = (Choice(0.6, 1), Choice(0.8, 1), Choice(1.0, 1))
    first = [draw(7, f"s{i}", "temperature", choices) for i in range(200)]
    assert first == [draw(7, f"s{i}", "temperature", choices) for i in range(200)]
    assert first != [draw(8, f"s{i}", "temperature", choices) for i in range(200)]
    assert first != [draw(7, f"s{i}", "top_p", choices) for i in range(200)]


def test_weights_decide_the_shares() -> None:
    [(key, choices)] = [parse_mix_flag("reasoning_effort=low:4,medium:4,high:2")]
    n = 20_000
    drawn = [draw(0, f"id-{i}", key, choices) for i in range(n)]
    for value, weight in (("low", 0.4), ("medium", 0.4), ("high", 0.2)):
        share = drawn.count(value) / n
        assert abs(share - weight) <= Z99 * math.sqrt(weight * (1 - weight) / n), value


def test_every_template_draw_is_listed_and_any_draw_it_makes_is_among_them() -> None:
    mix = parse_mix_flags(["thinking=true:1,false:1", "temperature=0.6:1,0.8:1",
                           "reasoning_effort=low:1,high:1"])
    draws = {draw_key(d) for d in mix.template_draws()}
    assert len(draws) == 4  # the sampling key is not a template argument
    assert {draw_key(mix.template(3, f"s{i}")) for i in range(200)} == draws
    assert parse_mix_flags(["temperature=0.6:1,0.8:1"]).template_draws() == []


def test_a_sample_is_judged_by_its_own_draws_reasoning_opener() -> None:
    opens = {draw_key({"thinking": True}): "<think>", draw_key({"thinking": False}): None}
    ds = DatasetRow("d", Budget(), {}, 4096, "tok", "h", reasoning_open="<think>",
                    reasoning_opens=opens)
    assert sample_closer(ds, {"thinking": False}) is None
    assert sample_closer(ds, {"thinking": True}) == "</think>"
    # No draw, or one recorded nowhere (a dataset from before): the dataset's opener.
    assert sample_closer(ds, None) == sample_closer(ds, {"other": 1}) == "</think>"
    before = DatasetRow("d", Budget(), {}, 4096, "tok", "h", reasoning_open="<think>")
    assert sample_closer(before, {"thinking": False}) == "</think>"


def test_flag_values_are_json_when_they_are_json() -> None:
    mix = parse_mix_flags(["thinking=true:1,false:3", "temperature=0.6:1,1:2",
                           "style=a b:1,\"x:y\":1"])
    assert mix.template_keys == ("style", "thinking") and mix.sampling_keys == ("temperature",)
    assert [c.value for c in mix.choices["thinking"]] == [True, False]
    assert [c.value for c in mix.choices["style"]] == ["a b", "x:y"]
    assert Mixtures.from_json(mix.to_json()) == mix


@pytest.mark.parametrize(("flags", "says"), [
    (["temperature"], "KEY=VALUE:WEIGHT"),
    (["temperature=0.6"], "is not VALUE:WEIGHT"),
    (["temperature=0.6:0"], "positive number"),
    (["temperature=0.6:x"], "positive number"),
    (["temperature=0.6:1,0.6:2"], "listed twice"),
    (["max_new_tokens=8:1"], "cannot be a mixture"),
    (["no-dash=1:1"], "not a parameter name"),
    (["top_k=1:1", "top_k=2:1"], "given twice"),
])
def test_bad_mix_flags_are_refused(flags: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_mix_flags(flags)


def test_a_sampling_choice_sglang_refuses_is_refused(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    with pytest.raises(ConfigError, match="--mix top_p must be in"):
        plans_from_paths([str(tmp_path)], Budget(), {}, 64,
                         draws=Draws(parse_mix_flags(["top_p=0.5:1,1.5:1"])))


def test_a_manifest_mix_table_over_the_flags(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    manifest = tmp_path / "m.toml"
    manifest.write_text(
        '[datasets.d]\nfiles = ["d.jsonl"]\ngenerations = 3\n'
        '[datasets.d.mix]\ntemperature = [{value = 0.6, weight = 1}, {value = 1.0}]\n'
        'reasoning_effort = [{value = "low", weight = 4}, {value = "high", weight = 2}]\n')
    flags = Draws(parse_mix_flags(["temperature=0.2:1", "top_p=0.9:1,1.0:1"]), 1)
    [plan] = plans_from_manifest(str(manifest), Budget(), {"temperature": 1.0, "top_k": -1},
                                 64, draws=flags)
    assert plan.generations == 3
    assert set(plan.mixtures.choices) == {"temperature", "top_p", "reasoning_effort"}
    assert plan.mixtures.choices["temperature"] == (Choice(0.6, 1.0), Choice(1.0, 1.0))
    assert plan.sampling == {"top_k": -1}  # a mixed key is drawn, not sent as fixed


@pytest.mark.parametrize(("table", "says"), [
    ('generations = 0\n', "generations must be a whole number"),
    ('temperature = 0.5\n[datasets.d.mix]\ntemperature = [{value = 0.6}]\n',
     "both a value and a mix"),
    ('[datasets.d.mix]\ntemperature = 0.6\n', "must be a list"),
    ('[datasets.d.mix]\ntemperature = [{value = 0.6, wieght = 1}]\n', "each choice is"),
    ('[datasets.d.mix]\ntemperature = [{value = -1.0}]\n', "non-negative"),
])
def test_bad_manifest_mixes_are_refused(tmp_path: Path, table: str, says: str) -> None:
    (tmp_path / "d.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'[datasets.d]\nfiles = ["d.jsonl"]\n{table}')
    with pytest.raises(ConfigError, match=says):
        plans_from_manifest(str(manifest), Budget(), {}, 64)


def test_generations_are_suffixed_from_zero_and_one_keeps_ids() -> None:
    records = [PromptRecord("d", "a", ({"role": "user", "content": "x"},), "f:1"),
               PromptRecord("d", "b" * MAX_ID_CHARS, ({"role": "user", "content": "y"},),
                            "f:2")]
    report = ReadReport("d")
    assert [r.sample_id for r in expand(records, 1, report)] == ["a", "b" * MAX_ID_CHARS]
    assert [r.sample_id for r in expand(records, 3, report)] == ["a_gen0", "a_gen1", "a_gen2"]
    assert report.bad == 1 and "3 generations" in report.problems[0]
    assert generation_id("a", 10) == "a_gen10"
