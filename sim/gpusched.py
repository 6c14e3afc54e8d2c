"""The GPU mode's scheduler as a pure state machine: one `step()` is one forward pass.

No asyncio and no wall clock: `step()` changes the state and returns the pass's duration in
simulated seconds (`sim.steplaw`); the asyncio shell (`sim.gpu`) sleeps that long, scaled.
What is modelled, and from which SGLang file (repo sgl-project/sglang, python/sglang/srt/):

* Loop (`managers/scheduler.py`, get_next_batch_to_run): a prefill batch whenever one can
  be formed, else one decode step of the whole running batch; no mixed or chunked prefill
  (a long prompt is prefilled whole). Idle resets new_token_ratio to its initial value.
* Admission (`managers/schedule_policy.py`, PrefillAdder.add_one_req): FCFS; the queue head
  is admitted when extend + min(max_new_tokens - generated, 4096) < rem_total, where
  rem_total = free + evictable KV - sum over running of
  min(max_new_tokens - generated, 4096) * new_token_ratio - what this batch already took.
  Admission stops at the first request that does not fit (no skipping), at
  max_running_requests, or when the batch already computes 16384 prompt tokens
  (max_prefill_tokens). The matched prefix is locked before the check. On an idle server
  the head is admitted whenever its prefill fits, so it cannot wait forever (SGLang
  clamps max_new_tokens to the pool for the same reason).
* new_token_ratio (`scheduler.py` init_schedule_policy / update_running_batch, `environ.py`):
  starts at 0.7, falls by (0.7 - 0.7 * 0.14) / 600 per decode step to 0.098, and is reset by
  a retraction to min(1, (decoded + 20 * n) / sum(max_new_tokens)) over the n survivors.
* Retraction (`managers/schedule_batch.py`, retract_decode): when a decode step cannot get
  one KV slot per running request (after evicting the cache), requests are retracted,
  fewest generated tokens first (ties: longest prompt), until 20 slots per survivor are
  free; at least one goes, the last one never. A retracted request loses the KV of what it
  generated (its prompt stays cached, unlocked), goes to the back of the queue and is
  prefilled again later: prompt (often a cache hit) + its tokens so far (recomputed,
  counted). A lone request that still has no slot is aborted.
* Prefix cache (`mem_cache/radix_cache.py`, via `sim.radix`): a prefill inserts its tokens
  and locks them; a finished request inserts prompt + output and unlocks.
* KV accounting: a sequence holds prompt + generated tokens (SGLang writes a token's KV one
  step later; one token per request of difference). num_used_tokens = pool - free -
  evictable, as `_get_token_info` in `managers/scheduler_metrics_mixin.py`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sim.gpujob import CLIP_MAX_NEW_TOKENS, DECODE, PREFILL, Job, Step, StepStats
from sim.radix import RadixCache
from sim.steplaw import StepLaw

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = INIT_NEW_TOKEN_RATIO * 0.14
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
RETRACT_DECODE_STEPS = 20
MAX_PREFILL_TOKENS = 16384
LONE_OOM_MESSAGE = "KV cache pool is full: the only running request has no KV slot left."


@dataclass
class GpuScheduler:
    """Waiting queue, running batch, KV pool and prefix cache of one simulated GPU."""

    law: StepLaw
    kv_tokens: int
    max_running_requests: int
    waiting: deque[Job] = field(default_factory=deque)
    running: list[Job] = field(default_factory=list)
    cache: RadixCache = field(default_factory=RadixCache)
    new_token_ratio: float = INIT_NEW_TOKEN_RATIO
    #: KV slots held by running requests outside the tree (their uncached tokens).
    private_tokens: int = 0
    stats: StepStats = field(default_factory=StepStats)

    # ---- memory ------------------------------------------------------------------------

    @property
    def free_tokens(self) -> int:
        """KV slots nobody holds, not even the cache."""
        return self.kv_tokens - self.cache.total_tokens - self.private_tokens

    def available_tokens(self) -> int:
        """Slots an allocation can get: free ones plus cache that can be evicted."""
        return self.free_tokens + self.cache.evictable_tokens

    @property
    def used_tokens(self) -> int:
        """SGLang's num_used_tokens: held by running requests, locked cache included."""
        return self.kv_tokens - self.available_tokens()

    def _alloc(self, tokens: int) -> None:
        if self.free_tokens < tokens:
            self.cache.evict(tokens - self.free_tokens)
        assert self.free_tokens >= tokens, "allocation beyond the KV pool"
        self.private_tokens += tokens

    # ---- requests in and out -------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue a new request."""
        self.waiting.append(job)

    def abort(self, job: Job, message: str) -> None:
        """Abort job: at once if waiting, at the start of the next step if running."""
        if job.done:
            return
        job.abort_message = message
        if job in self.waiting:
            self.waiting.remove(job)
            job.done = True

    def _release(self, job: Job) -> None:
        """Job leaves the batch: its sequence goes to the cache, its lock is dropped."""
        self.private_tokens -= job.private_tokens
        self.cache.insert(job.fill_ids())
        self._unlock(job)
        job.done = True

    def _unlock(self, job: Job) -> None:
        if job.node is not None:
            self.cache.dec_lock(job.node)
        job.node, job.locked_len = None, 0

    # ---- one forward pass ------------------------------------------------------------------

    def step(self) -> Step | None:
        """Run the next forward pass; None when there is nothing to do (idle)."""
        ended = [j for j in self.running if j.abort_message is not None]
        for job in ended:
            self._release(job)
        self.running = [j for j in self.running if not j.done]
        before = list(self.running)
        step = self._prefill() or self._decode()
        if step is None:
            self.new_token_ratio = INIT_NEW_TOKEN_RATIO
            return None
        step.ended.extend(ended)
        for job in step.jobs:
            if job.generated >= job.target and not job.done:
                self._release(job)
                step.ended.append(job)
        step.ended.extend(j for j in before if j.done and j not in step.ended)  # lone OOM
        self.running = [j for j in self.running if not j.done]
        self.stats.record(step)
        return step

    def owed_recompute(self) -> tuple[int, int]:
        """Retracted requests still waiting, and the output tokens they will compute again
        (their prompts may still be cached): work a throughput measured now has not paid."""
        owed = [job.generated for job in self.waiting if job.retractions]
        return len(owed), sum(owed)

    def _prefill(self) -> Step | None:
        admitted = self._admit()
        if not admitted:
            return None
        uncached = hit = tokens = 0
        for job, matched in admitted:
            self.waiting.remove(job)
            ids = job.fill_ids()
            extend = len(ids) - matched
            if job.retractions:
                self.stats.recomputed_tokens_total += extend
            else:
                job.cached_tokens = min(matched, len(job.prompt))
            self._alloc(extend)
            self.private_tokens -= extend  # the tree takes these slots over (or frees dupes)
            self.cache.insert(ids)
            self._unlock(job)
            job.locked_len, job.node = self.cache.match_prefix(ids)
            self.cache.inc_lock(job.node)
            if job.generated < job.target:
                self._alloc(1)
                job.generated += 1
                tokens += 1
            self.running.append(job)
            uncached, hit = uncached + extend, hit + matched
        jobs = [job for job, _ in admitted]
        duration = self.law.prefill_s(uncached)
        return Step(PREFILL, duration, jobs, tokens, uncached_tokens=uncached, hit_tokens=hit)

    def _admit(self) -> list[tuple[Job, int]]:
        """PrefillAdder: the queue head(s) that fit the KV estimate, with matched lengths."""
        if not self.waiting or len(self.running) >= self.max_running_requests:
            return []
        rem_total = self.available_tokens() - sum(
            _reserve(j) * self.new_token_ratio for j in self.running
        )
        rem_input, admitted = MAX_PREFILL_TOKENS, list[tuple[Job, int]]()
        for job in list(self.waiting):
            if len(self.running) + len(admitted) >= self.max_running_requests:
                break
            ids = job.fill_ids()
            matched, node = self.cache.match_prefix(ids[:-1])  # at least one token to compute
            protected = self.cache.protected_tokens
            self.cache.inc_lock(node)
            rem_total -= self.cache.protected_tokens - protected
            extend = len(ids) - matched
            total = extend + _reserve(job)
            alone = not self.running and not admitted and extend < self.available_tokens()
            if (total >= rem_total and not alone) or (admitted and extend >= rem_input):
                self.cache.dec_lock(node)
                break
            job.node = node  # held until the prefill replaces it with the full sequence
            rem_total, rem_input = rem_total - total, rem_input - extend
            admitted.append((job, matched))
        return admitted

    def _decode(self) -> Step | None:
        if not self.running:
            return None
        retracted = self._check_decode_mem()
        if not self.running:
            return Step(DECODE, 0.0, [], retracted=retracted)
        kv_read = sum(j.seq_len for j in self.running)
        self._alloc(len(self.running))
        for job in self.running:
            job.generated += 1
        duration = self.law.decode_s(len(self.running), kv_read)
        jobs = list(self.running)
        return Step(DECODE, duration, jobs, len(jobs), retracted=retracted)

    def _check_decode_mem(self) -> list[Job]:
        """update_running_batch: decay new_token_ratio, or retract when slots run out."""
        if self.available_tokens() >= len(self.running):
            self.new_token_ratio = max(
                self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO
            )
            return []
        order = sorted(self.running, key=lambda j: (j.generated, -len(j.prompt)), reverse=True)
        retracted: list[Job] = []
        while len(order) > 1 and (
            not retracted or self.available_tokens() < RETRACT_DECODE_STEPS * len(order)
        ):
            job = order.pop()
            self._retract(job)
            retracted.append(job)
        self.running = order
        decoded = sum(j.generated for j in order)
        wanted = sum(j.max_new_tokens for j in order)
        ratio = (decoded + RETRACT_DECODE_STEPS * len(order)) / wanted if wanted else 1.0
        self.new_token_ratio = min(1.0, ratio)
        if self.available_tokens() < len(order):  # a lone request the pool cannot hold
            order[0].abort_message = LONE_OOM_MESSAGE
            self._release(order[0])
            self.running = []
        return retracted

    def _retract(self, job: Job) -> None:
        """Free job's uncached KV (its cached prompt stays, unlocked) and requeue it."""
        self.stats.count_retraction(job)
        self.private_tokens -= job.private_tokens
        self._unlock(job)
        job.retractions += 1
        self.waiting.append(job)


def _reserve(job: Job) -> int:
    """Tokens the admission estimate sets aside for job's future output."""
    return min(max(job.max_new_tokens - job.generated, 0), CLIP_MAX_NEW_TOKENS)
