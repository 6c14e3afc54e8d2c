"""A Redis holds the queues and ledgers of one results database: commands and workers
refuse a Redis paired with another database instead of merging its state into theirs,
a Redis that lost everything is paired again, and state from before pairing is kept."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import pytest
import redis
import sqlalchemy as sa

from common.budget import Budget
from common.errors import StoreMismatch
from common.keys import STORE_ID, dataset_keys
from common.ledger import Admission, AdmitArgs, Charge, ChargeArgs, Ledger
from common.pairing import pair, paired_elsewhere
from common.reconcile import reconcile_all
from common.settings import Settings
from common.store import Store
from tests.conftest import POSTGRES_URL, REDIS_URL, _fresh_postgres, make_settings
from tests.faultkit import Workers, wait_for
from tests.helpers import context_for, enqueue_paths, wait_settled, write_dataset
from tests.test_faults_input import cli
from workers.pipeline import run_sample

T = TypeVar("T")


def test_a_database_keeps_one_id_and_another_database_has_another(
    db_url: str, tmp_path: Path
) -> None:
    first = Store(db_url).store_id
    assert len(first) == 32 and Store(db_url).store_id == first  # read back, not made anew
    other = Store(f"sqlite:///{tmp_path / 'other.db'}").store_id
    assert other != first


def test_a_database_user_who_may_only_read_gets_the_id(tmp_path: Path) -> None:
    writer = Store(_fresh_postgres())
    ours = writer.store_id
    # Roles belong to the whole server: a name of its own beside other runs of the suite.
    role = f"datagen_reader_{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(POSTGRES_URL)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN")
        conn.exec_driver_sql(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
    reader = Store(sa.make_url(POSTGRES_URL).set(username=role)
                   .render_as_string(hide_password=False))
    try:
        assert reader.store_id == ours
    finally:
        reader.engine.dispose()
        with engine.begin() as conn:
            conn.exec_driver_sql(f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {role}")
            conn.exec_driver_sql(f"DROP ROLE {role}")
        engine.dispose()


def redis_cli_args(url: str) -> str:
    """The redis-cli arguments that reach the database of a redis:// URL."""
    parts = urlsplit(url)
    db = parts.path.lstrip("/") or "0"
    return f"-h {parts.hostname or 'localhost'} -p {parts.port or 6379} -n {db}"


def _queued(client: redis.Redis, name: str) -> int:
    return sum(int(client.llen(q)) for q in dataset_keys(name).queue_lists)


@pytest.fixture
def paired_run(sqlite_url: str, sim: str, redis_client: redis.Redis,
               tmp_path: Path) -> Settings:
    """A run of 6 prompts enqueued, not generated: Redis is paired with its database."""
    settings = make_settings(sqlite_url, sim)
    enqueue_paths(settings, [str(write_dataset(tmp_path, "alpha", 6))], budget=Budget(tokens=900))
    assert redis_client.get(STORE_ID) == Store(sqlite_url).store_id.encode()
    assert _queued(redis_client, "alpha") == 6
    return settings


@pytest.mark.parametrize("argv", [
    ["status"], ["purge", "alpha"], ["reopen", "alpha", "--budget-tokens", "5k"],
    ["enqueue", "PROMPTS", "-q"],
])
def test_a_command_on_another_database_is_refused_and_changes_nothing(
    paired_run: Settings, redis_client: redis.Redis, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str],
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    other_url = f"sqlite:///{other / 'datagen.db'}"
    for key, value in paired_run.replace(database_url=other_url).to_env().items():
        monkeypatch.setenv(key, value)
    # Same dataset name and sample ids as the paired run's: a merge would mix them up.
    prompts = str(write_dataset(other, "alpha", 6))
    before = Ledger(redis_client).state("alpha")
    assert cli(*[prompts if a == "PROMPTS" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert "holds the queues and ledgers of another results database" in err
    ours, theirs = Store(other_url).store_id, Store(paired_run.database_url).store_id
    assert f"(store {theirs[:12]}), not of {other_url} (store {ours[:12]})" in err
    assert f"redis-cli {redis_cli_args(REDIS_URL)} flushdb" in err
    assert Ledger(redis_client).state("alpha") == before and _queued(redis_client, "alpha") == 6
    assert redis_client.get(STORE_ID) == theirs.encode()
    assert Store(other_url).prompt_counts("alpha") == {}  # nothing stored on the refused side


def test_a_worker_on_another_database_exits_without_taking_a_message(
    paired_run: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    other_url = f"sqlite:///{tmp_path / 'other.db'}"
    with Workers(paired_run.replace(database_url=other_url), tmp_path / "worker.log") as workers:
        proc = workers.start("other", 4)
        proc.wait(60)
    assert proc.returncode != 0
    assert "holds the queues and ledgers of another results database" in workers.text()
    assert _queued(redis_client, "alpha") == 6 and not redis_client.hlen("unacked")
    assert Ledger(redis_client).state("alpha").used_tokens == 0


def test_a_redis_that_lost_everything_is_paired_again_and_rebuilt(
    paired_run: Settings, redis_client: redis.Redis
) -> None:
    store = Store(paired_run.database_url)
    redis_client.flushdb()  # a restart without persistence
    ledger = Ledger(redis_client)
    assert not paired_elsewhere(store, ledger)  # an empty Redis belongs to no one yet
    reconcile_all(store, ledger)
    assert ledger.paired_store() == store.store_id
    assert ledger.state("alpha").budget_tokens == 900


def test_a_ledger_written_before_pairing_is_adopted(
    sqlite_url: str, redis_client: redis.Redis
) -> None:
    # What an earlier datagen left: ledgers and no record of their database.
    ledger = Ledger(redis_client)
    ledger.configure("alpha", Budget(tokens=700))
    assert ledger.paired_store() is None
    store = Store(sqlite_url)
    pair(store, ledger)
    assert ledger.paired_store() == store.store_id
    assert ledger.state("alpha").budget_tokens == 700


def test_pairing_twice_with_the_same_database_is_quiet_and_another_is_refused(
    db_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    ledger, store = Ledger(redis_client), Store(db_url)
    pair(store, ledger)
    pair(Store(db_url), ledger)  # a second process on the same database
    other = Store(f"sqlite:///{tmp_path / 'other.db'}")
    assert paired_elsewhere(other, ledger) and not paired_elsewhere(store, ledger)
    with pytest.raises(StoreMismatch, match="another results database"):
        pair(other, ledger)
    assert ledger.paired_store() == store.store_id


def test_a_running_worker_pairs_a_flushed_redis_again_and_stops_if_another_took_it(
    paired_run: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = Store(paired_run.database_url)
    with Workers(paired_run, tmp_path / "worker.log") as workers:
        proc = workers.start("w", 4)
        wait_settled(store, ["alpha"], timeout_s=60)
        redis_client.flushdb()  # a restart without persistence, mid-run
        wait_for(lambda: Ledger(redis_client).paired_store() == store.store_id, 30,
                 "the worker's heartbeat to pair the empty Redis again")
        assert proc.poll() is None
        # Emptied again and, in the same transaction, taken by another database's run.
        other = Store(f"sqlite:///{tmp_path / 'other.db'}").store_id
        pipe = redis_client.pipeline(transaction=True)
        pipe.flushdb()
        pipe.set(STORE_ID, other)
        pipe.execute()
        proc.wait(60)
    assert "another results database" in workers.text() and "stopping this worker" in workers.text()
    assert redis_client.get(STORE_ID) == other.encode()
    assert not redis_client.exists(dataset_keys("alpha").ledger)  # nothing of ours written


def _paired_alpha(sqlite_url: str, redis_client: redis.Redis) -> tuple[Store, Ledger]:
    """A store paired with the Redis, and its dataset "alpha" of 1,000 tokens there."""
    store, ledger = Store(sqlite_url), Ledger(redis_client)
    pair(store, ledger)
    ledger.configure("alpha", Budget(tokens=1000))
    return store, ledger


def test_admission_refuses_a_redis_paired_with_another_database_and_reserves_nothing(
    sqlite_url: str, redis_client: redis.Redis
) -> None:
    store, ledger = _paired_alpha(sqlite_url, redis_client)
    assert ledger.admit_many([AdmitArgs("alpha", "r1", 100, 50)], store.store_id) == [
        Admission.ADMITTED]
    assert ledger.admit_many([], store.store_id) == []  # the check alone
    redis_client.set(STORE_ID, "0" * 32)  # emptied and taken by another run meanwhile
    before = ledger.state("alpha")
    for asks in ([AdmitArgs("alpha", "r2", 100, 50)], []):
        with pytest.raises(StoreMismatch, match=r"another results database \(store 000000000000\)"):
            ledger.admit_many(asks, store.store_id)
    assert ledger.state("alpha") == before and ledger.inflight_rids("alpha") == ["r1"]
    # Without a store id nothing is checked (the caller paired just before); a Redis paired
    # with no database runs the calls, and an emptied ledger then asks to be rebuilt.
    assert ledger.admit("alpha", "r3", 100, 50) is Admission.ADMITTED
    redis_client.flushdb()
    assert ledger.admit("alpha", "r4", 100, 50, store.store_id) is Admission.UNKNOWN


def test_a_charge_refuses_a_redis_paired_with_another_database_and_charges_nothing(
    sqlite_url: str, redis_client: redis.Redis
) -> None:
    store, ledger = _paired_alpha(sqlite_url, redis_client)
    for rid in ("r1", "r2"):
        assert ledger.admit("alpha", rid, 100, 50, store.store_id) is Admission.ADMITTED
    assert ledger.charge("alpha", "s1", "r1", 10, 20, store.store_id).status is Charge.CHARGED
    redis_client.set(STORE_ID, "0" * 32)  # emptied and taken by another run meanwhile
    before = ledger.state("alpha")
    with pytest.raises(StoreMismatch) as refused:
        ledger.charge_many([ChargeArgs("alpha", "s2", "r2", 10, 20)], store.store_id)
    assert ledger.state("alpha") == before and ledger.inflight_rids("alpha") == ["r2"]
    # It says which Redis, whose it is now, and what to do.
    where, _ = ledger.where()
    assert f"Redis at {where} was paired with another results database (store 000000000000)" \
        in str(refused.value)
    assert "DATAGEN_REDIS_URL" in str(refused.value)
    assert ledger.charge_many([], store.store_id) == []


def test_a_recharge_refuses_a_redis_paired_with_another_database_and_changes_nothing(
    sqlite_url: str, redis_client: redis.Redis
) -> None:
    store, ledger = _paired_alpha(sqlite_url, redis_client)
    assert ledger.admit("alpha", "r1", 100, 50, store.store_id) is Admission.ADMITTED
    ledger.charge("alpha", "s1", "r1", 10, 20, store.store_id)
    assert ledger.recharge("alpha", "s1", 25, store.store_id) == 25
    redis_client.set(STORE_ID, "0" * 32)  # emptied and taken by another run meanwhile
    before = ledger.state("alpha")
    with pytest.raises(StoreMismatch, match=r"another results database \(store 000000000000\)"):
        ledger.recharge("alpha", "s1", 40, store.store_id)
    assert ledger.state("alpha") == before


def _taken_after(call: Callable[..., T], client: redis.Redis) -> Callable[..., T]:
    """``call``, after which the Redis is emptied and taken by another run (its pairing)."""
    def taken_meanwhile(*args: object, **kwargs: object) -> T:
        out = call(*args, **kwargs)
        client.set(STORE_ID, "0" * 32)
        return out
    return taken_meanwhile


def test_a_request_sent_before_another_run_took_the_redis_is_not_charged_there(
    settings: Settings, redis_client: redis.Redis, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Redis changes hands while the sample's request is at the server: its tokens go
    into no ledger, and the sample stays queued in this run's database for a later run."""
    ctx = context_for(settings, tmp_path, "alpha", 1)
    monkeypatch.setattr(ctx.client, "generate", _taken_after(ctx.client.generate, redis_client))
    with pytest.raises(StoreMismatch):
        run_sample(ctx, "alpha", ctx.store.sample_ids("alpha", "queued")[0])
    state = ctx.ledger.state("alpha")
    assert (state.used_tokens, state.samples, state.inflight) == (0, 0, 0)
    assert ctx.store.prompt_counts("alpha") == {"queued": 1}


def test_a_sample_charged_before_its_store_was_lost_is_priced_by_what_is_kept(
    settings: Settings, tmp_path: Path
) -> None:
    """A worker charged the sample, then died before its result was stored: the next
    attempt finds the charge made, stores its own result and prices the sample by it."""
    ctx = context_for(settings, tmp_path, "alpha", 1)
    sample_id = ctx.store.sample_ids("alpha", "queued")[0]
    ctx.ledger.charge("alpha", sample_id, "lost-rid", 0, 9_999, ctx.store.store_id)
    assert run_sample(ctx, "alpha", sample_id).value == "done"
    budget = ctx.store.dataset("alpha").budget
    state = ctx.ledger.state("alpha")
    assert 0 < state.used_tokens == ctx.store.used_tokens("alpha", budget) != 9_999
    assert (state.samples, state.inflight) == (1, 0)


def test_a_sample_is_not_priced_again_in_a_redis_another_run_took_meanwhile(
    settings: Settings, redis_client: redis.Redis, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, but the Redis changes hands between the charge and the pricing: that
    run's ledger, which may hold a sample of the same name, is left as it is."""
    ctx = context_for(settings, tmp_path, "alpha", 1)
    sample_id = ctx.store.sample_ids("alpha", "queued")[0]
    ctx.ledger.charge("alpha", sample_id, "lost-rid", 0, 9_999, ctx.store.store_id)
    monkeypatch.setattr(ctx.ledger, "charge_many",
                        _taken_after(ctx.ledger.charge_many, redis_client))
    with pytest.raises(StoreMismatch):
        run_sample(ctx, "alpha", sample_id)
    assert ctx.ledger.state("alpha").used_tokens == 9_999


def test_a_worker_whose_redis_another_run_took_puts_its_messages_back_and_stops(
    paired_run: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Between two heartbeats (made rare here), the Redis is emptied and another database's
    run enqueues a dataset of the same name and sample ids: the worker drops none of its
    messages and counts none of its own results in that run's ledger."""
    store = Store(paired_run.database_url)
    with Workers(paired_run.replace(heartbeat_s=3600.0), tmp_path / "worker.log") as workers:
        proc = workers.start("w", 4)
        wait_settled(store, ["alpha"], timeout_s=60)
        done = store.prompt_counts("alpha")
        redis_client.flushdb()
        other = tmp_path / "other"
        other.mkdir()
        theirs = paired_run.replace(database_url=f"sqlite:///{other / 'datagen.db'}")
        enqueue_paths(theirs, [str(write_dataset(other, "alpha", 6))], budget=Budget(tokens=900))
        proc.wait(60)
    # Found by the admissions (the heartbeat's check says "holds the queues and ledgers").
    assert "was paired with another results database" in workers.text()
    assert "stopping this worker" in workers.text()
    assert redis_client.get(STORE_ID) == Store(theirs.database_url).store_id.encode()
    # Every message back in the queue, nothing in flight or charged in their ledger.
    assert _queued(redis_client, "alpha") == 6 and not redis_client.hlen("unacked")
    state = Ledger(redis_client).state("alpha")
    assert (state.used_tokens, state.samples, state.inflight, state.reserved_tokens) == (0, 0, 0, 0)
    assert store.prompt_counts("alpha") == done
