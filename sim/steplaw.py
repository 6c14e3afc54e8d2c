"""How long one forward pass of the simulated GPU takes, and the `reference` profile.

The law (simulated seconds):

    decode step  = t0 + a * batch + c * kv_tokens
    prefill step = t0 + p * uncached_prompt_tokens

`batch` is the number of running sequences (each gains one token per decode step) and
`kv_tokens` the KV entries the step reads (prompt + generated, summed over the batch):
a decode step is a fixed launch/sampling cost, a per-sequence cost and an attention cost
that grows with the context it reads. A prefill step pays for the prompt tokens the prefix
cache did not already hold.

Calibration of `reference` (the reference run's server: 159K KV tokens, ~930 output tok/s
at ~40 running requests with ~4K-token outputs and 1-2K-token prompts):

    t0 = 19 ms, a = 0.2 ms per sequence, c = 0.1 µs per KV token, p = 0.1 ms per token
    (i.e. 10K prompt tokens/s of prefill).

    Steady state, n = 40 running, prompt P = 1500, output O = 4096: a sequence is on
    average halfway through its output, so it holds P + O/2 = 3548 KV tokens and the
    batch reads 40 * 3548 = 141,920 (89% of the 159K pool).
        decode step  = 0.019 + 40 * 0.0002 + 141,920 * 1e-7      = 41.19 ms
        prefills     : one request finishes every O/n = 102.4 steps and its successor
                       costs 0.019 + 1500 * 1e-4 = 169 ms, i.e. 1.65 ms per decode step
        throughput   = 40 tokens / (41.19 + 1.65) ms             = 934 tok/s

`steady_state_tok_per_s` is that arithmetic; a test pins it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepLaw:
    """Durations of forward passes, in simulated seconds."""

    #: Fixed cost of any forward pass (kernel launches, sampling, scheduling).
    t0_s: float = 0.019
    #: Decode cost per running sequence.
    a_s_per_seq: float = 0.0002
    #: Decode cost per KV token read.
    c_s_per_kv_token: float = 1e-7
    #: Prefill cost per uncached prompt token.
    p_s_per_token: float = 1e-4

    def decode_s(self, batch: int, kv_tokens: int) -> float:
        """One decode step of `batch` sequences reading `kv_tokens` KV entries."""
        return self.t0_s + self.a_s_per_seq * batch + self.c_s_per_kv_token * kv_tokens

    def prefill_s(self, uncached_tokens: int) -> float:
        """One prefill step computing `uncached_tokens` prompt tokens."""
        return self.t0_s + self.p_s_per_token * uncached_tokens


@dataclass(frozen=True)
class Profile:
    """A named server: its step law and KV pool size."""

    law: StepLaw
    kv_tokens: int


#: The reference run's server (see the module docstring for the calibration). With the
#: default cap of 48 running requests the KV pool, not the cap, keeps ~40 running.
PROFILES = {"reference": Profile(StepLaw(), kv_tokens=159_000)}


def steady_state_tok_per_s(
    law: StepLaw, running: int, prompt_tokens: int, output_tokens: int
) -> float:
    """Output tokens/s of `running` sequences in steady state, prefills included."""
    kv_tokens = running * (prompt_tokens + output_tokens / 2)
    prefills_per_step = running / output_tokens
    step_s = law.decode_s(running, round(kv_tokens)) + prefills_per_step * law.prefill_s(
        prompt_tokens
    )
    return running / step_s
