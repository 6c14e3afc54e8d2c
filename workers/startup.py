"""A worker started before Redis or the database waits for them, one line per service.

In compose, Redis, PostgreSQL and the workers start together, so a worker often comes
first. It waits here, in Celery's ``worker_init`` (before the consumer connects and
before the ledgers are rebuilt), saying at most every ``NOTE_EVERY_S`` which service it
waits for and why, and gives up after ``Settings.start_wait_s``: a URL that stays wrong
is then an exit its supervisor sees, not a worker that waits for ever.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from common.errors import ServiceUnavailable
from common.services import database_problem, redis_problem, safe_url
from common.settings import Settings

log = logging.getLogger("datagen.worker")
NOTE_EVERY_S = 15.0
# SGLang is not waited for here: tasks wait for it themselves, uncounted (a model can take
# many minutes to load). A line says so this often until every server answers.
SGLANG_NOTE_S = 30.0
POLL_S = 1.0

Probe = Callable[[str], "str | None"]


def services(settings: Settings) -> list[tuple[str, str, str, Probe]]:
    """(name, URL, setting, probe) of each service a worker needs before it starts."""
    return [("Redis", settings.redis_url, "DATAGEN_REDIS_URL", redis_problem),
            ("the database", settings.database_url, "DATAGEN_DATABASE_URL", database_problem)]


def wait_for_services(settings: Settings, poll_s: float = POLL_S,
                      note_every_s: float = NOTE_EVERY_S) -> float:
    """Return once Redis and the database answer (the seconds waited); ServiceUnavailable
    after ``settings.start_wait_s``."""
    started = time.monotonic()
    noted: dict[str, float] = {}  # service -> when its last line was written
    while True:
        down = {name: (url, env, why) for name, url, env, probe in services(settings)
                if (why := probe(url)) is not None}
        now = time.monotonic()
        for name, url, _env, _probe in services(settings):
            if name in noted and name not in down:
                log.warning("%s at %s answers", name, safe_url(url))
                del noted[name]
        if not down:
            return now - started
        if now - started >= settings.start_wait_s:
            name, (url, env, why) = next(iter(down.items()))
            raise ServiceUnavailable(
                f"{name} at {safe_url(url)} did not answer within {settings.start_wait_s:.0f} s "
                f"({why}); start it or set {env}")
        for name, (url, _env, why) in down.items():
            if now - noted.get(name, now - note_every_s) >= note_every_s:
                log.warning("waiting for %s at %s: %s", name, safe_url(url), why)
                noted[name] = now
        time.sleep(poll_s)


def watch_sglang(check: Callable[[], list[str]], every_s: float = SGLANG_NOTE_S,
                 stop: threading.Event | None = None) -> threading.Thread:
    """A daemon thread saying every ``every_s`` which SGLang servers do not answer yet
    (``check``: their problems), until each does."""
    halt = stop or threading.Event()

    def run() -> None:
        while not halt.wait(every_s):
            problems = check()
            if not problems:
                log.warning("every SGLang server answers now")
                return
            for problem in problems:
                log.warning("waiting for SGLang at %s", problem)

    thread = threading.Thread(target=run, daemon=True, name="datagen-sglang-wait")
    thread.start()
    return thread
