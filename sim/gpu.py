"""The GPU mode's engine: the asyncio shell around `sim.gpusched.GpuScheduler`.

It offers the HTTP handlers the same interface as `sim.engine.Engine` (submit,
wait_admitted, decode, finish, abort, load). One background task steps the scheduler: it
runs a forward pass, waits out its simulated duration divided by `time_scale` (paced
across passes, whatever the batch size: `Pacer`), then publishes the new token counts to
the sequences.
Handlers poll their sequence every chunk interval and are woken early when it ends, so no
timer exists per token or per request. Output ids still come from `sim.outputs`: the
physics decides when tokens appear, never which.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from sim.config import SimConfig
from sim.engine import (
    ABORT_RUNNING,
    ABORT_WAITING,
    DONE,
    RUNNING,
    Sequence,
    check_admissible,
    matching,
    sleep_unless_woken,
    wake,
)
from sim.errors import SimHttpError
from sim.faults import FaultInjector
from sim.gpujob import Job, Step
from sim.gpusched import GpuScheduler
from sim.load import Load
from sim.outputs import Completion
from sim.steplaw import PROFILES

# How far behind its pace the stepping loop may catch up by running passes unslept.
MAX_BEHIND_S = 0.005


class Pacer:
    """How long to sleep after each pass so that passes keep their scaled durations on
    average. An asyncio sleep lasts at least a tick of the event loop's clock (a
    millisecond with epoll), so a sleep of each pass's own duration held an agentic pass
    (about 40 ms) at a time scale of 100 to some 36 times real time. The passes'
    durations add up to a due time instead, and the loop sleeps only while it is ahead;
    a loop that fell behind (the simulator's own work) catches up by at most
    ``MAX_BEHIND_S`` of passes run unslept."""

    def __init__(self) -> None:
        self.due = 0.0  # when, in real time, the passes so far are due to have ended

    def restart(self, now: float) -> None:
        """The loop starts stepping (at start, or out of an idle spell)."""
        self.due = now

    def delay(self, now: float, real_s: float) -> float:
        """The sleep owed for a pass of ``real_s`` (its duration, scaled) computed at
        ``now`` (0: only yield to the loop)."""
        self.due = max(self.due, now - MAX_BEHIND_S) + real_s
        return max(0.0, self.due - now)


class GpuEngine:
    """Submits requests to the GPU scheduler and runs its forward passes in real time."""

    def __init__(self, cfg: SimConfig, injector: FaultInjector) -> None:
        self.cfg = cfg
        self.injector = injector
        law = PROFILES[cfg.profile].law
        self.sched = GpuScheduler(law, cfg.kv_pool_tokens, cfg.max_running_requests)
        self.inflight: dict[str, Sequence] = {}
        self._seqs: dict[Job, Sequence] = {}
        self._jobs: dict[str, Job] = {}
        self._work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # When the server last ran out of work: its idle time, at the time scale, adds to
        # the passes' durations on its clock, which the simulator's own overhead does not
        # lengthen.
        self._idle_since: float | None = None
        self._pacer = Pacer()

    @property
    def running(self) -> list[Job]:
        """The running batch."""
        return self.sched.running

    @property
    def waiting(self) -> list[Job]:
        """The waiting queue, head first."""
        return list(self.sched.waiting)

    def submit(self, rid: str, completion: Completion, input_ids: list[int]) -> Sequence:
        """Register a request (duplicate rid → 400) and queue it for the next prefill."""
        if rid in self.inflight:
            raise SimHttpError.request(f"Duplicate request ID detected: {rid}")
        bound = self.cfg.max_queued_requests
        check_admissible(
            self.cfg, len(input_ids), bound is not None and len(self.sched.waiting) >= bound
        )
        seq = Sequence(rid, completion, len(input_ids))
        if self.injector.take_abort():
            seq.abort_after = len(completion.ids) // 2
        job = Job(rid, list(input_ids), completion.ids[: seq.target], completion.max_new_tokens)
        seq.admitted = asyncio.get_running_loop().create_future()
        self.inflight[rid] = seq
        self._seqs[job] = seq
        self._jobs[rid] = job
        self.sched.submit(job)
        self._ensure_stepping()
        return seq

    async def wait_admitted(self, seq: Sequence) -> bool:
        """Wait for the prefill that admits seq; False if it was aborted while waiting."""
        if seq.state == RUNNING:
            return True
        if seq.admitted is None or seq.state == DONE:
            return False
        return await seq.admitted

    async def decode(self, seq: Sequence, step_s: float) -> AsyncIterator[int]:
        """Yield seq's token count every step_s seconds until it ends."""
        while seq.state != DONE:
            await sleep_unless_woken(seq, step_s)
            yield seq.count

    def finish(self, seq: Sequence) -> None:
        """The handler is done with seq (idempotent): a request still in flight is aborted."""
        if seq.state != DONE:
            self._abort(seq)
        self._forget(seq)

    def abort(self, rid_prefix: str | None, abort_all: bool = False) -> int:
        """Abort in-flight requests by rid prefix (or all); returns how many matched."""
        hits = matching(self.inflight.values(), rid_prefix, abort_all)
        for seq in hits:
            self._abort(seq)
        return len(hits)

    def _abort(self, seq: Sequence) -> None:
        if seq.state == DONE:
            return
        job = self._jobs[seq.rid]
        waiting = seq.state != RUNNING
        seq.abort_message = ABORT_WAITING if waiting else ABORT_RUNNING
        self.sched.abort(job, seq.abort_message)
        self._end(seq)
        self._work.set()  # a running abort is released at the next step

    def _end(self, seq: Sequence) -> None:
        seq.state = DONE
        if seq.admitted is not None and not seq.admitted.done():
            seq.admitted.set_result(False)
        wake(seq)

    def _forget(self, seq: Sequence) -> None:
        if self.inflight.get(seq.rid) is seq:
            del self.inflight[seq.rid]
            self._seqs.pop(self._jobs.pop(seq.rid), None)

    # ---- the stepping task ---------------------------------------------------------------

    def _ensure_stepping(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._work.set()

    async def _run(self) -> None:
        self._pacer.restart(time.monotonic())
        while True:
            faults = self.injector.faults
            self.sched.max_running_requests = (faults.max_running_requests
                                               or self.cfg.max_running_requests)
            scale = self._scale()
            step = self.sched.step()
            if step is None:
                self._work.clear()
                self._idle_since = time.monotonic()
                await self._work.wait()
                # The clock of an idle server runs too: a throughput on it counts idling.
                self.sched.stats.clock_s += self._idle_now()
                self._idle_since = None
                self._pacer.restart(time.monotonic())
                continue
            self._admit(step)
            await asyncio.sleep(self._pacer.delay(time.monotonic(), step.duration_s / scale))
            self._publish(step)

    def _admit(self, step: Step) -> None:
        for job in step.jobs:
            seq = self._seqs.get(job)
            if seq is not None and seq.state != DONE and seq.state != RUNNING:
                seq.state = RUNNING
                if seq.admitted is not None and not seq.admitted.done():
                    seq.admitted.set_result(True)

    def _publish(self, step: Step) -> None:
        """Tokens of a pass become visible when the pass ends."""
        for job in (*step.jobs, *step.retracted, *step.ended):
            seq = self._seqs.get(job)
            if seq is None or seq.state == DONE:
                continue
            seq.count, seq.cached_tokens = job.generated, job.cached_tokens
            seq.num_retractions = job.retractions
            if job.done:
                if job.abort_message is not None:
                    seq.abort_message = ABORT_RUNNING
                self._end(seq)

    # ---- observation ---------------------------------------------------------------------

    def clock(self) -> tuple[float, int]:
        """Simulated seconds since the first request (forward passes and idle time, not
        the simulator's own overhead) and output tokens decoded."""
        stats = self.sched.stats
        return stats.clock_s + self._idle_now(), stats.generated_tokens_total

    def _idle_now(self) -> float:
        """Simulated seconds of the idle spell going on, if any."""
        if self._idle_since is None:
            return 0.0
        return (time.monotonic() - self._idle_since) * self._scale()

    def _scale(self) -> float:
        """The time scale now: /sim/faults may change it while the server runs."""
        return self.injector.faults.time_scale or self.cfg.time_scale

    def gen_throughput(self) -> float:
        """Output tokens per simulated second over the recent window."""
        return self.sched.stats.gen_throughput()

    def load(self) -> Load:
        """/v1/loads and /metrics figures."""
        sched, stats = self.sched, self.sched.stats
        return Load(
            num_running_reqs=len(sched.running),
            num_waiting_reqs=len(sched.waiting),
            num_waiting_uncached_tokens=sum(
                len(j.fill_ids()) - sched.cache.peek_prefix(j.fill_ids()[:-1])
                for j in sched.waiting
            ),
            num_used_tokens=sched.used_tokens,
            max_total_num_tokens=sched.kv_tokens,
            max_running_requests=sched.max_running_requests,
            gen_throughput=stats.gen_throughput(),
            cache_hit_rate=stats.last_cache_hit_rate,
            num_retracted_reqs=stats.recent_retractions(),
            retracted_reqs_total=stats.retracted_reqs_total,
            retracted_input_tokens_total=stats.retracted_input_tokens_total,
            retracted_output_tokens_total=stats.retracted_output_tokens_total,
            new_token_ratio=sched.new_token_ratio,
            num_waiting_retracted=sum(1 for j in sched.waiting if j.retractions),
        )

    def flush_cache(self) -> None:
        """Empty the prefix cache, as SGLang does, only when no request is in flight."""
        if not self.sched.running and not self.sched.waiting:
            self.sched.cache.reset()

    async def close(self) -> None:
        """Stop the stepping task."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
