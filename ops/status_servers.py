"""The SGLang servers' side of ``datagen status``: what each says of its load.

Read from each server's ``/v1/loads`` when status runs (common/server_loads.py), side by
side, so a silent server costs one short timeout, not one per server. A server that gives
no reading (down, an SGLang without the endpoint, a router in front) is listed with the
reason instead of numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from rich import box
from rich.table import Table

from common.concurrency import LimitState
from common.server_loads import ServerLoad, fetch_loads
from common.settings import Settings, masked

NO_READING = "no answer from /v1/loads"


@dataclass(frozen=True)
class ServerStatus:
    url: str
    running: int | None = None
    waiting: int | None = None
    max_running: int | None = None
    token_usage: float | None = None
    cache_hit_rate: float | None = None
    retracted_waiting: int | None = None
    gen_throughput: float | None = None
    # The fleet's requests in flight allowed there under concurrency auto (None: no
    # worker polls the servers, or none gave a reading).
    auto_limit: int | None = None
    error: str | None = None


def server_row(url: str, load: ServerLoad | None, auto_limit: int | None = None
               ) -> ServerStatus:
    if load is None:
        return ServerStatus(masked(url), error=NO_READING)
    return ServerStatus(
        masked(url), running=load.running, waiting=load.waiting, max_running=load.max_running,
        token_usage=round(load.token_usage, 4), cache_hit_rate=round(load.cache_hit_rate, 4),
        retracted_waiting=load.retracted_waiting,
        gen_throughput=round(load.gen_throughput, 1), auto_limit=auto_limit)


def collect_servers(settings: Settings, headers: Mapping[str, str] | None = None,
                    limits: Mapping[str, LimitState] | None = None) -> list[ServerStatus]:
    """Each server's load, and ``limits``: the fleet's concurrency auto states."""
    if headers is None and settings.sglang_api_key:
        headers = {"Authorization": f"Bearer {settings.sglang_api_key}"}
    loads = fetch_loads(settings.sglang_urls, headers=headers)
    limits = limits or {}
    return [server_row(url, loads[url], limits[url].limit if url in limits else None)
            for url in settings.sglang_urls]


def servers_json(rows: Sequence[ServerStatus]) -> list[dict[str, object]]:
    return [asdict(r) for r in rows]


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:.0%}"


def render_servers(rows: Sequence[ServerStatus]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True)
    for col in ("server", "running", "waiting", "KV used", "cache hit", "retracted\nwaiting",
                "tok/s", "auto\nlimit"):
        table.add_column(col, justify="left" if col == "server" else "right")
    for r in rows:
        if r.error is not None:
            table.add_row(r.url, r.error, "", "", "", "", "", "")
            continue
        table.add_row(r.url, f"{r.running:,} / {r.max_running:,}", f"{r.waiting:,}",
                      _pct(r.token_usage), _pct(r.cache_hit_rate), f"{r.retracted_waiting:,}",
                      f"{r.gen_throughput:,.1f}",
                      "" if r.auto_limit is None else f"{r.auto_limit:,}")
    return table
