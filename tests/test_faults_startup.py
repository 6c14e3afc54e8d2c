"""Services that do not answer, or answer wrongly, when a command starts: the database,
Redis, an SGLang server that is down, and servers that return no ``output_ids`` or
miscount them (SGLang before 0.5.5)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis

from common.ledger import Ledger
from common.settings import Settings
from common.store import Store
from ops.localredis import free_port
from tests.conftest import make_settings
from tests.faultkit import PrivateRedis, Sim, Workers, wait_for
from tests.helpers import enqueue_paths, running_worker, wait_settled, write_dataset
from tests.test_faults_input import cli

DEAD_DB = "postgresql://datagen:s3cret@127.0.0.1:1/datagen"


@pytest.fixture
def env(sqlite_url: str, sim: str, redis_client: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> Settings:
    settings = make_settings(sqlite_url, sim)
    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    return settings


@pytest.mark.parametrize("argv", [
    ["status"], ["purge", "x"], ["plan"],
    ["export", "--format", "parquet", "--out", "exports"],
])
def test_a_database_that_does_not_answer_exits_3_without_the_password(
    env: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DATAGEN_DATABASE_URL", DEAD_DB)
    assert cli(*argv) == 3
    err = capsys.readouterr().err
    assert "does not answer" in err and "DATAGEN_DATABASE_URL" in err and "s3cret" not in err


@pytest.mark.parametrize("argv", [["status"], ["purge", "x"]])
def test_a_redis_that_does_not_answer_exits_3(
    env: Settings, monkeypatch: pytest.MonkeyPatch, argv: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("DATAGEN_REDIS_URL", "redis://:s3cret@127.0.0.1:1/0")
    assert cli(*argv) == 3
    err = capsys.readouterr().err
    assert "Redis at redis://:***@127.0.0.1:1/0 does not answer" in err and "s3cret" not in err


def test_the_worker_exits_non_zero_when_the_database_does_not_answer(
    env: Settings, tmp_path: Path
) -> None:
    settings = env.replace(database_url=DEAD_DB, start_wait_s=2.0)
    with Workers(settings, tmp_path / "worker.log") as workers:
        proc = workers.start("nodb", 2)
        proc.wait(60)
    assert "DATAGEN_DATABASE_URL" in workers.text()
    assert proc.returncode != 0


def test_the_worker_waits_for_redis_then_works(sqlite_url: str, sim: str, tmp_path: Path) -> None:
    server = PrivateRedis()  # its port is known, nothing listens there yet
    settings = make_settings(sqlite_url, sim, redis_url=server.url)
    try:
        with Workers(settings, tmp_path / "worker.log") as workers:
            proc = workers.start("early", 4)
            wait_for(lambda: f"waiting for Redis at {server.url}" in workers.text(), 30,
                     "the worker to say Redis does not answer")
            assert proc.poll() is None  # waiting, not gone
            server.start()
            enqueue_paths(settings, [str(write_dataset(tmp_path, "late", 5))])
            wait_settled(Store(settings.database_url), ["late"], timeout_s=60)
    finally:
        server.close()
    assert Store(settings.database_url).prompt_counts("late") == {"done": 5}


def test_the_worker_says_sglang_does_not_answer_and_fails_nothing(
    sqlite_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    port = free_port()
    settings = make_settings(sqlite_url, f"http://127.0.0.1:{port}", retry_base_s=0.2,
                             retry_max_s=0.5, max_attempts=2)
    enqueue_paths(settings, [str(write_dataset(tmp_path, "nosrv", 4))])
    store = Store(settings.database_url)
    with Workers(settings, tmp_path / "worker.log") as workers:
        workers.start("nosrv", 4)
        needle = f"SGLang server not answering at start: http://127.0.0.1:{port}"
        wait_for(lambda: needle in workers.text(), 30, "the start-up warning")
        wait_for(lambda: all(row[2] for row in _prompt_rows(store)), 30,
                 "refused tries to be recorded")
        for state, attempts, error in _prompt_rows(store):
            assert (state, attempts) == ("queued", 0)  # waited for, no attempt used up
            assert error and f"http://127.0.0.1:{port}: connection refused" in error
        with Sim(tmp_path / "sim.jsonl", port=port, decode_tok_per_s=0) as _sim:
            wait_settled(store, ["nosrv"], timeout_s=60)
    assert store.prompt_counts("nosrv") == {"done": 4}


def test_a_worker_run_in_a_process_leaves_no_thread_of_its_own_behind(
    sqlite_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # A worker run inside another process (here, pytest) must leave no thread behind
    # that keeps logging "waiting for SGLang" into whatever that process does next.
    settings = make_settings(sqlite_url, f"http://127.0.0.1:{free_port()}")
    enqueue_paths(settings, [str(write_dataset(tmp_path, "gone", 1))])
    before = _ours()
    with running_worker(settings, concurrency=2):
        wait_for(lambda: {"datagen-sglang-wait", "datagen-queue-sync"} <= _names(_ours() - before),
                 30, "the SGLang watch and the queue sync to start")
    # Neither the watch nor the queue sync, which would pair a Redis that a later user of
    # it flushed with this worker's database.
    wait_for(lambda: not _ours() - before, 10,
             f"the worker's threads to end with it: {_names(_ours() - before)}")


def _ours() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("datagen-")}


def _names(threads: set[threading.Thread]) -> set[str]:
    return {t.name for t in threads}


def _prompt_rows(store: Store) -> list[tuple[str, int, str | None]]:
    with store.engine.connect() as conn:
        return [tuple(r) for r in conn.exec_driver_sql(  # type: ignore[misc]
            "SELECT state, attempts, error FROM prompts ORDER BY sample_id")]


class _Stub(BaseHTTPRequestHandler):
    body: ClassVar[dict[str, Any]] = {}
    generates: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self._send({} if self.path == "/model_info" else {"ok": True})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).generates.append(self.path)
        self._send(type(self).body)

    def _send(self, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def stub() -> Iterator[tuple[str, type[_Stub]]]:
    handler = type("Stub", (_Stub,), {"generates": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


META = {"prompt_tokens": 5, "completion_tokens": 2, "finish_reason": {"type": "stop"}}


@pytest.mark.parametrize(("body", "needle"), [
    ({"text": "hi", "meta_info": META}, "returned no output_ids; datagen needs SGLang >= 0.5.5"),
    ({"text": "hi", "output_ids": [1, 2, 3], "meta_info": META},
     "len(output_ids)=3 but completion_tokens=2"),
], ids=["no-output-ids", "count-mismatch"])
def test_an_old_sglang_fails_each_sample_once_with_its_reason(
    sqlite_url: str, redis_client: redis.Redis, tmp_path: Path,
    stub: tuple[str, type[_Stub]], body: dict[str, Any], needle: str,
) -> None:
    url, handler = stub
    handler.body = body
    settings = make_settings(sqlite_url, url, max_attempts=5)
    enqueue_paths(settings, [str(write_dataset(tmp_path, "old", 3))])
    store = Store(settings.database_url)
    with running_worker(settings, concurrency=3):
        wait_settled(store, ["old"], timeout_s=30)
    assert store.prompt_counts("old") == {"failed": 3}
    assert handler.generates == ["/generate"] * 3  # permanent: never retried
    for i in range(3):
        prompt = store.prompt("old", f"old-{i}")
        assert prompt is not None and prompt.attempts == 1
    with store.engine.connect() as conn:
        errors = list(conn.exec_driver_sql("SELECT error FROM prompts").scalars())
    assert all(needle in e for e in errors), errors
    state = Ledger(redis_client).state("old")
    assert (state.used_tokens, state.samples, state.reserved_tokens) == (0, 0, 0)
