"""Every flag and setting given a bad value: the real ``datagen`` command, in subprocesses,
answers with one line on stderr and exit code 2, never a traceback (tests/bad_input.py)."""

from __future__ import annotations

import pytest
import redis

from tests.bad_input import (
    CASES,
    DOC,
    PASSWORD,
    Answer,
    Case,
    base_env,
    render,
    run_all,
    section_of,
)
from tests.conftest import REDIS_URL


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Answer]:
    """Every case run once, a few at a time (each is a process start of a second or so)."""
    cwd = tmp_path_factory.mktemp("bad_input")
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    try:
        found = run_all(CASES, base_env(REDIS_URL, f"sqlite:///{cwd / 'datagen.db'}"), cwd)
    finally:
        client.flushdb()
        client.close()
    return {c.label: a for c, a in zip(CASES, found, strict=True)}


@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_a_bad_value_is_one_line_and_exit_code_2(case: Case,
                                                   answers: dict[str, Answer]) -> None:
    answer = answers[case.label]
    assert answer.code == case.code, answer.stderr
    assert case.fragment in answer.stderr
    assert len(answer.stderr.strip().splitlines()) == 1, answer.stderr
    assert "Traceback" not in answer.stderr and PASSWORD not in answer.stderr


def test_the_reliability_doc_records_what_each_input_got(answers: dict[str, Answer]) -> None:
    expected = render(CASES, [answers[c.label] for c in CASES])
    assert section_of(DOC.read_text()) == expected, (
        "docs/RELIABILITY.md's Bad input section is out of date: "
        "run python -m tests.bad_input")


def test_every_setting_has_a_bad_value_in_the_table() -> None:
    from common.settings import LEAST, env_name

    named = {k for c in CASES for k in c.env}
    urls = {"DATAGEN_REDIS_URL", "DATAGEN_DATABASE_URL", "DATAGEN_SGLANG_URL"}
    assert {env_name(n) for n in LEAST} | urls <= named
    assert len({c.label for c in CASES}) == len(CASES), "two cases run the same input"
