"""Configuration of the simulated SGLang server.

One flat dataclass, because every field is also a CLI flag of `datagen sim` (same name with
dashes) and tests build it directly: `SimConfig(port=0, decode_tok_per_s=0)`. `physics`
picks the engine: "fast" (sim.engine, the default) or "gpu" (sim.gpu).
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.steplaw import PROFILES

#: Version string reported by /server_info: the SGLang release whose wire format we copy.
SIM_VERSION = "0.5.23-sim"

#: Seconds between two decode wake-ups of a streaming request (one SSE chunk each).
STREAM_CHUNK_S = 0.05

#: Longest single sleep of a non-streaming request, so runtime speed changes and
#: disconnect checks take effect within this delay.
NONSTREAM_STEP_S = 0.5


@dataclass
class SimConfig:
    """Start-up settings; the fault fields are only initial values (see /sim/faults)."""

    host: str = "127.0.0.1"
    port: int = 30000
    max_running_requests: int = 48
    #: Decode speed of each running sequence in tokens/s; 0 means instant.
    decode_tok_per_s: float = 100.0
    mean_output_tokens: int = 300
    context_length: int = 32768
    model_name: str = "datagen-sim"
    #: Directory with tokenizer.json (+ tokenizer_config.json); None = cheap fake vocab.
    tokenizer: str | None = None
    #: Load a tokenizer whose class is Python code in its folder (runs that code).
    trust_remote_code: bool = False
    #: Every Nth output token is the vocabulary's NUL token (the byte 0), which a real model
    #: can emit; 0: never. For tests of text that SQL cannot hold as it is.
    nul_every: int = 0
    #: JSONL file that gets one line per finished /generate request.
    request_log: str | None = None
    #: Waiting-queue bound; a request beyond it gets SGLang's 503. None = unbounded.
    max_queued_requests: int | None = None
    incremental_streaming_output: bool = False
    error_rate: float = 0.0
    error_status: int = 500
    disconnect_rate: float = 0.0
    latency_s: float = 0.0
    #: Seed of the random source used for fault injection (outputs depend on the prompt only).
    seed: int = 0
    #: aiohttp access log; off by default because it costs CPU at 400+ requests/s.
    access_log: bool = False
    #: In-memory request-log bound (oldest entries dropped first).
    log_capacity: int = 1_000_000
    #: "fast": N slots at decode_tok_per_s each; "gpu": a GPU server's physics (sim.gpu).
    physics: str = "fast"
    #: GPU mode: the server whose step law and KV pool to take (sim.steplaw.PROFILES).
    profile: str = "reference"
    #: GPU mode: KV pool size in tokens; None = the profile's.
    kv_tokens: int | None = None
    #: GPU mode: simulated seconds per real second (10 = ten times faster than real time).
    time_scale: float = 1.0

    @property
    def kv_pool_tokens(self) -> int:
        """GPU mode's KV pool: --kv-tokens, else the profile's."""
        return self.kv_tokens if self.kv_tokens is not None else PROFILES[self.profile].kv_tokens

    @property
    def max_total_num_tokens(self) -> int:
        """KV pool size /server_info and /v1/loads report."""
        if self.physics == "gpu":
            return self.kv_pool_tokens
        return self.context_length * self.max_running_requests  # every slot fits a context

    @property
    def max_req_input_len(self) -> int:
        """Longest prompt the scheduler admits: SGLang's min(ctx - 1, kv - 1) - 5."""
        if self.physics == "gpu":
            return min(self.context_length, self.kv_pool_tokens) - 1 - 5
        return self.context_length - 1 - 5
