"""The producer killed mid-enqueue: ``datagen enqueue`` SIGKILLed while it stores and
publishes, then run again to the end; its queues must then hold exactly one message per
queued prompt, and the workers do the rest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import sqlalchemy as sa

from common.keys import dataset_keys
from common.messages import sample_of
from common.schema import prompts
from tests.faultkit import ROOT, wait_for
from tests.faultkit_checks import quiesce
from tests.faultkit_scenarios import SETTLE_S, finish, settle_reviving, start_workers
from tests.faultkit_stack import ENQUEUE_FLAGS, Outcome, Stack, rerun_enqueue, write_manifest


def producer_kill(stack: Stack, prompts: int, kills: int = 1) -> Outcome:
    """``datagen enqueue`` is SIGKILLed mid-run ``kills`` times, then run to the end. Its
    queue must then hold exactly one message per queued prompt; workers then do the rest."""
    started = time.monotonic()
    names = ["pk_a", "pk_b"]
    manifest = write_manifest(stack, {n: (prompts // 2, None) for n in names})
    faults = []
    for i in range(kills):
        stored = _kill_enqueue_at(stack, manifest, prompts * (i + 1) // (kills + 1))
        sent = sum(stack.ledger.state(n).queued for n in names)
        faults.append(f"SIGKILL of `datagen enqueue` with {stored:,} of {prompts:,} prompts "
                      f"stored, {sent:,} messages published")
    rerun_enqueue(stack, manifest)
    missing, doubled = queue_exactness(stack, names)
    with start_workers(stack) as workers:
        settle_reviving(stack, workers, names, max(SETTLE_S, prompts / 20))
        quiesce(stack.ledger, names)
    notes = {"messages_missing_after_rerun": missing, "messages_doubled_after_rerun": doubled}
    return finish(stack, "producer killed mid-enqueue", names, started, faults=faults,
                   notes=notes)


def _kill_enqueue_at(stack: Stack, manifest: Path, target: int) -> int:
    env = {**os.environ, **stack.settings.to_env()}
    proc = subprocess.Popen([sys.executable, "-m", "ops.cli", "enqueue", "--manifest",
                             str(manifest), *ENQUEUE_FLAGS], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: _stored(stack) >= target or proc.poll() is not None, 120,
                 f"{target} prompts stored", 0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL, "enqueue finished before it could be killed"
    return _stored(stack)


def _stored(stack: Stack) -> int:
    with stack.store.engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.count()).select_from(prompts)) or 0)


def queue_exactness(stack: Stack, names: list[str]) -> tuple[int, int]:
    """(queued prompts without a message, messages beyond one per sample) in Redis."""
    client, missing, doubled = stack.ledger.redis, 0, 0
    for name in names:
        seen: Counter[str] = Counter()
        for key in dataset_keys(name).queue_lists:
            for raw in client.lrange(key, 0, -1):
                sample = sample_of(json.loads(raw))
                if sample is not None:
                    seen[sample[1]] += 1
        queued = set(stack.store.sample_ids(name, "queued"))
        missing += len(queued - set(seen))
        doubled += sum(n - 1 for n in seen.values())
    return missing, doubled
