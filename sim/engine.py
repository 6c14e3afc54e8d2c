"""The simulated scheduler: continuous batching with a FIFO waiting queue.

Model: `max_running_requests` slots. A request takes a free slot at once, or waits in
FIFO order until one frees. A running sequence decodes at `decode_tok_per_s` tokens/s
on its own (as in continuous batching, sequences do not wait for each other), so a
request's latency is queue wait + output length / speed. Aborts (explicit, prefix
matched, or by client disconnect) take effect at the next wake-up: sleeps are futures
that an abort resolves early, so no per-token timers are needed even at high speeds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

from sim.config import SimConfig
from sim.errors import QUEUE_FULL_MESSAGE, SimHttpError, queue_full_body
from sim.faults import FaultInjector
from sim.load import Load
from sim.outputs import Completion

WAITING, RUNNING, DONE = "waiting", "running", "done"
ABORT_RUNNING = "Aborted"
ABORT_WAITING = "Abort in waiting queue"


class SchedulerReject(Exception):
    """A scheduler-side abort carrying a status: HTTP error, or a final chunk when streaming."""

    def __init__(self, error: SimHttpError, finish_reason: dict[str, Any]) -> None:
        super().__init__(error.message)
        self.error = error
        self.finish_reason = finish_reason


@dataclass(eq=False)
class Sequence:
    """One in-flight request inside the engine."""

    rid: str
    completion: Completion
    prompt_tokens: int
    #: Stop after this many tokens with an abort (the `abort_next` fault); None = no.
    abort_after: int | None = None
    state: str = WAITING
    progress: float = 0.0
    count: int = 0
    #: Event-loop time up to which progress has been credited; None before decoding.
    last_tick: float | None = None
    abort_message: str | None = None
    admitted: asyncio.Future[bool] | None = None
    waker: asyncio.Future[None] | None = None
    #: meta_info fields the GPU mode fills in (prefix-cache hit, times retracted).
    cached_tokens: int = 0
    num_retractions: int = 0

    @property
    def target(self) -> int:
        """Tokens this sequence will produce if nobody aborts it."""
        total = len(self.completion.ids)
        return total if self.abort_after is None else min(total, self.abort_after)

    def finish_reason(self) -> dict[str, Any]:
        """SGLang's finish_reason for the sequence as it ended."""
        if self.abort_message == ABORT_WAITING:
            return {"type": "abort", "message": ABORT_WAITING}
        if self.abort_message is not None or self.count < len(self.completion.ids):
            return {
                "type": "abort",
                "message": ABORT_RUNNING,
                "status_code": None,
                "err_type": None,
            }
        return self.completion.finish_reason()


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def wake(seq: Sequence) -> None:
    """Cut seq's current sleep short (it ended or was aborted)."""
    if seq.waker is not None:
        _wake(seq.waker)


async def sleep_unless_woken(seq: Sequence, delay: float) -> None:
    """Sleep that wake(seq) can cut short, so no per-token timers are needed."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    handle = loop.call_later(max(0.0, delay), _wake, fut)
    seq.waker = fut
    try:
        await fut
    finally:
        handle.cancel()
        seq.waker = None


def check_admissible(cfg: SimConfig, prompt_tokens: int, queue_full: bool) -> None:
    """Scheduler checks: input-length limit, then the waiting-queue bound."""
    limit = cfg.max_req_input_len
    if prompt_tokens >= limit:
        message = (
            f"Input length ({prompt_tokens} tokens) exceeds the maximum allowed length "
            f"({limit} tokens). Use a shorter input or enable --allow-auto-truncate."
        )
        reason = {
            "type": "abort",
            "message": message,
            "status_code": 400,
            "err_type": "BadRequestError",
        }
        raise SchedulerReject(SimHttpError.request(message), reason)
    if queue_full:
        error = SimHttpError(503, queue_full_body(), QUEUE_FULL_MESSAGE, sse=False)
        reason = {"type": "abort", "status_code": 503, "message": QUEUE_FULL_MESSAGE}
        raise SchedulerReject(error, reason)


class Engine:
    """Slots, waiting queue, decode timing and aborts."""

    def __init__(self, cfg: SimConfig, injector: FaultInjector) -> None:
        self.cfg = cfg
        self.injector = injector
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}
        self.inflight: dict[str, Sequence] = {}

    # ---- admission -------------------------------------------------------------------

    def submit(self, rid: str, completion: Completion, input_ids: list[int]) -> Sequence:
        """Register a request (duplicate rid → 400) and start it or queue it."""
        if rid in self.inflight:
            raise SimHttpError.request(f"Duplicate request ID detected: {rid}")
        bound = self.cfg.max_queued_requests
        full = len(self.running) >= self.cfg.max_running_requests
        check_admissible(
            self.cfg, len(input_ids), bound is not None and full and len(self.waiting) >= bound
        )
        seq = Sequence(rid, completion, len(input_ids))
        if self.injector.take_abort():
            seq.abort_after = len(completion.ids) // 2
        self.inflight[rid] = seq
        if len(self.running) < self.cfg.max_running_requests:
            self._start(seq)
        else:
            seq.admitted = asyncio.get_running_loop().create_future()
            self.waiting.append(seq)
        return seq

    def _start(self, seq: Sequence) -> None:
        seq.state = RUNNING
        self.running[seq.rid] = seq

    def _admit_next(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_running_requests:
            seq = self.waiting.popleft()
            self._start(seq)
            if seq.admitted is not None and not seq.admitted.done():
                seq.admitted.set_result(True)

    async def wait_admitted(self, seq: Sequence) -> bool:
        """Wait for a slot; False if the request was aborted while waiting."""
        if seq.state == RUNNING:
            return True
        if seq.admitted is None:
            return False
        return await seq.admitted

    # ---- decoding --------------------------------------------------------------------

    async def decode(self, seq: Sequence, step_s: float) -> AsyncIterator[int]:
        """Advance seq in steps of at most step_s seconds, yielding the token count."""
        seq.last_tick = asyncio.get_running_loop().time()
        while seq.count < seq.target and seq.abort_message is None:
            speed = self.injector.faults.decode_tok_per_s
            if speed > 0:
                await sleep_unless_woken(seq, min(step_s, (seq.target - seq.progress) / speed))
            self._advance(seq)
            yield seq.count

    def _advance(self, seq: Sequence) -> None:
        """Credit seq with the tokens decoded since its last tick (all of them if instant)."""
        if seq.last_tick is None:
            return
        now = asyncio.get_running_loop().time()
        speed = self.injector.faults.decode_tok_per_s
        if speed <= 0:
            seq.progress = float(seq.target)
        else:
            seq.progress += (now - seq.last_tick) * speed
        seq.last_tick = now
        seq.count = min(seq.target, int(seq.progress + 1e-6))

    # ---- ending ----------------------------------------------------------------------

    def abort(self, rid_prefix: str | None, abort_all: bool = False) -> int:
        """Abort in-flight requests by rid prefix (or all); returns how many matched."""
        hits = matching(self.inflight.values(), rid_prefix, abort_all)
        for seq in hits:
            self._abort(seq)
        return len(hits)

    def _abort(self, seq: Sequence) -> None:
        if seq.abort_message is not None:
            return
        if seq.state == WAITING:
            seq.abort_message = ABORT_WAITING
            self._leave(seq)
            if seq.admitted is not None and not seq.admitted.done():
                seq.admitted.set_result(False)
            return
        seq.abort_message = ABORT_RUNNING
        wake(seq)

    def _leave(self, seq: Sequence) -> None:
        """Drop seq from every structure and hand its slot to the next waiter."""
        if seq.state == WAITING:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
        self.running.pop(seq.rid, None)
        if self.inflight.get(seq.rid) is seq:
            del self.inflight[seq.rid]
        seq.state = DONE
        self._admit_next()

    def finish(self, seq: Sequence) -> None:
        """Release seq's slot or queue place (idempotent), crediting tokens decoded so far."""
        if seq.state == RUNNING and seq.count < seq.target:
            self._advance(seq)
        if seq.state != DONE:
            self._leave(seq)

    def gen_throughput(self) -> float:
        """Current decode throughput (tokens/s) of the whole server."""
        return len(self.running) * self.injector.faults.decode_tok_per_s

    def load(self) -> Load:
        """Slots as the running batch, each holding its prompt and output so far."""
        for seq in self.running.values():
            if seq.count < seq.target:
                self._advance(seq)
        return Load(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_waiting_uncached_tokens=sum(s.prompt_tokens for s in self.waiting),
            num_used_tokens=sum(s.prompt_tokens + s.count for s in self.running.values()),
            max_total_num_tokens=self.cfg.max_total_num_tokens,
            max_running_requests=self.cfg.max_running_requests,
            gen_throughput=self.gen_throughput(),
            cache_hit_rate=0.0,
        )

    def flush_cache(self) -> None:
        """There is no prefix cache in this mode."""

    async def close(self) -> None:
        """Nothing runs in the background in this mode."""


def matching(inflight: Iterable[Sequence], rid_prefix: str | None,
             abort_all: bool) -> list[Sequence]:
    """The requests an abort names: all of them, or those whose rid has the prefix; an
    empty prefix names none."""
    if not abort_all and not rid_prefix:
        return []
    return [s for s in inflight if abort_all or s.rid.startswith(rid_prefix or "")]
