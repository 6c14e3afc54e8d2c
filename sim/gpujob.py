"""The GPU mode's records: a request (`Job`), a forward pass (`Step`) and running totals."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sim.radix import Node

PREFILL, DECODE = "prefill", "decode"
#: SGLang clips a request's max_new_tokens to this in its KV estimates only.
CLIP_MAX_NEW_TOKENS = 4096
#: Steps over which gen_throughput is measured (SGLang's default decode_log_interval).
THROUGHPUT_WINDOW_STEPS = 40


@dataclass(eq=False)
class Job:
    """One request inside the GPU scheduler."""

    rid: str
    prompt: list[int]
    #: The output ids it will produce if nobody aborts it (already capped).
    output: list[int]
    max_new_tokens: int
    generated: int = 0
    #: meta_info.cached_tokens: prompt tokens its first prefill found in the cache.
    cached_tokens: int = 0
    retractions: int = 0
    #: Cache node its sequence is locked under, and how many of its tokens that covers.
    node: Node | None = None
    locked_len: int = 0
    abort_message: str | None = None
    done: bool = False

    @property
    def target(self) -> int:
        """Tokens to generate in all."""
        return len(self.output)

    @property
    def seq_len(self) -> int:
        """KV tokens the sequence holds while running."""
        return len(self.prompt) + self.generated

    @property
    def private_tokens(self) -> int:
        """KV tokens it holds outside the prefix cache (generated since its prefill)."""
        return self.seq_len - self.locked_len

    def fill_ids(self) -> list[int]:
        """Prompt plus the tokens generated so far: what a (re-)prefill computes."""
        return self.prompt + self.output[: self.generated]


@dataclass
class Step:
    """One forward pass and what it did."""

    kind: str
    duration_s: float
    jobs: list[Job]
    #: Output tokens the pass produced (one per decoded sequence, first tokens of prefills).
    tokens: int = 0
    uncached_tokens: int = 0
    hit_tokens: int = 0
    retracted: list[Job] = field(default_factory=list)
    #: Jobs that left the batch at this pass (finished or aborted).
    ended: list[Job] = field(default_factory=list)


@dataclass
class StepStats:
    """Totals and recent-window figures behind /v1/loads and /metrics (simulated time)."""

    clock_s: float = 0.0  # the server's clock: passes and idle time (sim.gpu adds it)
    busy_s: float = 0.0  # the passes alone
    generated_tokens_total: int = 0
    prompt_hit_tokens_total: int = 0
    prompt_uncached_tokens_total: int = 0
    #: Hit fraction of the latest prefill batch (SGLang's cache_hit_rate).
    last_cache_hit_rate: float = 0.0
    retracted_reqs_total: int = 0
    retracted_input_tokens_total: int = 0
    retracted_output_tokens_total: int = 0
    #: Tokens computed again because their KV was lost to a retraction.
    recomputed_tokens_total: int = 0
    #: Prefill passes and their seconds: each one stops the running batch's decoding.
    prefill_steps_total: int = 0
    prefill_s_total: float = 0.0
    window: deque[tuple[int, float, int]] = field(
        default_factory=lambda: deque(maxlen=THROUGHPUT_WINDOW_STEPS)
    )

    def record(self, step: Step) -> None:
        """Account one pass."""
        self.clock_s += step.duration_s
        self.busy_s += step.duration_s
        self.generated_tokens_total += step.tokens
        self.window.append((step.tokens, step.duration_s, len(step.retracted)))
        if step.kind == PREFILL:
            self.prefill_steps_total += 1
            self.prefill_s_total += step.duration_s
            self.prompt_hit_tokens_total += step.hit_tokens
            self.prompt_uncached_tokens_total += step.uncached_tokens
            seen = step.hit_tokens + step.uncached_tokens
            self.last_cache_hit_rate = step.hit_tokens / seen if seen else 0.0

    def count_retraction(self, job: Job) -> None:
        """Account one retracted request."""
        self.retracted_reqs_total += 1
        self.retracted_input_tokens_total += len(job.prompt)
        self.retracted_output_tokens_total += job.generated

    def gen_throughput(self) -> float:
        """Output tokens per simulated second over the last window of passes."""
        duration = sum(d for _, d, _ in self.window)
        return sum(t for t, _, _ in self.window) / duration if duration > 0 else 0.0

    def recent_retractions(self) -> int:
        """Requests retracted within the window (SGLang's num_retracted_reqs gauge)."""
        return sum(r for _, _, r in self.window)
