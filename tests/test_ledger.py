"""The Redis ledger's Lua scripts on the real Redis: idempotent charges, one close."""

from __future__ import annotations

import threading

import pytest
import redis

from common import ledger_scripts as lua
from common.budget import BASES, Basis, Budget, Policy
from common.keys import dataset_keys
from common.ledger import Admission, AdmitArgs, Charge, ChargeArgs, ChargeResult, Ledger
from tests.faultkit import PrivateRedis


def test_charge_is_idempotent_per_sample(ledger: Ledger) -> None:
    ledger.configure("ds", Budget(1000))
    first = ledger.charge("ds", "s1", "r1", 10, 100)
    again = ledger.charge("ds", "s1", "r2", 10, 100)
    assert (first.status, again.status) == (Charge.CHARGED, Charge.DUPLICATE)
    assert ledger.state("ds").used_tokens == 100
    assert ledger.state("ds").samples == 1


def test_total_basis_counts_prompt_tokens(ledger: Ledger) -> None:
    ledger.configure("ds", Budget(1000, basis="total"))
    ledger.charge("ds", "s1", "r1", 30, 100)
    assert ledger.state("ds").used_tokens == 130


@pytest.mark.parametrize("basis", BASES)
def test_the_charge_script_costs_a_sample_as_the_budget_defines(
    ledger: Ledger, redis_client: redis.Redis, basis: Basis) -> None:
    # The basis is defined once, in common/budget.py; CHARGE gets it as prompt_weight and
    # kept_only.
    budget = Budget(10_000, basis=basis)
    ledger.configure("ds", budget)
    samples = [(30, 100, True), (0, 7, False), (512, 0, True), (1, 1, True), (40, 60, False)]
    for i, (prompt, completion, kept) in enumerate(samples):
        ledger.charge("ds", f"s{i}", f"r{i}", prompt, completion, kept=kept)
        charged = redis_client.hget(dataset_keys("ds").charged, f"s{i}")
        assert int(charged) == budget.cost(prompt, completion, kept)
    assert ledger.state("ds").samples == len(samples)


def test_kept_basis_charges_a_sample_not_kept_nothing_and_once(ledger: Ledger) -> None:
    ledger.configure("ds", Budget(150, basis="kept"))
    cut = ledger.charge("ds", "s1", "r1", 10, 400, kept=False)
    assert (cut.status, cut.kept_completion_tokens, cut.crossed) == (Charge.CHARGED, 400, False)
    assert ledger.charge("ds", "s1", "r2", 10, 400, kept=True).status is Charge.DUPLICATE
    assert ledger.state("ds").used_tokens == 0
    crossing = ledger.charge("ds", "s2", "r3", 10, 150, kept=True)
    assert crossing.crossed and ledger.state("ds").used_tokens == 150


def test_kept_basis_exact_cut_is_not_charged_and_closes(ledger: Ledger) -> None:
    # A kept sample that no longer fits is cut, which leaves it no answer: charged nothing,
    # and the dataset closes, so used never passes the budget.
    ledger.configure("ds", Budget(150, basis="kept", policy="exact"))
    ledger.charge("ds", "s1", "r1", 0, 100, kept=True)
    long_cut_anyway = ledger.charge("ds", "s2", "r2", 0, 900, kept=False)
    assert (long_cut_anyway.kept_completion_tokens, long_cut_anyway.crossed) == (900, False)
    crossing = ledger.charge("ds", "s3", "r3", 0, 80, kept=True)
    assert (crossing.status, crossing.kept_completion_tokens, crossing.crossed) == (
        Charge.CHARGED, 50, True)
    state = ledger.state("ds")
    assert (state.state, state.used_tokens, state.samples) == ("closed", 100, 3)
    assert ledger.charge("ds", "s4", "r4", 0, 10, kept=True).status is Charge.REFUSED


def test_crossing_closes_and_purges_every_priority_list(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    ledger.configure("ds", Budget(150))
    keys = dataset_keys("ds")
    for q in keys.queue_lists:
        redis_client.rpush(q, "m1", "m2")
    assert not ledger.charge("ds", "s1", "r1", 0, 100).crossed
    crossing = ledger.charge("ds", "s2", "r2", 0, 100)
    assert crossing.crossed and crossing.purged == 8
    assert all(redis_client.llen(q) == 0 for q in keys.queue_lists)
    state = ledger.state("ds")
    assert (state.state, state.close_reason, state.used_at_close) == ("closed", "budget", 200)


def test_crossing_raced_by_many_workers_closes_once(ledger: Ledger) -> None:
    ledger.configure("ds", Budget(5_000))
    barrier = threading.Barrier(32)
    crossings: list[bool] = []

    def charge(i: int) -> None:
        client = Ledger(redis.Redis(connection_pool=ledger.redis.connection_pool))
        barrier.wait()
        for j in range(10):
            crossings.append(client.charge("ds", f"s{i}-{j}", f"r{i}-{j}", 0, 50).crossed)

    threads = [threading.Thread(target=charge, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert crossings.count(True) == 1
    assert ledger.state("ds").used_tokens == 320 * 50  # drain: in-flight charges still count


def test_exact_policy_cuts_the_crossing_sample_and_refuses_the_rest(ledger: Ledger) -> None:
    ledger.configure("ds", Budget(250, policy="exact"))
    ledger.charge("ds", "s1", "r1", 0, 200)
    cut = ledger.charge("ds", "s2", "r2", 0, 200)
    assert (cut.status, cut.kept_completion_tokens, cut.crossed) == (Charge.CHARGED, 50, True)
    assert ledger.charge("ds", "s3", "r3", 0, 10).status is Charge.REFUSED
    assert ledger.state("ds").used_tokens == 250


def test_abort_policy_refuses_charges_after_the_close(ledger: Ledger) -> None:
    ledger.configure("ds", Budget(100, policy="abort"))
    assert ledger.charge("ds", "s1", "r1", 0, 150).crossed
    assert ledger.charge("ds", "s2", "r2", 0, 150).status is Charge.REFUSED
    assert ledger.state("ds").used_tokens == 150


def test_admission_waits_when_in_flight_work_fills_the_budget(ledger: Ledger) -> None:
    ledger.configure("ds", Budget(1000))
    assert ledger.admit("ds", "r1", 400, 400) is Admission.ADMITTED
    assert ledger.admit("ds", "r2", 400, 400) is Admission.ADMITTED
    assert ledger.admit("ds", "r3", 400, 400) is Admission.WAIT
    ledger.release("ds", "r2")  # a request that ended without a result frees its room
    assert ledger.admit("ds", "r3", 400, 400) is Admission.ADMITTED
    ledger.charge("ds", "s1", "r1", 0, 100)  # finished short: room for more
    assert ledger.state("ds").reserved_tokens == 400
    assert ledger.admit("ds", "r4", 400, 400) is Admission.ADMITTED


def test_an_admission_asked_again_for_its_rid_reserves_once(ledger: Ledger) -> None:
    """The same ADMIT sent twice (a client's retry after a lost answer) holds one
    reservation, which one release frees."""
    ledger.configure("ds", Budget(1000))
    assert ledger.admit("ds", "r1", 400, 400) is Admission.ADMITTED
    assert ledger.admit("ds", "r1", 400, 400) is Admission.ADMITTED
    assert (ledger.state("ds").inflight, ledger.state("ds").reserved_tokens) == (1, 400)
    ledger.release("ds", "r1")
    assert (ledger.state("ds").inflight, ledger.state("ds").reserved_tokens) == (0, 0)


def test_admission_is_refused_once_closed_and_unknown_without_terms(ledger: Ledger) -> None:
    assert ledger.admit("nothing", "r1", 10, 10) is Admission.UNKNOWN
    ledger.configure("ds", Budget(1000))
    ledger.close("ds", "manual")
    assert ledger.admit("ds", "r1", 10, 10) is Admission.CLOSED


def test_a_ledger_without_the_prompt_weight_term_is_unknown_until_configured(
    ledger: Ledger, redis_client: redis.Redis) -> None:
    # A ledger hash written before prompt_weight was one of its terms cannot be charged
    # right on a "total" basis: admission sends the worker to rebuild the terms from SQL.
    ledger.configure("ds", Budget(1000, basis="total"))
    redis_client.hdel(dataset_keys("ds").ledger, "prompt_weight")
    assert ledger.admit("ds", "r1", 10, 10) is Admission.UNKNOWN
    ledger.configure("ds", Budget(1000, basis="total"))
    assert ledger.admit("ds", "r1", 10, 10) is Admission.ADMITTED
    ledger.charge("ds", "s1", "r1", 30, 100)
    assert ledger.state("ds").used_tokens == 130


def test_configure_below_used_closes_at_once(ledger: Ledger) -> None:
    ledger.configure("ds", Budget(1000))
    ledger.charge("ds", "s1", "r1", 0, 600)
    assert not ledger.configure("ds", Budget(700)).closed_now
    assert ledger.configure("ds", Budget(500)).closed_now
    assert ledger.is_closed("ds")


def test_absorb_adds_only_what_the_ledger_lacks(ledger: Ledger) -> None:
    ledger.configure("ds", Budget(10_000))
    ledger.charge("ds", "s1", "r1", 0, 100)
    added = ledger.absorb("ds", [("s1", 100), ("s2", 200), ("s3", 300)])
    assert added == 500
    assert ledger.state("ds").used_tokens == 600
    assert ledger.absorb("ds", [("s2", 200)]) == 0


def test_recharge_reprices_a_sample(ledger: Ledger) -> None:
    ledger.configure("ds", Budget(10_000))
    ledger.charge("ds", "s1", "r1", 0, 100)
    assert ledger.recharge("ds", "s1", 130) == 130


def test_admission_reserves_mean_plus_one_standard_deviation(ledger: Ledger) -> None:
    ledger.configure("ds", Budget(100_000))
    ledger.charge("ds", "s1", "r1", 0, 100)
    ledger.charge("ds", "s2", "r2", 0, 300)  # mean 200, standard deviation 100
    assert ledger.admit("ds", "r3", 10_000, 50) is Admission.ADMITTED
    assert ledger.state("ds").reserved_tokens == 300
    ledger.absorb("ds", [("s4", 200)])  # reconciled samples count in the spread too
    ledger.release("ds", "r3")
    ledger.admit("ds", "r5", 10_000, 50)
    assert ledger.state("ds").reserved_tokens == 281  # mean 200, sd sqrt(6666.7) = 81.6


Replay = tuple[list[Admission], list[ChargeResult], tuple[object, ...]]


def _replay(ledger: Ledger, name: str, policy: Policy, batched: bool,
            redis_client: redis.Redis) -> Replay:
    """One sequence of admissions and charges (duplicates, a crossing, refusals after it),
    made one by one or in batches; returns what the ledger answered and its end state."""
    ledger.configure(name, Budget(1_000, policy=policy))
    for q in dataset_keys(name).queue_lists:
        redis_client.rpush(q, "queued-1", "queued-2")
    asks = [AdmitArgs(name, f"r{i}", 400, 300) for i in range(6)]
    charges = [ChargeArgs(name, f"s{i % 5}", f"r{i}", 20, 130 * (i % 4 + 1)) for i in range(9)]
    if batched:
        admitted = list(ledger.admit_many(asks[:3])) + list(ledger.admit_many(asks[3:]))
        charged = list(ledger.charge_many(charges[:4])) + list(ledger.charge_many(charges[4:]))
    else:
        admitted = [ledger.admit(a.name, a.rid, a.max_new_tokens, a.default_expected)
                    for a in asks]
        charged = [ledger.charge(c.name, c.sample_id, c.rid, c.prompt_tokens,
                                 c.completion_tokens) for c in charges]
    state = ledger.state(name)
    end = (state.used_tokens, state.samples, state.state, state.reserved_tokens,
           state.inflight, state.queued, state.used_at_close)
    return admitted, charged, end


def test_batched_calls_answer_exactly_as_single_calls(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    policies: tuple[Policy, ...] = ("drain", "abort", "exact")
    for policy in policies:
        single = _replay(ledger, f"one-{policy}", policy, False, redis_client)
        batched = _replay(ledger, f"many-{policy}", policy, True, redis_client)
        assert batched == single
        admitted, charged, end = batched
        assert Admission.WAIT in admitted and Admission.ADMITTED in admitted
        assert [c.crossed for c in charged].count(True) == 1
        assert Charge.DUPLICATE in [c.status for c in charged]
        assert end[2] == "closed"


def test_a_batch_across_datasets_answers_as_single_calls(ledger: Ledger) -> None:
    """One batch may hold several datasets' calls, interleaved: each goes to its own keys."""
    def run(prefix: str, batched: bool) -> tuple[object, ...]:
        a, b = f"{prefix}-a", f"{prefix}-b"
        ledger.configure(a, Budget(500, policy="exact"))
        ledger.configure(b, Budget(10_000))
        asks = [AdmitArgs(name, f"{name}-r{i}", 300, 200) for i in range(3) for name in (a, b)]
        charges = [ChargeArgs(name, f"s{i}", f"{name}-r{i}", 10, 240)
                   for i in range(3) for name in (a, b)]
        if batched:
            admitted, charged = ledger.admit_many(asks), ledger.charge_many(charges)
        else:
            admitted = [ledger.admit(x.name, x.rid, x.max_new_tokens, x.default_expected)
                        for x in asks]
            charged = [ledger.charge(c.name, c.sample_id, c.rid, c.prompt_tokens,
                                     c.completion_tokens) for c in charges]
        ends = tuple((s.used_tokens, s.samples, s.state, s.reserved_tokens, s.inflight)
                     for s in (ledger.state(a), ledger.state(b)))
        return admitted, charged, ends

    single, batched = run("one", False), run("many", True)
    assert batched == single
    _, charged, ends = batched
    assert ends[0][:3] == (500, 3, "closed") and ends[1][:3] == (720, 3, "open")
    assert [c.kept_completion_tokens for c in charged] == [240, 240, 240, 240, 20, 240]


def test_a_batch_knows_how_many_keys_a_dataset_has() -> None:
    assert len(dataset_keys("ds").script_keys) == lua.KEYS_PER_DATASET


def test_batched_calls_load_scripts_redis_lost() -> None:
    # A server of its own: SCRIPT FLUSH empties the script cache of every database.
    with PrivateRedis() as server:
        client = server.client()
        ledger = Ledger(client)
        ledger.configure("ds", Budget(1_000))
        client.script_flush()
        assert ledger.admit_many([AdmitArgs("ds", "r1", 100, 100)]) == [Admission.ADMITTED]
        client.script_flush()
        charged = ledger.charge_many([ChargeArgs("ds", "s1", "r1", 0, 10),
                                      ChargeArgs("ds", "s1", "r2", 0, 10)])
        assert [c.status for c in charged] == [Charge.CHARGED, Charge.DUPLICATE]
        assert ledger.state("ds").used_tokens == 10
        assert ledger.admit_many([]) == [] and ledger.charge_many([]) == []
        client.close()


@pytest.mark.parametrize("end", ["charge", "release", "charge_many"])
def test_a_started_mark_ends_with_its_requests_inflight_entry(
    ledger: Ledger, redis_client: redis.Redis, end: str) -> None:
    # A drain close aborts the rids in flight that are not marked started: a mark left
    # behind would grow the set for the whole run; one dropped early would abort a running
    # request. It goes in the same step as the inflight entry, and only then.
    ledger.configure("ds", Budget(10_000))
    keys = dataset_keys("ds")
    for rid in ("r1", "r2"):
        assert ledger.admit("ds", rid, 100, 50) is Admission.ADMITTED
    ledger.mark_started([("ds", "r1"), ("ds", "r2")])
    assert ledger.queued_rids("ds") == []
    if end == "release":
        ledger.release("ds", "r1")
    elif end == "charge":
        ledger.charge("ds", "s1", "r1", 10, 20)
    else:
        ledger.charge_many([ChargeArgs("ds", "s1", "r1", 10, 20)])
    assert {m.decode() for m in redis_client.smembers(keys.started)} == {"r2"}
    assert ledger.inflight_rids("ds") == ["r2"] and ledger.queued_rids("ds") == []
