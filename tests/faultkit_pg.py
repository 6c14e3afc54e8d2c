"""A throw-away PostgreSQL cluster for fault tests: initdb in a temp dir, a free port, run
as the ``postgres`` OS user (initdb refuses root), stopped and removed by ``close()``. The
shared server on 5432 is never touched."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from ops.localredis import free_port


def pg_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
    assert found, "PostgreSQL server binaries not found under /usr/lib/postgresql/*/bin"
    return Path(found[-1])


class PrivatePostgres:
    """A PostgreSQL cluster in a temp dir on a free port, run as the ``postgres`` user."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="datagen-faults-pg-"))
        self.data = self.dir / "data"
        self.bin = pg_bin()
        self.running = False
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")

    def _run(self, *cmd: str) -> None:
        argv = [str(self.bin / cmd[0]), *cmd[1:]]
        if os.geteuid() == 0:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       timeout=60)

    def start(self) -> str:
        if not self.data.exists():
            self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust",
                      "-E", "UTF8", "--no-sync")
        opts = (f"-p {self.port} -c listen_addresses=127.0.0.1 "
                f"-c unix_socket_directories={self.dir} -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off")
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.dir / "pg.log"),
                  "-w", "-t", "30", "start")
        self.running = True
        return self.url

    def stop(self, mode: str = "fast") -> None:
        """``fast`` ends every session at once (a restart); ``immediate`` is a crash."""
        if self.running:
            self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "30", "stop")
            self.running = False

    def restart(self, down_s: float, mode: str = "fast") -> None:
        self.stop(mode)
        time.sleep(down_s)
        self.start()

    def close(self) -> None:
        try:
            self.stop("immediate")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PrivatePostgres:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
