"""Runtime-adjustable fault injection (`POST /sim/faults`).

Faults exist so that clients' retry, timeout and bookkeeping paths can be tested against
the failures a real GPU fleet produces: 500s, full queues (503), dropped connections,
slow answers, dead servers and aborted generations. Random faults use their own seeded
random source, so a test run with a fixed seed and request order is reproducible.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, fields
from typing import Any

from sim.config import SimConfig

#: What an incoming /generate request should suffer.
OK, ERROR, DISCONNECT = "ok", "error", "disconnect"

_FLOAT_KEYS = ("error_rate", "disconnect_rate", "latency_s", "decode_tok_per_s", "time_scale")
_INT_KEYS = ("error_status", "fail_next", "disconnect_next", "abort_next",
             "max_running_requests")


@dataclass
class Faults:
    """Current fault settings; counters (`*_next`) count down as requests consume them."""

    error_rate: float = 0.0
    error_status: int = 500
    fail_next: int = 0
    disconnect_rate: float = 0.0
    disconnect_next: int = 0
    latency_s: float = 0.0
    decode_tok_per_s: float = 100.0
    abort_next: int = 0
    #: GPU mode: the running cap and the speed now (a server losing half its KV to a
    #: neighbour, a slower node); 0 = as started.
    max_running_requests: int = 0
    time_scale: float = 0.0
    #: time.monotonic() until which the server plays dead; 0 = up.
    down_until: float = 0.0

    @classmethod
    def from_config(cls, cfg: SimConfig) -> Faults:
        """Initial faults as given on the command line."""
        return cls(
            error_rate=float(cfg.error_rate),
            error_status=cfg.error_status,
            disconnect_rate=float(cfg.disconnect_rate),
            latency_s=float(cfg.latency_s),
            decode_tok_per_s=float(cfg.decode_tok_per_s),
        )

    def is_down(self) -> bool:
        """True while a `down_for_s` outage lasts."""
        return self.down_until > 0 and time.monotonic() < self.down_until

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a /sim/faults body; ValueError names the first bad key (nothing applied)."""
        staged: dict[str, Any] = {}
        for key, value in changes.items():
            staged[key] = _coerce(key, value)
        for key, value in staged.items():
            if key == "down_for_s":
                self.down_until = time.monotonic() + value if value > 0 else 0.0
            else:
                setattr(self, key, value)

    def snapshot(self) -> dict[str, Any]:
        """Current settings as JSON, with the outage shown as seconds left."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "down_until"}
        out["down_for_s"] = max(0.0, self.down_until - time.monotonic()) if self.is_down() else 0.0
        return out


def _coerce(key: str, value: Any) -> Any:
    """Type-check one fault value: numbers must be non-negative, ints must be ints."""
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    if key in _FLOAT_KEYS or key == "down_for_s":
        if not numeric or value < 0:
            raise ValueError(f"{key} must be a non-negative number, got {value!r}")
        if key.endswith("_rate") and value > 1:
            raise ValueError(f"{key} must be in [0, 1], got {value!r}")
        return float(value)
    if key in _INT_KEYS:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{key} must be a non-negative integer, got {value!r}")
        if key == "error_status" and not 400 <= value <= 599:
            raise ValueError(f"error_status must be an HTTP error status, got {value!r}")
        return value
    known = ", ".join((*_FLOAT_KEYS, *_INT_KEYS, "down_for_s"))
    raise ValueError(f"unknown fault {key!r}; known: {known}")


class FaultInjector:
    """Decides, per request, which fault (if any) applies."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.faults = Faults.from_config(cfg)
        self.rng = random.Random(cfg.seed)

    def reset(self) -> None:
        """Back to the command-line settings and a fresh random source."""
        self.faults = Faults.from_config(self.cfg)
        self.rng = random.Random(self.cfg.seed)

    def draw(self) -> str:
        """OK, ERROR or DISCONNECT for the next /generate request (consumes counters)."""
        f = self.faults
        if f.disconnect_next > 0:
            f.disconnect_next -= 1
            return DISCONNECT
        if f.fail_next > 0:
            f.fail_next -= 1
            return ERROR
        if f.disconnect_rate > 0 and self.rng.random() < f.disconnect_rate:
            return DISCONNECT
        if f.error_rate > 0 and self.rng.random() < f.error_rate:
            return ERROR
        return OK

    def take_abort(self) -> bool:
        """True if this request must end in an abort (`abort_next`)."""
        if self.faults.abort_next > 0:
            self.faults.abort_next -= 1
            return True
        return False
