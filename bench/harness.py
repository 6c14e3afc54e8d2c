"""Processes and services of the benchmarks: the simulator, workers, Redis and SQL.

Every process started here belongs to a :class:`Processes` stack that stops it on exit,
even on failure: SIGTERM, then SIGKILL after a grace period. Traffic goes to 127.0.0.1.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import redis
import requests
import sqlalchemy as sa
from redis.utils import HIREDIS_AVAILABLE

from common.db import sqlalchemy_url
from common.schema import metadata
from common.settings import Settings
from ops.localredis import free_port
from producer.template import BUNDLED_TOKENIZER
from tests.isolation import create_database

REDIS_URL = os.environ.get("DATAGEN_BENCH_REDIS_URL", "redis://127.0.0.1:6379/11")
POSTGRES_URL = os.environ.get(
    "DATAGEN_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/bench"
)
# The same database as SQLAlchemy names it with the driver the project installs.
POSTGRES_SA_URL = sqlalchemy_url(POSTGRES_URL)
WORKDIR = Path(os.environ.get("DATAGEN_BENCH_DIR", "/tmp/datagen-bench"))
ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
STOP_GRACE_S = 30.0


class Processes:
    """Child processes stopped in reverse order on exit (terminate → kill)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: Sequence[str], env: dict[str, str] | None = None,
              log: Path | None = None) -> subprocess.Popen[bytes]:
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        try:
            proc = subprocess.Popen(list(argv), env={**os.environ, **(env or {})}, cwd=ROOT,
                                    stdout=out, stderr=subprocess.STDOUT)
        finally:
            if log:
                out.close()  # type: ignore[union-attr]
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if proc in self.procs:
            self.procs.remove(proc)

    def __enter__(self) -> Processes:
        stop_on_signals()
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(list(self.procs)):
            self.stop(proc, grace_s=10.0)


def _raise_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def stop_on_signals() -> None:
    """SIGTERM and SIGINT unwind the stack (so every ``Processes`` stops its children),
    even when SIGINT was inherited as ignored (a background job of a shell)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _raise_exit)


def wait_until(pred: Callable[[], bool], timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval_s)
    return pred()


# -- the simulator ---------------------------------------------------------------------------

def start_sim(procs: Processes, *, slots: int = 48, decode: float = 0.0, mean_output: int = 300,
              extra: Sequence[str] = (), name: str = "sim") -> tuple[str, subprocess.Popen[bytes]]:
    """``datagen sim`` as its own process, with the bundled tokenizer; returns (url, proc).

    Often a benchmark's first write to its directory: it takes the directory (and makes
    it) here, before the simulator's log goes there."""
    hold_locks()
    port = free_port()
    argv = [sys.executable, "-m", "ops.cli", "sim", "--host", "127.0.0.1", "--port", str(port),
            "--max-running-requests", str(slots), "--decode-tok-per-s", str(decode),
            "--mean-output-tokens", str(mean_output), "--tokenizer", str(BUNDLED_TOKENIZER),
            *extra]
    log = WORKDIR / f"{name}.log"
    proc = procs.start(argv, log=log)
    url = f"http://127.0.0.1:{port}"
    if not wait_until(lambda: _answers(url), 30):
        raise RuntimeError(f"datagen sim did not answer on {url}; see {log}")
    return url, proc


def _answers(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=1).status_code == 200
    except requests.RequestException:
        return False


def sim_reset(url: str, **faults: Any) -> None:
    requests.post(f"{url}/sim/reset", timeout=10).raise_for_status()
    if faults:
        requests.post(f"{url}/sim/faults", json=faults, timeout=10).raise_for_status()


def sim_requests(url: str) -> list[dict[str, Any]]:
    resp = requests.get(f"{url}/sim/requests", timeout=60)
    resp.raise_for_status()
    return list(resp.json())


def sim_completed(url: str) -> int:
    stats = requests.get(f"{url}/sim/stats", timeout=10).json()
    return int(stats["completed"]) + int(stats["aborted"]) + int(stats["errors"])


# -- workers ---------------------------------------------------------------------------------

def start_worker(procs: Processes, settings: Settings, concurrency: int | Literal["auto"],
                 tag: str = "worker") -> subprocess.Popen[bytes]:
    """``datagen worker`` as ``ops/demo.py`` starts it: a subprocess with settings.to_env()."""
    argv = [sys.executable, "-m", "ops.cli", "worker", "--concurrency", str(concurrency),
            "--loglevel", "WARNING"]
    return procs.start(argv, env=settings.to_env(), log=WORKDIR / f"{tag}.log")


def bench_settings(db_url: str, sim_url: str,
                   concurrency: int | Literal["auto"] = 64) -> Settings:
    return Settings(redis_url=REDIS_URL, database_url=db_url, sglang_urls=(sim_url,),
                    tokenizer=str(BUNDLED_TOKENIZER), concurrency=concurrency,
                    request_timeout_s=600, retry_base_s=0.2, retry_max_s=2.0)


# The shortest real load-poll interval: each poll is a /v1/loads request and a Redis step.
MIN_POLL_S = 0.02
# How often a worker polls a server's load by default, in the server's seconds.
SERVER_POLL_S = Settings().load_poll_s


def scaled_poll_s(time_scale: float, server_s: float = SERVER_POLL_S) -> float:
    """The real load-poll interval that polls every ``server_s`` of a time-scaled
    simulator's clock, as a worker polls an unscaled server. Unscaled, auto's first steps
    (from a limit of 2, at most doubling a poll) take the time scale times longer on the
    server's clock than on a real server: 30 simulated seconds a poll at a scale of 30."""
    return max(MIN_POLL_S, server_s / time_scale)


# -- services --------------------------------------------------------------------------------

_locks: list[Any] = []
LOCK_WAIT_S = 7200.0


def hold_locks() -> None:
    """Run alone: one benchmark at a time per Redis database and per bench directory.

    Benchmarks flush their Redis DB and rewrite their directory, so a second run against
    either would corrupt both. The locks are flock()s, released when the process exits.
    """
    if _locks:
        return
    WORKDIR.mkdir(parents=True, exist_ok=True)
    for key in (REDIS_URL, str(WORKDIR.resolve())):
        digest = hashlib.sha1(key.encode()).hexdigest()[:12]
        fh = open(f"/tmp/datagen-bench-{digest}.lock", "w")  # noqa: SIM115
        deadline, told = time.monotonic() + LOCK_WAIT_S, False
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told:
                    print(f"another benchmark holds {key}; waiting", file=sys.stderr, flush=True)
                    told = True
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{key} stayed locked for {LOCK_WAIT_S:.0f}s") from None
                time.sleep(1.0)
        _locks.append(fh)


def fresh_redis() -> redis.Redis:
    """The benchmarks' own Redis database, emptied."""
    hold_locks()
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    return client


def fresh_db(kind: str, tag: str = "bench") -> str:
    """An empty SQLite file or the emptied ``bench`` PostgreSQL database; returns its URL."""
    hold_locks()
    if kind == "sqlite":
        path = WORKDIR / f"{tag}.db"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        return f"sqlite:///{path}"
    if kind == "postgresql":
        url = sa.make_url(POSTGRES_SA_URL)
        create_database(url)
        engine = sa.create_engine(url)
        metadata.drop_all(engine)
        engine.dispose()
        return POSTGRES_URL
    raise ValueError(f"unknown database kind {kind!r}")


def clean_workdir() -> None:
    hold_locks()
    shutil.rmtree(WORKDIR / "tmp", ignore_errors=True)
    (WORKDIR / "tmp").mkdir(parents=True, exist_ok=True)


# -- process accounting ----------------------------------------------------------------------

def _stat(path: Path) -> list[str] | None:
    """The fields of a /proc stat file after the command name (which may hold spaces);
    None once the process or thread is gone."""
    try:
        return path.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _cpu(stat: Path) -> float:
    """User + system CPU so far of the process or thread whose stat file this is."""
    fields = _stat(stat)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK if fields else 0.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) so far."""
    return _cpu(Path(f"/proc/{pid}/stat"))


MACHINE, STEAL = "machine", "steal"  # keys of machine_seconds, beside the processes'


def machine_seconds() -> dict[str, float]:
    """CPU seconds the machine has been busy so far (every process, every core: user,
    nice, system, interrupts; not idle, iowait or steal), and those the hypervisor gave
    to other guests (steal: this machine's share of a noisy host), from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return {MACHINE: (user + nice + system + irq + softirq) / CLK_TCK, STEAL: steal / CLK_TCK}


DATABASE = "database"  # key prefix of the database server's processes in a leg's CPU


def database_seconds(url: str) -> dict[str, float]:
    """CPU seconds so far of each process of the PostgreSQL server at ``url`` when it runs
    on this machine (its backends and its own workers: WAL writer, checkpointer...), as
    ``database:<pid>``; nothing for SQLite, which runs in the worker. One connection
    asks, and its own backend is left out."""
    engine_url = sa.make_url(sqlalchemy_url(url))
    if not engine_url.drivername.startswith("postgresql") or engine_url.host not in (
            "127.0.0.1", "localhost"):
        return {}
    engine = sa.create_engine(engine_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            pids = conn.scalars(sa.text(
                "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid()")).all()
    except sa.exc.DBAPIError:
        return {}
    finally:
        engine.dispose()
    return {f"{DATABASE}:{pid}": cpu_seconds(pid) for pid in pids
            if Path(f"/proc/{pid}").exists()}


def redis_pid(url: str) -> int | None:
    """The Redis server's pid when it runs on this machine (its CPU is then measurable)."""
    client = redis.Redis.from_url(url)
    try:
        if client.connection_pool.connection_kwargs.get("host") not in ("127.0.0.1",
                                                                          "localhost"):
            return None
        pid = int(client.info("server")["process_id"])
    except (redis.RedisError, KeyError, ValueError):
        return None
    finally:
        client.close()
    return pid if Path(f"/proc/{pid}").exists() else None


def running(pid: int) -> bool:
    """The process exists and has not exited (an unreaped child is a zombie, state Z)."""
    fields = _stat(Path(f"/proc/{pid}/stat"))
    return fields is not None and fields[0] != "Z"


def context_switches(pid: int) -> int:
    """Voluntary + involuntary context switches of a process's live threads so far.

    Each is a thread that blocked (I/O, a lock, the GIL) or was preempted: in a worker of
    many threads, the count per task measures the hand-offs a task's path costs.
    """
    return sum(_switches(status) for status in Path(f"/proc/{pid}/task").glob("*/status"))


def main_thread(pid: int) -> tuple[float, int]:
    """CPU seconds and context switches of a process's main thread so far: in a Celery
    worker, the consumer that takes every message, apart from the pool's threads."""
    thread = Path(f"/proc/{pid}/task/{pid}")
    return _cpu(thread / "stat"), _switches(thread / "status")


def _switches(status: Path) -> int:
    try:
        lines = status.read_text().splitlines()
    except OSError:  # the thread ended while we read
        return 0
    return sum(int(line.split()[1]) for line in lines
               if line.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def machine() -> dict[str, Any]:
    model = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    # redis-py parses replies in C with hiredis and in Python without: a worker's CPU per
    # task differs by about a fifth, so a result says which it had.
    return {"nproc": os.cpu_count(), "cpu": model, "ram_gb": round(mem_kb / 1024**2, 1),
            "loadavg": os.getloadavg()[0], "python": platform.python_version(),
            "hiredis": HIREDIS_AVAILABLE}
