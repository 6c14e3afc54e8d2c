"""How many requests the fleet keeps in flight at one server, from its load readings.

A pure controller: each fresh ``/v1/loads`` reading of a server (common/server_loads.py)
and the state of the last step give the next state, whose ``limit`` is the fleet's
requests in flight at that server (workers/gate.py splits it between worker processes).

The set point is the server's running capacity plus a small waiting queue, so a request
that ends is replaced at once from the queue while the budget guard allows for little
more than what runs:

* **Saturated** (requests wait, or the running cap or the KV pool is full): what runs is
  what the server can run, so the target is ``running + queue(running)``. That is read
  from the server, not inferred from the queue's length, so the requests still queued
  from a higher limit (which drain only as long requests end) do not push the limit down
  poll after poll.
* **Retractions rose** (more waiting requests were retracted than at the last reading):
  the server admitted more than its KV pool holds; the limit does not rise. Nor is it
  cut below the usual target: the server admits by its own KV reservation whatever the
  queue's length, so a shorter queue would not retract less, only leave the server
  nothing to admit when KV frees (measured: cutting to the running count there cost the
  agentic shape 11% of its tok/s, `bench.concurrency`).
* **Room left** (nothing waits, slots and KV free): the target is what the free slots
  could still run, or what the KV pool holds at twice the running requests' size if
  fewer, and a queue; but only while the fleet fills the limit it has: a fleet short of
  work (a run's tail) gives no evidence, and the limit holds. Twice, because a request
  still grows: just admitted, it holds little more than its prompt. Read at their size
  now, an empty pool of 6K-token prompts with 8K-token outputs to come has room for 26
  where 13 run once it is full; the cohort admitted on that reading outgrew the pool
  together and was retracted, and auto lost up to 18% of its tok/s to fixed 16
  (measured, `bench.concurrency`).

The limit moves by ``gain`` of the way to the target each step, at most doubling (the
readings of what runs come before the whole of a first burst), and holds while the
target is within ``deadband`` of it: that damping, and a target read from the server's
running count rather than accumulated, are what keep it from oscillating.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from common.server_loads import ServerLoad

# Above this KV usage nothing more fits, whatever the running count.
FULL_USAGE = 0.95
# What a running request's KV is expected to grow to, as a multiple of what it holds now.
GROWTH = 2
# A worker's requests in flight at a server that publishes no load, under auto: the
# fixed concurrency's old default.
FALLBACK = 64


@dataclass(frozen=True)
class LimitState:
    """The fleet's limit at one server, and what the step that set it read."""

    limit: int
    retracted_waiting: int
    polls: int  # steps taken, for tests and `status`

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> LimitState:
        return cls(**json.loads(raw))


@dataclass(frozen=True)
class AutoLimit:
    """The controller's constants; ``step`` is the whole policy."""

    queue_share: float = 0.1  # waiting queue kept, as a share of the running count
    min_queue: int = 2
    gain: float = 0.5
    start: int = 2  # the limit before any reading: it probes up from there

    def queue(self, running: int) -> int:
        return max(self.min_queue, math.ceil(self.queue_share * running))

    def ceiling(self, load: ServerLoad) -> int | None:
        """More than the running cap and its queue would only wait in the server."""
        return load.max_running + self.queue(load.max_running) if load.max_running else None

    def target(self, state: LimitState, load: ServerLoad) -> int:
        """Where the limit should go, by this reading."""
        target = self._by_load(state, load)
        if load.retracted_waiting > state.retracted_waiting:
            return min(target, state.limit)
        return target

    def _by_load(self, state: LimitState, load: ServerLoad) -> int:
        full = load.max_running and load.running >= load.max_running
        if load.waiting > 0 or full or load.token_usage >= FULL_USAGE:
            return load.running + self.queue(load.running)
        in_use = load.running + load.waiting
        if in_use + self.deadband(state.limit) < state.limit:
            return state.limit  # the fleet does not fill its limit: nothing learnt
        return self.room(state, load) + self.queue(load.running)

    def room(self, state: LimitState, load: ServerLoad) -> int:
        """What the server could run: its free slots (no cap said: double the limit),
        or, if fewer, as many requests as its KV pool holds at twice the running ones'
        size. A request still grows (just admitted, it holds little more than its
        prompt), so the running ones' KV now is no measure of what they will hold: a
        probe to every slot of a KV-bound server, or to what its pool holds at their size
        now, would admit a cohort that outgrows the pool together and is retracted."""
        room = load.max_running if load.max_running else load.running + state.limit
        if load.running and load.used_tokens and load.max_total_tokens:
            room = min(room, load.running * load.max_total_tokens // (GROWTH * load.used_tokens))
        return max(room, load.running)

    def deadband(self, limit: int) -> int:
        return max(1, self.queue(limit) // 2)

    def step(self, state: LimitState | None, load: ServerLoad) -> LimitState:
        """The next state after ``load``, a reading newer than the one ``state`` saw."""
        state = state or LimitState(self.start, load.retracted_waiting, 0)
        target = self.target(state, load)
        limit = state.limit
        if abs(target - limit) > self.deadband(limit):
            limit += min(limit, math.ceil(self.gain * (target - limit))) if target > limit \
                else -math.ceil(self.gain * (limit - target))
        ceiling = self.ceiling(load)
        if ceiling is not None:
            limit = min(limit, ceiling)
        return LimitState(max(1, limit), load.retracted_waiting, state.polls + 1)


def share(fleet_limit: int, workers: int) -> int:
    """One worker process's part of the fleet's limit (rounded up: none gets 0)."""
    return max(1, math.ceil(fleet_limit / max(1, workers)))
