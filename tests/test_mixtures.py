"""Sampling mixtures and generations end to end: the producer, a real worker, the
simulator's request log, Redis, SQLite and PostgreSQL."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
import sqlalchemy as sa
from transformers import AutoTokenizer

from common.draws import Mixtures
from common.ledger import Ledger
from common.schema import datasets, prompt_inputs, prompts, results
from common.settings import Settings
from common.store import Store
from ops.cli import main
from producer.mixes import parse_mix_flags
from producer.template import BUNDLED_TOKENIZER
from sim.reqlog import input_sha1
from tests.faultkit import wait_for
from tests.helpers import assert_invariants, running_worker, wait_settled
from tests.test_stop_retry import env as settings_in_env

Z99 = 2.5758
TEMPERATURES = "temperature=0.6:1,0.8:1,1.0:1"
env = settings_in_env


def write_prompts(folder: Path, name: str, n: int, turns: int = 1) -> Path:
    path = folder / f"{name}.jsonl"
    with path.open("w") as fh:
        for i in range(n):
            msgs: list[dict[str, str]] = []
            for t in range(turns):
                msgs += [{"role": "user", "content": f"Question {i}.{t}: explain it."},
                         {"role": "assistant", "content": f"Answer {i}.{t}."}]
            fh.write(json.dumps({"id": f"{name}-{i:05d}", "messages": msgs}) + "\n")
    return path


def enqueue(path: Path, *flags: str) -> int:
    return main(["enqueue", str(path), "-q", "--max-new-tokens", "64", *flags])


def load(env: Settings, tmp_path: Path, name: str, n: int, *flags: str,
         turns: int = 1) -> tuple[Path, Store]:
    """Write and enqueue a dataset: its file and its store."""
    path = write_prompts(tmp_path, name, n, turns)
    assert enqueue(path, *flags) == 0
    return path, Store(env.database_url)


def stored_results(store: Store, name: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """sample_id -> (rid, sampling) of the dataset's results."""
    q = sa.select(results.c.sample_id, results.c.rid, results.c.sampling) \
        .where(results.c.dataset == name)
    with store.engine.connect() as conn:
        return {sid: (rid, sampling) for sid, rid, sampling in conn.execute(q)}


def received(settings: Settings) -> dict[str, dict[str, Any]]:
    """rid -> the request the simulator logged."""
    log = requests.get(f"{settings.sglang_urls[0]}/sim/requests", timeout=10).json()
    return {entry["rid"]: entry for entry in log}


def inputs(store: Store, name: str) -> dict[str, tuple[list[Any], list[int], Any]]:
    """sample_id -> (messages, input_ids, template_kwargs) as stored."""
    q = sa.select(prompt_inputs.c.sample_id, prompt_inputs.c.messages,
                  prompt_inputs.c.input_ids, prompt_inputs.c.template_kwargs) \
        .where(prompt_inputs.c.dataset == name)
    with store.engine.connect() as conn:
        return {sid: (m, ids, kw) for sid, m, ids, kw in conn.execute(q)}


def test_a_temperature_mixture_is_drawn_once_sent_and_stored(
    env: Settings, redis_client: redis.Redis, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    n = 3000
    path, store = load(env, tmp_path, "mix", n, "--seed", "11", "--mix", TEMPERATURES)
    with running_worker(env, concurrency=16):
        wait_for(lambda: store.prompt_counts("mix").get("done", 0) >= 300, 120, "300 done")
    redis_client.flushdb()  # a Redis restarted without its data: queues and ledger gone
    capsys.readouterr()
    assert enqueue(path, "--mix", "temperature=0.6:1,0.8:1") == 2  # it would re-draw
    assert "mixtures temperature 0.6:1,0.8:1,1.0:1" in capsys.readouterr().err
    assert enqueue(path) == 0  # the stored seed and mixture, without saying them
    with running_worker(env, concurrency=16):
        wait_settled(store, ["mix"], timeout_s=300)
    assert_invariants(store, Ledger(redis_client), ["mix"])

    rows, log = stored_results(store, "mix"), received(env)
    assert len(rows) == n
    mixtures = parse_mix_flags([TEMPERATURES])
    for sid, (rid, sampling) in rows.items():
        # What the server received, and the same draw a fresh process makes.
        # Under drain the request is streamed, its stream_interval set so the server sends
        # the first token and the end (common/sglang_stream.py): transport, not sampling.
        sent = {k: v for k, v in log[rid]["sampling_params"].items()
                if k != "stream_interval"}
        assert sent == sampling, sid
        assert sampling["temperature"] == mixtures.sampling(11, sid)["temperature"]
        assert sampling["max_new_tokens"] == 64 and sampling["top_k"] == -1
    shares = Counter(sampling["temperature"] for _, sampling in rows.values())
    assert set(shares) == {0.6, 0.8, 1.0}
    half_width = Z99 * math.sqrt(1 / 3 * 2 / 3 / n)
    for value, count in shares.items():
        assert abs(count / n - 1 / 3) <= half_width, (value, count)

    out = tmp_path / "export"
    assert main(["export", "--format", "speculators", "--out", str(out)]) == 0
    exported = [json.loads(line) for line in (out / "mix.speculators.jsonl").open()]
    assert {r["id"]: r["metadata"]["sampling_params"] for r in exported} == {
        sid: sampling for sid, (_, sampling) in rows.items()}
    capsys.readouterr()
    assert main(["status", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["datasets"]
    assert row["mixtures"] == mixtures.to_json() and row["generations"] == 1


def test_a_template_argument_mixture_renders_each_turn_with_its_conversation_draw(
    env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    path, store = load(env, tmp_path, "think", 40, "--turns", "all", "--mix",
                       "thinking=true:1,false:1", "--mix", "temperature=0.5:1,0.9:1", turns=2)
    with running_worker(env, concurrency=8):
        # A turn answered with nothing past its reasoning ends its conversation there.
        wait_settled(store, ["think"])
    mixtures = Mixtures.of(parse_mix_flags(["thinking=true:1,false:1",
                                            "temperature=0.5:1,0.9:1"]).choices)
    tok = AutoTokenizer.from_pretrained(str(BUNDLED_TOKENIZER))
    stored, rows = inputs(store, "think"), stored_results(store, "think")
    assert set(stored) == set(rows) and len(rows) > 60
    assert sum(sid.endswith("#turn2") for sid in rows) > 20
    for sid, (messages, ids, kwargs) in stored.items():
        conversation = sid.rsplit("#turn", 1)[0]
        drawn = mixtures.template(0, conversation)
        assert kwargs == drawn, sid
        reference = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                            return_dict=False, **drawn)
        assert ids == list(reference), sid
        # Every turn of a conversation is sent its conversation's draw.
        assert rows[sid][1]["temperature"] == mixtures.sampling(0, conversation)["temperature"]
    assert {json.dumps(kw) for _, _, kw in stored.values()} == {
        '{"thinking": true}', '{"thinking": false}'}
    # A turn drawn thinking=false opened no reasoning block: its whole output is its answer,
    # kept, and its conversation goes on, whether or not the output writes </think>.
    opens = {'{"thinking": false}': None, '{"thinking": true}': "<think>"}
    assert store.dataset("think").reasoning_opens == opens
    with store.engine.connect() as conn:
        kept = dict(conn.execute(sa.select(results.c.sample_id, results.c.kept)
                                 .where(results.c.dataset == "think")).all())
        texts = dict(conn.execute(sa.select(results.c.sample_id, results.c.output_text)
                                  .where(results.c.dataset == "think")).all())
    off = [sid for sid, (_, _, kw) in stored.items() if not kw["thinking"]]
    assert off and all(kept[sid] for sid in off)
    assert all(kept[sid] == ("</think>" in texts[sid])
               for sid, (_, _, kw) in stored.items() if kw["thinking"])
    assert all(sid.replace("#turn1", "#turn2") in stored for sid in off
               if sid.endswith("#turn1"))
    # A dataset enqueued before openers were kept per draw gets them at its next enqueue.
    with store.engine.begin() as conn:
        conn.execute(sa.update(datasets).values(reasoning_opens=None))
    assert enqueue(path) == 0
    assert store.dataset("think").reasoning_opens == opens

    out = tmp_path / "export"
    assert main(["export", "--format", "speculators", "--out", str(out)]) == 0
    for r in (json.loads(line) for line in (out / "think.speculators.jsonl").open()):
        assert r["metadata"]["chat_template_kwargs"] == stored[r["id"]][2]
    capsys.readouterr()


def test_three_generations_of_each_prompt(
    env: Settings, redis_client: redis.Redis, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    n = 20
    path, store = load(env, tmp_path, "gens", n, "--generations", "3", "--mix", TEMPERATURES)
    ids = {f"gens-{i:05d}_gen{k}" for i in range(n) for k in range(3)}
    with store.engine.connect() as conn:
        ranks = dict(conn.execute(sa.select(prompts.c.sample_id, prompts.c.rank)
                                  .where(prompts.c.dataset == "gens")).all())
    assert set(ranks) == ids and len(set(ranks.values())) == 3 * n  # a rank each
    capsys.readouterr()
    assert enqueue(path, "--generations", "2", "--mix", TEMPERATURES) == 2
    assert "holds 3 generation(s)" in capsys.readouterr().err
    assert enqueue(path) == 0  # the stored generations and mixture, without saying them
    assert len(store.prompt_states("gens")) == 3 * n

    with running_worker(env, concurrency=8):
        wait_settled(store, ["gens"])
    assert_invariants(store, Ledger(redis_client), ["gens"])
    capsys.readouterr()
    assert main(["retry", "gens", "--temperature", "0.7"]) == 2  # it is drawn, not fixed
    assert "draws temperature from a mixture" in capsys.readouterr().err
    rows, log = stored_results(store, "gens"), received(env)
    assert set(rows) == ids
    sent = [log[rid] for rid, _ in rows.values()]
    assert len({e["rid"] for e in sent}) == 3 * n  # three requests, a rid each
    by_prompt = Counter(e["input_sha1"] for e in sent)
    assert len(by_prompt) == n and set(by_prompt.values()) == {3}
    messages = inputs(store, "gens")
    for sid in ids:
        assert input_sha1(messages[sid][1]) in by_prompt

    for fmt in ("specforge", "speculators"):
        out = tmp_path / fmt
        assert main(["export", "--format", fmt, "--out", str(out)]) == 0
        exported = [json.loads(line) for line in (out / f"gens.{fmt}.jsonl").open()]
        totals = json.loads((out / "manifest.datagen").read_text())["totals"]
        assert totals["results"] == 3 * n == totals["exported"] + totals["left_out"]
        # SpecForge leaves out the samples cut while still reasoning.
        assert {r["id"] for r in exported} <= ids and len(exported) == totals["exported"]
        if fmt == "specforge":
            assert all(r["sampling"] == rows[r["id"]][1] for r in exported)
        else:
            assert {r["id"] for r in exported} == ids
            # speculators' key for a line: the same for each of its generations.
            assert all(r["primary_id"] == r["id"].rpartition("_gen")[0] for r in exported)
    card = (tmp_path / "speculators" / "README.md").read_text()
    assert "| drawn per sample | temperature 0.6:1,0.8:1,1.0:1 |" in card
    assert "| generations per prompt | 3 |" in card
    capsys.readouterr()

