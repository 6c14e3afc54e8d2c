"""Typed access to the Redis ledger: the only caller of the scripts in ledger_scripts."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import redis
from redis.commands.core import Script

from common import ledger_scripts as lua
from common.budget import Budget
from common.errors import StoreMismatch
from common.keys import DATASETS, KOMBU_PRIORITY_STEPS, STORE_ID, dataset_keys
from common.replies import text, texts


class Charge(IntEnum):
    REFUSED = 0
    CHARGED = 1
    DUPLICATE = 2


class Admission(IntEnum):
    CLOSED = 0
    ADMITTED = 1
    WAIT = 2
    UNKNOWN = 3


@dataclass(frozen=True)
class ChargeResult:
    status: Charge
    kept_completion_tokens: int
    used_tokens: int
    crossed: bool
    purged: int


@dataclass(frozen=True)
class CloseResult:
    closed_now: bool
    purged: int


@dataclass(frozen=True)
class LedgerState:
    name: str
    used_tokens: int
    samples: int
    budget_tokens: int
    basis: str
    policy: str
    state: str
    reserved_tokens: int
    inflight: int
    queued: int
    closed_at: float | None
    close_reason: str | None
    used_at_close: int | None


@dataclass(frozen=True)
class AdmitArgs:
    name: str
    rid: str
    max_new_tokens: int
    default_expected: int


@dataclass(frozen=True)
class ChargeArgs:
    name: str
    sample_id: str
    rid: str
    prompt_tokens: int
    completion_tokens: int
    kept: bool = True  # the sample as generated is kept (common.kept)


def _charge_result(reply: Any) -> ChargeResult:
    status, kept, used, crossed, purged = reply
    return ChargeResult(Charge(int(status)), int(kept), int(used), bool(crossed), int(purged))


class Ledger:
    """Per-dataset counters, limits and states in Redis, changed only by Lua."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._recharge = client.register_script(lua.RECHARGE_IF_PAIRED)
        self._admit_many = client.register_script(lua.ADMIT_MANY)
        self._charge_many = client.register_script(lua.CHARGE_MANY)
        self._release = client.register_script(lua.RELEASE)
        self._configure = client.register_script(lua.CONFIGURE)
        self._close = client.register_script(lua.CLOSE)
        self._reopen = client.register_script(lua.REOPEN)
        self._absorb = client.register_script(lua.ABSORB)

    def configure(self, name: str, budget: Budget) -> CloseResult:
        self.redis.sadd(DATASETS, name)
        args: list[str | int | float] = [budget.tokens, budget.basis, budget.policy,
                                         budget.prompt_weight, budget.kept_only, time.time()]
        closed_now, purged, _used = self._configure(keys=dataset_keys(name).script_keys, args=args)
        return CloseResult(bool(closed_now), int(purged))

    def admit(self, name: str, rid: str, max_new_tokens: int, default_expected: int,
              store_id: str = "") -> Admission:
        # A batch of one: the batched script is the only copy of ADMIT that Redis runs.
        return self.admit_many([AdmitArgs(name, rid, max_new_tokens, default_expected)],
                               store_id)[0]

    def admit_many(self, asks: Sequence[AdmitArgs], store_id: str = "") -> list[Admission]:
        """``admit`` for each, in order, in one command (each call decided as if alone).

        With ``store_id``, only while this Redis is paired with that results database (or
        with none): otherwise nothing is admitted and StoreMismatch is raised, for no asks
        too (the check alone)."""
        if not asks and not store_id:
            return []
        replies = self._paired_batch(self._admit_many,
                                     [(a.name, (a.rid, a.max_new_tokens, a.default_expected))
                                      for a in asks], store_id)
        return [Admission(int(status)) for status, _ in replies]

    def release(self, name: str, rid: str) -> None:
        self._release(keys=dataset_keys(name).script_keys, args=[rid])

    def charge(
        self, name: str, sample_id: str, rid: str, prompt_tokens: int, completion_tokens: int,
        store_id: str = "", kept: bool = True,
    ) -> ChargeResult:
        return self.charge_many(
            [ChargeArgs(name, sample_id, rid, prompt_tokens, completion_tokens, kept)],
            store_id)[0]

    def charge_many(self, charges: Sequence[ChargeArgs], store_id: str = "") -> list[ChargeResult]:
        """``charge`` for each, in order, in one command: the batch decides exactly what
        the same charges one by one would. With ``store_id``, as ``admit_many``: nothing
        is charged in a Redis paired with another database (a request sent before another
        run took it would otherwise count in that run's budget)."""
        if not charges:
            return []
        now = time.time()
        replies = self._paired_batch(self._charge_many, [
            (c.name, (c.sample_id, c.rid, c.prompt_tokens, c.completion_tokens, int(c.kept),
                      now))
            for c in charges], store_id)
        return [_charge_result(reply) for reply in replies]

    def where(self) -> tuple[str, str]:
        """This Redis as host:port/db, and the redis-cli arguments that reach its database."""
        kw = self.redis.connection_pool.connection_kwargs
        db = kw.get("db", 0)
        if kw.get("path"):
            return f"{kw['path']}/{db}", f"-s {kw['path']} -n {db}"
        host, port = kw.get("host", "localhost"), kw.get("port", 6379)
        return f"{host}:{port}/{db}", f"-h {host} -p {port} -n {db}"

    def _paired_batch(self, script: Script, calls: Sequence[tuple[str, Sequence[Any]]],
                      store_id: str) -> list[Any]:
        """A batch of a script built with ``batched_if_paired``; StoreMismatch when this
        Redis is paired with another database than ``store_id`` (then nothing ran)."""
        replies = self._batch(script, calls, tail=((STORE_ID, store_id),))
        if not (replies and not isinstance(replies[0], list)
                and text(replies[0]) == lua.PAIRED_ELSEWHERE):
            return replies
        where, _ = self.where()
        raise StoreMismatch(
            f"Redis at {where} was paired with another results database (store "
            f"{text(replies[1])[:12]}) while this process used it for store {store_id[:12]}: "
            "another run emptied it and took it. Nothing was admitted or charged there. "
            "Point this run's DATAGEN_REDIS_URL at a Redis database of its own (another /N) "
            "and start it again: its ledgers are rebuilt from SQL, and its queued prompts are "
            "enqueued again by `datagen enqueue` at once or by the workers' sweep within "
            "minutes.")

    @staticmethod
    def _batch(script: Script, calls: Sequence[tuple[str, Sequence[Any]]],
               tail: Sequence[tuple[str, Any]] = ()) -> list[Any]:
        """Run a batched script (ledger_scripts.batched) over (dataset, arguments) calls;
        ``tail``: (key, argument) pairs appended after the calls' (a guard's)."""
        if not calls and not tail:
            return []
        keys: list[str] = []
        position: dict[str, int] = {}
        args: list[Any] = [len(calls[0][1]) if calls else 0]
        for name, call_args in calls:
            if name not in position:
                position[name] = len(position) + 1
                keys += dataset_keys(name).script_keys
            args += [position[name], *call_args]
        for key, arg in tail:
            keys.append(key)
            args.append(arg)
        return list(script(keys=keys, args=args))

    def recharge(self, name: str, sample_id: str, cost: int, store_id: str = "") -> int:
        """Price a charged sample anew; returns the dataset's tokens used. With
        ``store_id``, as ``charge_many``: a Redis paired with another database is left
        alone (that run may have a sample of the same name)."""
        [used] = self._paired_batch(self._recharge, [(name, (sample_id, cost))], store_id)
        return int(used)

    def close(self, name: str, reason: str) -> CloseResult:
        closed_now, purged = self._close(keys=dataset_keys(name).script_keys,
                                         args=[time.time(), reason])
        return CloseResult(bool(closed_now), int(purged))

    def reopen(self, name: str, budget_tokens: int) -> None:
        self._reopen(keys=dataset_keys(name).script_keys, args=[budget_tokens])

    def absorb(self, name: str, costs: Iterable[tuple[str, int]], chunk: int = 2000) -> int:
        """Charge stored results the ledger lacks (reconcile from SQL); returns tokens added."""
        keys, added = dataset_keys(name).script_keys, 0
        batch: list[str | int] = []
        for sample_id, cost in costs:
            batch += [sample_id, cost]
            if len(batch) >= 2 * chunk:
                added += int(self._absorb(keys=keys, args=batch))
                batch = []
        if batch:
            added += int(self._absorb(keys=keys, args=batch))
        return added

    def is_closed(self, name: str) -> bool:
        return text(self.redis.hget(dataset_keys(name).ledger, "state")) == "closed"

    def pair(self, store_id: str) -> str:
        """Record ``store_id`` as this Redis's database unless one is recorded already;
        returns the one recorded now."""
        # Read first: once paired (every call but the first) that is the only command.
        theirs = self.paired_store()
        if theirs is not None:
            return theirs
        if self.redis.set(STORE_ID, store_id, nx=True):
            return store_id
        # Another process paired it between the two commands; nothing changes the key
        # after that (a flush removes it, and the next command pairs again).
        return self.paired_store() or store_id

    def paired_store(self) -> str | None:
        value = self.redis.get(STORE_ID)
        return None if value is None else text(value)

    def known(self) -> list[str]:
        return sorted(texts(self.redis.smembers(DATASETS)))

    def inflight_rids(self, name: str) -> list[str]:
        return texts(self.redis.hkeys(dataset_keys(name).inflight))

    def mark_started(self, marks: Sequence[tuple[str, str]]) -> None:
        """The servers have started these requests, (dataset, rid) each (their first token
        came): a drain close lets them run (common/closing.py). One round trip."""
        by_dataset: dict[str, list[str]] = {}
        for name, rid in marks:
            by_dataset.setdefault(name, []).append(rid)
        pipe = self.redis.pipeline(transaction=False)
        for name, rids in by_dataset.items():
            pipe.sadd(dataset_keys(name).started, *rids)
        pipe.execute()

    def queued_rids(self, name: str) -> list[str]:
        """Requests in flight the server has not started: admitted, sent or about to be,
        no token yet (read at a drain close; a request may start just after)."""
        ds = dataset_keys(name)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hkeys(ds.inflight)
        pipe.smembers(ds.started)
        inflight, started = pipe.execute()
        running = set(texts(started))
        return [rid for rid in texts(inflight) if rid not in running]

    def state(self, name: str) -> LedgerState:
        return self.states([name])[0]

    def states(self, names: Sequence[str]) -> list[LedgerState]:
        """Each dataset's ledger, queue length and requests in flight, in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            ds = dataset_keys(name)
            pipe.hgetall(ds.ledger)
            pipe.hlen(ds.inflight)
            for q in ds.queue_lists:
                pipe.llen(q)
        replies = pipe.execute() if names else []
        step = 2 + len(KOMBU_PRIORITY_STEPS)  # the hash, the inflight count, the lists
        return [_ledger_state(name, replies[i * step], replies[i * step + 1],
                              replies[i * step + 2:(i + 1) * step])
                for i, name in enumerate(names)]


def _ledger_state(name: str, raw: dict[Any, Any], inflight: int, lens: list[int]) -> LedgerState:
    h = {text(k): text(v) for k, v in raw.items()}
    return LedgerState(
        name=name,
        used_tokens=int(h.get("used", 0)),
        samples=int(h.get("samples", 0)),
        budget_tokens=int(h.get("budget", 0)),
        basis=h.get("basis", "output"),
        policy=h.get("policy", "drain"),
        state=h.get("state", "open"),
        reserved_tokens=int(h.get("reserved", 0)),
        inflight=int(inflight),
        queued=sum(int(n) for n in lens),
        closed_at=float(h["closed_at"]) if "closed_at" in h else None,
        close_reason=h.get("close_reason"),
        used_at_close=int(h["used_at_close"]) if "used_at_close" in h else None,
    )
