"""Throw-away services for fault injection: a private redis-server that may be crashed,
wiped and restarted on the same port (the PostgreSQL cluster is in faultkit_pg), datagen
worker subprocesses, and the simulator on a fixed port with its request log. Used by
tests/test_faults_*.py and bench/reliability.py.

Everything started here is stopped by ``close()`` (the classes are context managers), so a
failing test leaves no process behind. The shared servers on 6379/5432 are never touched.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
import requests

from common.keys import WORKERS, worker_tags
from common.replies import texts
from common.settings import Settings
from ops.localredis import answers, free_port

ROOT = Path(__file__).resolve().parent.parent


def wait_for(predicate: Any, timeout_s: float, what: str, every_s: float = 0.1) -> float:
    """Poll until ``predicate()`` is true; returns the seconds waited, raises on timeout."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)
    return time.monotonic() - started


class PrivateRedis:
    """A redis-server without persistence: a crash loses every key, as in production
    without AOF. ``restart_empty`` brings up a new, empty one on the same port."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="datagen-faults-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def _listen(self) -> list[str]:
        """redis-server's arguments for where and how it listens."""
        return ["--port", str(self.port)]

    def start(self) -> str:
        exe = shutil.which("redis-server")
        assert exe, "redis-server is not installed"
        log = Path(self.dir) / "redis.log"
        self.proc = subprocess.Popen(
            [exe, *self._listen(), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--logfile", str(log)],
            cwd=self.dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for(lambda: answers(self.url), 10, f"redis-server on port {self.port}", 0.05)
        return self.url

    def crash(self) -> None:
        """SIGKILL: no shutdown, no save; every key is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart_empty(self, down_s: float = 0.0) -> None:
        self.crash()
        time.sleep(down_s)
        self.start()

    def blip(self) -> int:
        """CLIENT KILL TYPE normal: every client connection drops (not this one)."""
        client = redis.Redis.from_url(self.url)
        try:
            return int(client.client_kill_filter(_type="normal", skipme=True))
        finally:
            client.close()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def close(self) -> None:
        self.crash()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PrivateRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PrivateTlsRedis(PrivateRedis):
    """A redis-server that speaks TLS only, with a throw-away CA and server certificate
    (openssl, made once for all its restarts); ``url`` carries the CA, so clients verify
    the server."""

    def __init__(self, port: int | None = None) -> None:
        super().__init__(port)
        openssl = shutil.which("openssl")
        assert openssl, "openssl is not installed"
        d = Path(self.dir)

        def run(*argv: str) -> None:
            subprocess.run([openssl, *argv], cwd=d, check=True, capture_output=True)

        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
            "-out", "ca.crt", "-days", "1", "-subj", "/CN=datagen-test-ca")
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
            "server.csr", "-subj", "/CN=127.0.0.1")
        (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
        run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", "ext.cnf")
        self.url = (f"rediss://127.0.0.1:{self.port}/0"
                    f"?ssl_cert_reqs=required&ssl_ca_certs={d / 'ca.crt'}")

    def _listen(self) -> list[str]:
        return ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", "server.crt",
                "--tls-key-file", "server.key", "--tls-ca-cert-file", "ca.crt",
                "--tls-auth-clients", "no"]


class Workers:
    """``datagen worker`` subprocesses, as operators run them, logging into one file."""

    def __init__(self, settings: Settings, log: Path) -> None:
        self.settings = settings
        self.log = log
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.concurrency: dict[str, int] = {}
        self.exits: list[tuple[str, int]] = []

    def start(self, name: str, concurrency: int = 8, **env: str) -> subprocess.Popen[bytes]:
        self.concurrency[name] = concurrency
        full_env = {**os.environ, **self.settings.to_env(), **env}
        with self.log.open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ops.cli", "worker", "-c", str(concurrency),
                 "--loglevel", "INFO", "-n", f"{name}@localhost"],
                env=full_env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
            )
        self.procs[name] = proc
        return proc

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def revive(self) -> list[tuple[str, int]]:
        """Start again, under a new name, every worker that exited: what a supervisor
        (compose's ``restart: unless-stopped``) does. Returns (name, exit code) of each."""
        dead = [(n, p.returncode) for n, p in self.procs.items() if p.poll() is not None]
        for name, _code in dead:
            self.procs.pop(name)
            self.start(f"{name}r", self.concurrency[name])
        self.exits += dead
        return dead

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def close(self, timeout_s: float = 20.0) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL whatever has not exited in time."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.procs.clear()

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def held_unacked(client: redis.Redis, worker: str) -> set[str]:
    """Delivery tags of the messages worker ``worker`` (started as ``worker@localhost``)
    holds unacked, as its heartbeat registered them."""
    mine = [n for n in texts(client.zrange(WORKERS, 0, -1))
            if n.startswith(f"{worker}@localhost/")]
    tags = {t for n in mine for t in texts(client.smembers(worker_tags(n)))}
    return {t for t in tags if client.hexists("unacked", t)}


def run_cli(settings: Settings, *argv: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """``datagen ARGV`` in a subprocess with these settings; output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "ops.cli", *argv], env={**os.environ, **settings.to_env()},
        capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
    )


class Sim:
    """The simulator on a fixed port with a JSONL request log, so it can be stopped and
    started again on the same address and its log still holds every request."""

    def __init__(self, log_file: Path, port: int = 0, **config: Any) -> None:
        from sim import SimConfig

        self.port = port or free_port()
        self.log_file = log_file
        self.config = SimConfig(port=self.port, request_log=str(log_file), **config)
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: Any = None

    def start(self) -> str:
        from sim import SimServer

        self.server = SimServer(self.config)
        self.server.start()
        return self.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def restart(self, down_s: float) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()

    def __enter__(self) -> Sim:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def sim_faults(sim_url: str, **faults: Any) -> dict[str, Any]:
    resp = requests.post(f"{sim_url}/sim/faults", json=faults, timeout=5)
    resp.raise_for_status()
    return dict(resp.json())


def sim_reset(sim_url: str) -> None:
    requests.post(f"{sim_url}/sim/reset", timeout=5).raise_for_status()


def sim_log(sim_url: str) -> list[dict[str, Any]]:
    return list(requests.get(f"{sim_url}/sim/requests", timeout=10).json())
