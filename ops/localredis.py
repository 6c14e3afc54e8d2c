"""A private, throw-away redis-server for the demo when no Redis answers."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

import redis

from common.errors import ServiceUnavailable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


class LocalRedis:
    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir = tempfile.mkdtemp(prefix="datagen-redis-")
        self.url = ""

    def start(self) -> str:
        exe = shutil.which("redis-server")
        if exe is None:
            raise ServiceUnavailable(
                "no Redis answers and redis-server is not installed: install Redis "
                "(e.g. apt-get install redis-server) or set DATAGEN_REDIS_URL"
            )
        port = free_port()
        self.proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while not answers(self.url):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise ServiceUnavailable("could not start a local redis-server")
            time.sleep(0.05)
        return self.url

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)
