"""Security on the real stack: JSON-only messages (a pickle payload is refused, never run),
SQL through bound parameters only, and dataset names validated before they reach a queue
name, a Redis key or a file path."""

from __future__ import annotations

import json
import logging
import os
import pickle
import uuid
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from kombu import Connection, Exchange, Producer, Queue

from common.celery_app import make_celery
from common.errors import InputError
from common.keys import dataset_keys, queue_name
from common.ledger import Ledger
from common.messages import GENERATE_TASK
from common.names import validate_dataset_name
from common.schema import prompt_inputs, results
from common.settings import Settings
from common.store import Store
from ops.cli import main
from producer.reader import discover
from tests.helpers import enqueue_paths, running_worker, wait_settled, write_dataset

INJECTIONS = ["x'; DROP TABLE results; --", 'Robert"); DROP TABLE prompts;--', "%(x)s :id \\'"]


class Marker:
    """Unpickling this creates a directory: the proof that a payload was deserialized."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (str(self.path),)


def publish_pickle(settings: Settings, dataset: str, marker: Path) -> None:
    """A Celery protocol-2 task message whose body is pickled, into the dataset's queue."""
    queue = queue_name(dataset)
    exchange = Exchange(queue, type="direct")
    task_id = str(uuid.uuid4())
    body: tuple[tuple[()], dict[str, object], dict[str, object]] = (
        (), {"dataset": dataset, "sample_id": Marker(marker)}, {})
    with Connection(settings.redis_url) as conn:
        Producer(conn).publish(
            body, serializer="pickle", exchange=exchange, routing_key=queue,
            declare=[Queue(queue, exchange, routing_key=queue)],
            headers={"lang": "py", "task": GENERATE_TASK, "id": task_id, "root_id": task_id,
                     "parent_id": None, "group": None, "retries": 0, "eta": None,
                     "expires": None, "argsrepr": "()", "kwargsrepr": "{}"},
        )


def test_a_pickled_message_is_refused_and_never_unpickled(
    settings: Settings, store: Store, ledger: Ledger, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(Marker(probe)))  # the payload is live: unpickling runs it
    assert probe.is_dir()
    enqueue_paths(settings, [str(write_dataset(tmp_path, "sec", 1))])
    marker = tmp_path / "pwned"
    publish_pickle(settings, "sec", marker)
    assert ledger.state("sec").queued == 2  # the real message and the pickled one
    with caplog.at_level(logging.WARNING), running_worker(settings, concurrency=2):
        wait_settled(store, ["sec"])
        wait_for_empty(ledger.redis, queue_name("sec"))
    assert not marker.exists()
    assert "Refusing to deserialize untrusted content of type pickle" in caplog.text
    assert store.prompt_counts("sec") == {"done": 1}  # the JSON message went through


@pytest.mark.parametrize("sample_id", INJECTIONS)
def test_quotes_and_sql_in_ids_and_content_round_trip_intact(
    settings: Settings, store: Store, ledger: Ledger, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, sample_id: str,
) -> None:
    content = f"it's \"quoted\" \\ {sample_id} ; SELECT * FROM prompts; -- ünï ✓"
    line = {"id": sample_id, "messages": [{"role": "system", "content": "'); DELETE x; --"},
                                          {"role": "user", "content": content}]}
    (tmp_path / "inj.jsonl").write_text(json.dumps(line) + "\n")
    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    assert main(["enqueue", str(tmp_path / "inj.jsonl"), "-q"]) == 0
    with running_worker(settings, concurrency=2):
        wait_settled(store, ["inj"])
    with store.engine.connect() as conn:
        stored = conn.execute(sa.select(prompt_inputs.c.sample_id,
                                        prompt_inputs.c.messages)).one()
        kept = conn.scalars(sa.select(results.c.sample_id)).all()
    assert stored.sample_id == sample_id and stored.messages == line["messages"]
    assert kept == [sample_id]
    assert store.prompt_counts("inj") == {"done": 1}
    assert ledger.state("inj").used_tokens == store.used_tokens("inj", store.dataset("inj").budget)
    assert main(["export", "--format", "specforge", "--out", str(tmp_path / "out")]) == 0
    exported = json.loads((tmp_path / "out" / "inj.specforge.jsonl").read_text())
    assert exported["id"] == sample_id


def test_a_forged_json_message_with_hostile_names_is_dropped(
    settings: Settings, store: Store, redis_client: redis.Redis, sim: str, tmp_path: Path
) -> None:
    """Well-formed JSON naming a dataset and sample that do not exist: dropped before any
    Redis key, file or request is made from them."""
    enqueue_paths(settings, [str(write_dataset(tmp_path, "real", 1))])
    app = make_celery(settings)
    for dataset in ("../../etc", "a:b", "real"):
        app.send_task(GENERATE_TASK, kwargs={"dataset": dataset, "sample_id": INJECTIONS[0]},
                      queue=queue_name("real"))
    with running_worker(settings, concurrency=2):
        wait_settled(store, ["real"])
        wait_for_empty(redis_client, queue_name("real"))
    keys = {k.decode() for k in redis_client.scan_iter()}
    assert not any("etc" in k or "a:b" in k for k in keys), keys
    assert store.dataset_names() == ["real"] and store.prompt_counts("real") == {"done": 1}
    with store.engine.connect() as conn:
        assert conn.scalar(sa.select(sa.func.count()).select_from(results)) == 1


def wait_for_empty(client: redis.Redis, key: str) -> None:
    from tests.faultkit import wait_for

    wait_for(lambda: client.llen(key) == 0 and client.hlen("unacked") == 0, 20,
             f"{key} to drain")


BAD_NAMES = ["../x", "a/b", "a b", "a:b", "q\x06\x163", "", ".", "..", ".hidden", "x" * 101,
             "naïve", "*", "a\nb"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_keys_and_queue_names_refuse_unsafe_dataset_names(name: str) -> None:
    with pytest.raises(InputError, match="is not allowed"):
        dataset_keys(name)
    with pytest.raises(InputError, match="is not allowed"):
        queue_name(name)
    with pytest.raises(InputError, match="is not allowed"):
        validate_dataset_name(name)


@pytest.mark.parametrize("stem", ["..x", ".x", "..", "a b"])
def test_dot_and_space_stems_are_refused_before_any_path_is_used(
    tmp_path: Path, stem: str
) -> None:
    path = tmp_path / f"{stem}.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(InputError, match="is not allowed"):
        discover([tmp_path])
