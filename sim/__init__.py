"""SGLang-compatible simulator: a real HTTP server speaking SGLang's native API.

Tests and demos cannot run SGLang (no GPU), so `datagen sim` stands in for it with the
same wire format (shared/SGLANG_API.md), continuous-batching timing, deterministic
outputs, aborts and injectable faults. See `sim.server` for the routes.
"""

from sim.config import SimConfig
from sim.server import SimServer, main

__all__ = ["SimConfig", "SimServer", "main"]
