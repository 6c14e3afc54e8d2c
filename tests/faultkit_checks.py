"""The invariants every fault run must keep, measured (for the report) and asserted (tests).

After a run has settled: every prompt of an open dataset is done, failed or skipped, once;
``results`` holds one row per (dataset, sample_id) and one per done prompt; each Redis
counter equals its SQL sum; no reservation is left behind; SQL and Redis agree on which
datasets are closed; and each budget is within its policy's bound.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from common.ledger import Ledger
from common.schema import prompt_inputs, results
from common.store import Store
from sim.reqlog import input_sha1
from tests.faultkit import sim_log

SampleKey = tuple[str, str]
COMPLETED = ("stop", "length")


@dataclass
class Check:
    prompts: int = 0
    states: Counter[str] = field(default_factory=Counter)
    lost: int = 0  # prompts of open datasets never settled, or done without a result
    duplicated: int = 0  # extra result rows, or samples the ledger counts twice
    drift: int = 0  # |Redis used - SQL sum| + |Redis samples - results|, over datasets
    requests_max: int = 0  # most /generate requests the server saw for one sample
    regenerated: int = 0  # samples generated to completion more than once
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def assert_ok(self) -> None:
        assert self.ok, "invariants broken:\n  " + "\n  ".join(self.problems)


def settle(store: Store, datasets: Sequence[str], timeout_s: float) -> bool:
    """Wait until no prompt of an open dataset is queued; False if that never happens."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if queued_open(store, datasets) == 0:
            return True
        time.sleep(0.2)
    return False


def queued_open(store: Store, datasets: Sequence[str]) -> int:
    return sum(store.prompt_counts(n).get("queued", 0) for n in datasets
               if store.dataset(n).state != "closed")


def quiesce(ledger: Ledger, datasets: Sequence[str], timeout_s: float = 30.0) -> None:
    """Wait for requests still in flight (a closed dataset's drain) to be charged."""
    deadline = time.monotonic() + timeout_s
    while any(ledger.state(n).inflight for n in datasets) and time.monotonic() < deadline:
        time.sleep(0.1)


def load_requests(sim_url: str | None = None, log_file: Path | None = None) -> list[dict]:
    """The simulator's request log: over HTTP, or its JSONL file (survives restarts)."""
    if log_file is not None:
        return [json.loads(line) for line in log_file.read_text().splitlines() if line]
    return sim_log(sim_url) if sim_url else []


def requests_per_sample(
    store: Store, datasets: Sequence[str], entries: Iterable[dict[str, Any]]
) -> dict[SampleKey, list[dict[str, Any]]]:
    """The server's log entries of each sample (matched by the sha1 of its input ids)."""
    q = sa.select(prompt_inputs.c.dataset, prompt_inputs.c.sample_id,
                  prompt_inputs.c.input_ids).where(prompt_inputs.c.dataset.in_(list(datasets)))
    with store.engine.connect() as conn:
        by_sha = {input_sha1(list(ids)): (ds, sid) for ds, sid, ids in conn.execute(q)}
    out: dict[SampleKey, list[dict[str, Any]]] = {}
    for entry in entries:
        key = by_sha.get(entry.get("input_sha1"))
        if key is not None:
            out.setdefault(key, []).append(entry)
    return out


def check_run(
    store: Store, ledger: Ledger, datasets: Sequence[str], *,
    entries: Iterable[dict[str, Any]] = (), drain_bound_tokens: int = 0,
) -> Check:
    """Measure every invariant; ``drain_bound_tokens`` bounds a drain dataset's overshoot
    (requests in flight at the close: total concurrency x max_new_tokens)."""
    check = Check()
    for name in datasets:
        _check_dataset(store, ledger, name, drain_bound_tokens, check)
    dup = _duplicate_rows(store)
    if dup:
        check.duplicated += dup
        check.problems.append(f"{dup} duplicate result rows")
    per_sample = requests_per_sample(store, datasets, entries)
    for seen in per_sample.values():
        check.requests_max = max(check.requests_max, len(seen))
        completed = sum(1 for e in seen if e["status"] == 200 and e["finish_type"] in COMPLETED)
        if completed > 1:
            check.regenerated += 1
    return check


def _check_dataset(store: Store, ledger: Ledger, name: str, drain_bound: int, c: Check) -> None:
    ds, state = store.dataset(name), ledger.state(name)
    counts = store.prompt_counts(name)
    c.prompts += sum(counts.values())
    c.states.update(counts)
    if ds.state != "closed" and counts.get("queued"):
        c.lost += counts["queued"]
        c.problems.append(f"{name}: {counts['queued']} prompts never settled")
    kept, used = _result_count(store, name), store.used_tokens(name, ds.budget)
    if kept != counts.get("done", 0):
        c.lost += abs(kept - counts.get("done", 0))
        c.problems.append(f"{name}: {counts.get('done', 0)} prompts done, {kept} results")
    drift = abs(state.used_tokens - used) + abs(state.samples - kept)
    if drift:
        c.drift += drift
        c.duplicated += max(0, state.samples - kept)
        c.problems.append(f"{name}: Redis used/samples {state.used_tokens}/{state.samples}, "
                          f"SQL {used}/{kept}")
    if state.inflight or state.reserved_tokens:
        c.problems.append(f"{name}: {state.inflight} rids / {state.reserved_tokens} tokens "
                          "still reserved after the run")
    if (ds.state == "closed") != (state.state == "closed"):
        c.problems.append(f"{name}: SQL says {ds.state}, Redis says {state.state}")
    if used >= ds.budget.tokens and ds.state != "closed":
        c.problems.append(f"{name}: {used} tokens used of {ds.budget.tokens} but still open")
    _check_bound(store, name, ds.budget.policy, ds.budget.overshoot(used), drain_bound, c)


def _check_bound(
    store: Store, name: str, policy: str, overshoot: int, drain_bound: int, c: Check
) -> None:
    if policy == "exact":
        bound = 0
    elif policy == "abort":
        with store.engine.connect() as conn:
            bound = int(conn.scalar(sa.select(sa.func.coalesce(
                sa.func.max(results.c.completion_tokens), 0)).where(
                results.c.dataset == name)) or 0)
    else:
        bound = drain_bound
    if overshoot > bound:
        c.problems.append(f"{name}: overshoot {overshoot} over the {policy} bound {bound}")


def _result_count(store: Store, name: str) -> int:
    q = sa.select(sa.func.count()).where(results.c.dataset == name)
    with store.engine.connect() as conn:
        return int(conn.scalar(q) or 0)


def _duplicate_rows(store: Store) -> int:
    q = (sa.select(sa.func.count()).select_from(results)
         .group_by(results.c.dataset, results.c.sample_id).having(sa.func.count() > 1))
    with store.engine.connect() as conn:
        return sum(int(n) - 1 for n in conn.scalars(q))
