"""Everything one simulator instance owns, shared by its HTTP handlers."""

from __future__ import annotations

import time
from collections import Counter

from aiohttp import web

from sim.config import SimConfig
from sim.engine import Engine
from sim.faults import FaultInjector
from sim.gpu import GpuEngine
from sim.outputs import OutputModel
from sim.reqlog import RequestLog, RequestRecord


class SimState:
    """Config, output model, faults, engine, request log and counters of one server."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.outputs = OutputModel(cfg.mean_output_tokens, cfg.tokenizer,
                                   cfg.trust_remote_code, nul_every=cfg.nul_every)
        self.injector = FaultInjector(cfg)
        self.engine: Engine | GpuEngine = (
            GpuEngine(cfg, self.injector) if cfg.physics == "gpu" else Engine(cfg, self.injector)
        )
        self.log = RequestLog(cfg.request_log, cfg.log_capacity)
        self.started_ts = time.time()
        self.arrived = 0
        self.abort_calls = 0  # POST /abort_request received, whatever they matched
        self.finish_counts: Counter[str] = Counter()
        self.output_tokens = 0
        self.prompt_tokens = 0

    def record_done(self, record: RequestRecord) -> None:
        """Count a finished request and append it to the log."""
        self.finish_counts[record.finish_type] += 1
        self.output_tokens += record.completion_tokens
        self.prompt_tokens += record.prompt_tokens
        self.log.add(record)

    def reset(self) -> None:
        """`POST /sim/reset`: clear the log, faults and counters (in-flight work goes on)."""
        self.log.clear()
        self.injector.reset()
        self.arrived = 0
        self.abort_calls = 0
        self.finish_counts.clear()
        self.output_tokens = 0
        self.prompt_tokens = 0

    def stats(self) -> dict[str, object]:
        """`GET /sim/stats` payload."""
        counts = self.finish_counts
        return {
            "requests": self.arrived,
            "running": len(self.engine.running),
            "waiting": len(self.engine.waiting),
            "completed": counts["stop"] + counts["length"],
            "aborted": counts["abort"],
            "abort_calls": self.abort_calls,
            "errors": counts["error"],
            "disconnects": counts["disconnect"],
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "by_finish": dict(counts),
            "gen_throughput": self.engine.gen_throughput(),
            **self._clock(),
        }

    def _clock(self) -> dict[str, object]:
        """GPU mode: the simulated clock (passes and idle time), on which its throughput is
        measured; the seconds of its forward passes alone (what a real server's GPU would
        spend); the output tokens decoded, the requests retracted and the tokens computed
        again for them; the prefill passes, their seconds and the prompt tokens they
        computed; the retracted requests waiting, and the output tokens they will compute
        again. None in the fast mode, which runs in real time."""
        if not isinstance(self.engine, GpuEngine):
            return dict.fromkeys(_GPU_CLOCK)
        clock_s, generated = self.engine.clock()
        stats = self.engine.sched.stats
        owed_reqs, owed_tokens = self.engine.sched.owed_recompute()
        return {"sim_clock_s": clock_s, "simulated_s": stats.busy_s,
                "generated_tokens": generated,
                **{name: getattr(stats, name) for name in _STEP_TOTALS},
                "waiting_retracted": owed_reqs, "waiting_retracted_tokens": owed_tokens}


# StepStats' totals that /sim/stats passes on as they are.
_STEP_TOTALS = ("retracted_reqs_total", "recomputed_tokens_total", "prefill_steps_total",
                "prefill_s_total", "prompt_uncached_tokens_total")
_GPU_CLOCK = ("sim_clock_s", "simulated_s", "generated_tokens", *_STEP_TOTALS,
              "waiting_retracted", "waiting_retracted_tokens")

SIM_KEY: web.AppKey[SimState] = web.AppKey("sim", SimState)
