"""The worker's Celery app: ``celery -A workers worker`` and ``datagen worker`` start it.

A threads pool sized for IO-bound HTTP: each slot spends its life waiting on SGLang, and
one process with 64 threads fits where 64 prefork children would not.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from typing import Any

import redis
from celery import Celery, current_app, signals
from celery.exceptions import CPendingDeprecationWarning

from common.celery_app import make_celery
from common.db import UNAVAILABLE
from common.errors import ConfigError, ServiceUnavailable, StoreMismatch
from common.publish import Publisher
from common.reconcile import reconcile_all
from common.services import short_reason
from common.settings import Settings
from workers.context import get_context
from workers.liveness import Heartbeat, Received
from workers.load_poller import LoadPolling
from workers.metrics import WorkerMetrics, ledger_for_scrapes, serve
from workers.queues import DatasetQueues
from workers.recovery import recover
from workers.startup import wait_for_services, watch_sglang
from workers.tasks import register_tasks

log = logging.getLogger("datagen.worker")
# The exit status of a worker whose Redis or database did not answer in start_wait_s, as
# of every datagen command that meets a service down.
EXIT_UNAVAILABLE = 3
# As every datagen command given a setting it cannot use.
EXIT_BAD_INPUT = 2
# A service that stopped answering: nothing about the data is known to be wrong.
_GONE: tuple[type[Exception], ...] = (redis.RedisError, ServiceUnavailable, *UNAVAILABLE)


def create_app(settings: Settings) -> Celery:
    app = make_celery(settings, main="datagen-worker")
    app.conf.update(worker_pool="threads", worker_concurrency=settings.threads)
    app.datagen_settings = settings  # type: ignore[attr-defined]
    app.datagen_received = Received()  # type: ignore[attr-defined]
    app.datagen_metrics = WorkerMetrics()  # type: ignore[attr-defined]
    register_tasks(app, settings)
    app.steps["consumer"].add(DatasetQueues)
    app.steps["consumer"].add(LoadPolling)
    return app


def prepare(app: Celery) -> None:
    """Before consuming: rebuild the ledger from SQL (and the queues, if Redis lost its
    data), give PostgreSQL's planner statistics on the prompts if it has none, and say
    which servers are down."""
    ctx = get_context(app)
    try:
        reconciled = reconcile_all(ctx.store, ctx.ledger)
        recover(ctx.store, ctx.ledger.redis, Publisher(app))
    except StoreMismatch as exc:
        # Logged plainly, without a traceback: an error raised in this signal would only
        # be logged too. The consumer's start refuses the same Redis and ends the worker.
        log.error("%s", exc)
        return
    except _GONE as exc:
        # A service that went away again since it answered: the heartbeat rebuilds what
        # this could not once it is back.
        log.error("rebuilding from SQL at start failed (%s); the heartbeat tries again",
                  short_reason(exc))
        return
    for r in reconciled:
        if r.tokens_added or r.closed_now:
            log.info("reconciled %s: +%d tokens, closed now: %s", r.name, r.tokens_added,
                     r.closed_now)
    if ctx.store.ensure_statistics():
        log.info("gathered the planner's statistics on the prompt tables, which had none")
    problems = ctx.client.check_servers()
    for problem in problems:
        log.warning("SGLang server not answering at start: %s", problem)
    if problems:
        # Stopped at shutdown (_stop_watching): a worker run inside another process (tests,
        # an embedding program) must not keep logging after it ends.
        app.datagen_sglang_watch = threading.Event()  # type: ignore[attr-defined]
        watch_sglang(ctx.client.check_servers,
                     stop=app.datagen_sglang_watch)  # type: ignore[attr-defined]


def _ours(app: Any) -> bool:
    return isinstance(app, Celery) and hasattr(app, "datagen_settings")


def liveness_id(consumer: Any) -> str:
    """Node name and pid: two `celery worker`s started on one host without -n share a name."""
    return f"{consumer.hostname}/{os.getpid()}"


def _quiet_cancel_advice() -> None:
    """Celery advises ``worker_cancel_long_running_tasks_on_connection_loss`` at every
    connection loss while it is off; it is off on purpose (common/celery_app.py). Set once
    the worker is ready: Celery's log set-up, which comes later than worker_init, turns its
    own warnings back on."""
    warnings.filterwarnings("ignore", message=r"\s*In Celery 5\.1 we introduced",
                            category=CPendingDeprecationWarning)


def _redis(app: Celery) -> redis.Redis:
    return get_context(app).ledger.redis


@signals.worker_init.connect
def _prepare_on_start(sender: Any = None, **_: Any) -> None:
    if _ours(getattr(sender, "app", None)):
        threads = getattr(sender, "concurrency", None)
        conf = sender.app.datagen_settings
        if isinstance(threads, int) and threads > 0 and threads != conf.threads:
            # `-c N` wins over DATAGEN_CONCURRENCY (auto included): the shared steps'
            # groups are sized to the threads this worker really runs (workers/context.py).
            sender.app.datagen_settings = conf.replace(concurrency=threads)
        _serve_metrics(sender.app)
        try:
            wait_for_services(sender.app.datagen_settings)
        except ServiceUnavailable as exc:
            log.error("%s", exc)
            # SystemExit passes through Celery's signal dispatch, which logs any Exception
            # with its traceback and goes on starting.
            raise SystemExit(EXIT_UNAVAILABLE) from None
        prepare(sender.app)


def _serve_metrics(app: Celery) -> None:
    """Serve /metrics from the start, so a worker still waiting for its services is seen
    (``datagen_worker_up`` 0, ``datagen_ledger_up`` 0) rather than missing."""
    conf = app.datagen_settings  # type: ignore[attr-defined]
    if not conf.metrics_port:
        return
    try:
        app.datagen_metrics_server = serve(  # type: ignore[attr-defined]
            app.datagen_metrics, conf.metrics_port,  # type: ignore[attr-defined]
            ledger_for_scrapes(conf.redis_url))
    except ConfigError as exc:
        log.error("%s", exc)
        raise SystemExit(EXIT_BAD_INPUT) from None
    log.info("serving Prometheus metrics on port %d (/metrics)", conf.metrics_port)


@signals.worker_ready.connect
def _start_heartbeat(sender: Any = None, **_: Any) -> None:
    if _ours(getattr(sender, "app", None)):
        _quiet_cancel_advice()
        conf = sender.app.datagen_settings
        metrics = sender.app.datagen_metrics
        beat = Heartbeat(sender.app, _redis(sender.app), liveness_id(sender),
                         sender.app.datagen_received, conf.heartbeat_s, conf.dead_after_s,
                         conf.sweep_s, conf.sweep_quiet_s, on_beat=metrics.beat)
        sender.app.datagen_heartbeat = beat
        beat.start()
        metrics.up.set(1)


@signals.worker_shutting_down.connect
def _not_up(**_: Any) -> None:
    # Sent with the worker's name only: the app is this process's current one. Its
    # requests may run for many minutes more; it takes no new ones.
    app = current_app._get_current_object()
    if _ours(app):
        app.datagen_metrics.up.set(0)


@signals.worker_shutdown.connect
def _stop_metrics(sender: Any = None, **_: Any) -> None:
    server = getattr(getattr(sender, "app", None), "datagen_metrics_server", None)
    if server is not None:
        server.shutdown()
        server.server_close()


@signals.worker_shutdown.connect
def _stop_heartbeat(sender: Any = None, **_: Any) -> None:
    beat = getattr(getattr(sender, "app", None), "datagen_heartbeat", None)
    if beat is not None:
        beat.stop()


@signals.worker_shutdown.connect
def _stop_watching(sender: Any = None, **_: Any) -> None:
    watching = getattr(getattr(sender, "app", None), "datagen_sglang_watch", None)
    if watching is not None:
        watching.set()


@signals.worker_shutdown.connect
def _report_groups(sender: Any = None, **_: Any) -> None:
    ctx = getattr(getattr(sender, "app", None), "datagen_context", None)
    if ctx is not None:
        for step, group in (("admissions", ctx.admissions), ("settlements", ctx.settlements)):
            n = max(1, group.batches)
            log.info("shared steps: %d %s in %d groups; a group's leader: %.2f ms, "
                     "%.2f ms of CPU", group.items, step, group.batches,
                     1000 * group.serve_s / n, 1000 * group.serve_cpu_s / n)


@signals.task_received.connect
def _track(sender: Any = None, request: Any = None, **_: Any) -> None:
    if _ours(getattr(sender, "app", None)) and request is not None:
        tag = getattr(getattr(request, "message", None), "delivery_tag", None)
        if tag:
            sender.app.datagen_received.add(tag)
