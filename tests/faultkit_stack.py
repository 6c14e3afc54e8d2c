"""One run's stack (settings, private services, simulator, datasets) and what a scenario
reports. Shared by the fault tests and ``python -m bench.reliability``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import redis

from common.celery_app import make_celery
from common.ledger import Ledger
from common.settings import Settings
from common.store import Store
from producer.enqueue import DatasetSummary, Enqueuer, Limits
from producer.plan import DEFAULT_SAMPLING, plans_from_manifest
from producer.template import BUNDLED_TOKENIZER, ChatTemplater
from tests.faultkit import PrivateRedis, Sim, run_cli, wait_for
from tests.faultkit_checks import COMPLETED, Check, load_requests
from tests.faultkit_pg import PrivatePostgres
from tests.faultkit_proxy import OutageProxy
from tests.helpers import write_dataset

MAX_NEW_TOKENS = 256
MAX_SEQ_LEN = 4096
ENQUEUE_FLAGS = ("-q", "--max-new-tokens", str(MAX_NEW_TOKENS), "--max-seq-len", str(MAX_SEQ_LEN))


@dataclass
class Stack:
    settings: Settings
    tmp: Path
    sim: Sim
    redis: PrivateRedis | None = None
    pg: PrivatePostgres | None = None
    # In front of ``redis`` when the settings' Redis URL is its own: outages on demand.
    outage: OutageProxy | None = None
    workers: int = 2
    concurrency: int = 8

    @cached_property
    def store(self) -> Store:
        return Store(self.settings.database_url)

    @cached_property
    def ledger(self) -> Ledger:
        return Ledger(redis.Redis.from_url(self.settings.redis_url))

    @property
    def drain_bound(self) -> int:
        """Tokens a drain close may overshoot by: every slot finishing a full request."""
        return self.workers * self.concurrency * MAX_NEW_TOKENS

    def done(self, names: list[str]) -> int:
        return sum(self.store.prompt_counts(n).get("done", 0) for n in names)


@dataclass
class Outcome:
    scenario: str
    prompts: int
    faults: list[str]
    check: Check
    recovery_s: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)


def write_manifest(stack: Stack, spec: dict[str, tuple[int, int | None]]) -> Path:
    """One prompt file per dataset (name: (prompts, budget or None)) and a manifest."""
    lines = []
    for name, (count, budget) in spec.items():
        write_dataset(stack.tmp, name, count)
        lines.append(f'[datasets.{name}]\nfiles = ["{name}.jsonl"]')
        if budget is not None:
            lines.append(f"budget_tokens = {budget}")
    manifest = stack.tmp / "datasets.toml"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def enqueue(stack: Stack, manifest: Path) -> list[DatasetSummary]:
    """What ``datagen enqueue --manifest`` does, in this process (the quick first run)."""
    plans = plans_from_manifest(str(manifest), _default_budget(stack), dict(DEFAULT_SAMPLING),
                                MAX_NEW_TOKENS)
    templater = ChatTemplater(str(BUNDLED_TOKENIZER))
    enqueuer = Enqueuer(stack.store, stack.ledger, make_celery(stack.settings), templater,
                        Limits(MAX_SEQ_LEN))
    return enqueuer.run(plans)


def _default_budget(stack: Stack) -> Any:
    from common.budget import Budget

    return Budget(stack.settings.default_budget_tokens)


def rerun_enqueue(stack: Stack, manifest: Path) -> str:
    """``datagen enqueue --manifest`` as an operator re-runs it; returns its stdout."""
    done = run_cli(stack.settings, "enqueue", "--manifest", str(manifest), *ENQUEUE_FLAGS)
    assert done.returncode == 0, f"enqueue re-run failed ({done.returncode}):\n{done.stderr}"
    return done.stdout


def first_completion_after(stack: Stack, since: float, timeout_s: float = 90.0) -> float:
    """Seconds from ``since`` (unix) until SGLang receives a request that then completes:
    how long generation stalled after a service came back."""
    found: list[float] = []

    def resumed() -> bool:
        found[:] = [e["arrived_ts"] for e in load_requests(log_file=stack.sim.log_file)
                    if e["arrived_ts"] >= since and e["status"] == 200
                    and e["finish_type"] in COMPLETED]
        return bool(found)

    wait_for(resumed, timeout_s, "generation to resume", 0.2)
    return round(min(found) - since, 2)


def wait_progress(stack: Stack, names: list[str], target: int, timeout_s: float = 120) -> None:
    wait_for(lambda: stack.done(names) >= target, timeout_s, f"{target} samples done", 0.1)


def wait_busy(stack: Stack, names: list[str], at_least: int, timeout_s: float = 30) -> None:
    """Until at least this many requests are in flight (admitted, not yet charged)."""
    wait_for(lambda: sum(stack.ledger.state(n).inflight for n in names) >= at_least,
             timeout_s, f"{at_least} requests in flight", 0.02)


def now() -> float:
    return time.time()
