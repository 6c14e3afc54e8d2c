"""``datagen demo``: the whole job end to end on embedded defaults.

The simulator stands in for a GPU SGLang server; results go to SQLite (datagen.db unless
DATAGEN_DATABASE_URL says otherwise); Redis is the configured one, or a private
redis-server started for the run when none answers or the configured one holds another
database's queues and ledgers (common/pairing.py). Running it again resumes: nothing
done is generated twice.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import redis
import sqlalchemy as sa
from rich.console import Console
from rich.live import Live
from rich.table import Table

from common.console import make_console
from common.ledger import Ledger
from common.pairing import paired_elsewhere
from common.services import connect, safe_url
from common.settings import Settings
from common.store import Store
from ops.localredis import LocalRedis, answers
from ops.status import collect, render
from producer.template import BUNDLED_TOKENIZER

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RUN_TIMEOUT_S = 600
RESULTS_QUERY = """
SELECT dataset,
       COUNT(*)                                             AS samples,
       SUM(completion_tokens)                               AS output_tokens,
       ROUND(AVG(completion_tokens), 1)                     AS mean_tokens,
       SUM(CASE WHEN finish_reason = 'length' THEN 1 ELSE 0 END) AS cut_by_length,
       SUM(CASE WHEN finish_reason = 'budget' THEN 1 ELSE 0 END) AS cut_at_budget,
       ROUND(AVG(e2e_latency_s), 2)                         AS mean_latency_s
FROM results GROUP BY dataset ORDER BY dataset
"""


def _start_sim(stack: ExitStack) -> str:
    from sim import SimConfig, SimServer

    sim = SimServer(SimConfig(port=0, max_running_requests=48, decode_tok_per_s=400,
                              mean_output_tokens=300, tokenizer=str(BUNDLED_TOKENIZER)))
    url = sim.start()
    stack.callback(sim.stop)
    return url


def _start_workers(stack: ExitStack, settings: Settings, n: int, concurrency: int) -> None:
    for i in range(n):
        # Workers on one host cannot share a metrics port: the next ones take the next.
        port = settings.metrics_port + i if settings.metrics_port else 0
        env = {**os.environ, **settings.replace(metrics_port=port).to_env()}
        proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "worker", "--concurrency", str(concurrency),
             "--loglevel", "WARNING"],
            env=env,
        )
        stack.callback(_stop, proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def _enqueue(settings: Settings) -> None:
    env = {**os.environ, **settings.to_env()}
    subprocess.run(
        [sys.executable, "-m", "ops.cli", "enqueue", "--manifest",
         str(EXAMPLES / "datasets.toml"), "--max-new-tokens", "2048", "--max-seq-len", "8192"],
        env=env, check=True,
    )


def _wait(settings: Settings, console: Console) -> None:
    store, ledger = connect(settings)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    with Live(render(collect(store, ledger)), console=console, auto_refresh=False) as live:
        while time.monotonic() < deadline:
            rows = collect(store, ledger)
            live.update(render(rows), refresh=True)
            if all(r.state != "open" or r.done + r.failed + r.skipped == r.prompts
                   for r in rows) and not any(r.inflight for r in rows):
                return
            time.sleep(1)
    raise TimeoutError(f"the demo run did not finish in {RUN_TIMEOUT_S}s")


def _show_query(settings: Settings, console: Console) -> None:
    with Store(settings.database_url, settings.db_connections).engine.connect() as conn:
        res = conn.execute(sa.text(RESULTS_QUERY))
        table = Table(title="SQL over results:" + RESULTS_QUERY.rstrip(), title_justify="left")
        columns = res.keys()
        for col in columns:
            table.add_column(col, justify="left" if col == "dataset" else "right")
        for row in res:
            table.add_row(*(str(v) for v in row))
    console.print(table)


def _why_a_private_redis(settings: Settings) -> str | None:
    """Why the configured Redis cannot serve this run, or None when it can."""
    if not answers(settings.redis_url):
        return "no Redis answered"
    store = Store(settings.database_url, settings.db_connections)
    if paired_elsewhere(store, Ledger(redis.Redis.from_url(settings.redis_url))):
        # Another checkout's or an earlier, deleted database's run: left alone, not merged.
        return (f"the Redis at {safe_url(settings.redis_url)} holds another results "
                f"database's queues and ledgers, not {store.describe()}'s")
    return None


def run_demo(args: argparse.Namespace, settings: Settings) -> int:
    console = make_console()
    with ExitStack() as stack:
        why = _why_a_private_redis(settings)
        if why:
            local = LocalRedis()
            stack.callback(local.stop)
            settings = settings.replace(redis_url=local.start())
            console.print(f"{why}; started a private one at {settings.redis_url}")
        sim_url = _start_sim(stack)
        settings = settings.replace(sglang_urls=(sim_url,), tokenizer=str(BUNDLED_TOKENIZER))
        console.print(f"simulated SGLang (stands in for a GPU server) at {sim_url}; "
                      f"results in {settings.database_url}")
        _enqueue(settings)
        _start_workers(stack, settings, args.workers, args.concurrency)
        _wait(settings, console)
    _show_query(settings, console)
    return 0
