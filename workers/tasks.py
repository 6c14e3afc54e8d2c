"""The Celery task: thin. It unpacks ids, runs the pipeline, and maps errors to retries."""

from __future__ import annotations

import logging
import random
from typing import NoReturn

import redis
from celery import Celery, Task
from celery.exceptions import Reject

from common.db import UNAVAILABLE
from common.errors import PermanentError, ServerUnreachable, StoreMismatch, TransientError
from common.messages import GENERATE_TASK
from common.settings import Settings
from workers.context import WorkerContext, get_context
from workers.liveness import stop_this_worker
from workers.metrics import Retry
from workers.pipeline import OUTAGE_WINDOW_S, Outcome, run_sample, wait_out_outage
from workers.stopping import stop_if_systematic

log = logging.getLogger(__name__)
# How long a task waits for its dataset's in-flight requests when admission says "wait".
ADMISSION_WAIT_S = 2.0
INFRASTRUCTURE_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, *UNAVAILABLE)
# A server that refuses connections is retried at a steady, capped pace until it is back.
UNREACHABLE_BACKOFF_STEP = 4


def backoff_s(settings: Settings, attempt: int, hint_s: float = 0.0) -> float:
    """Exponential backoff with full jitter, never below the server's own hint."""
    ceiling = min(settings.retry_max_s, settings.retry_base_s * 2 ** max(0, attempt - 1))
    return max(hint_s, random.uniform(ceiling / 2, ceiling))


def register_tasks(app: Celery, settings: Settings) -> Task:
    @app.task(name=GENERATE_TASK, bind=True, max_retries=None, acks_late=True, shared=False)
    def generate(self: Task, dataset: str, sample_id: str) -> str:
        try:
            return _attempt(self, get_context(app), settings, dataset, sample_id)
        except StoreMismatch as exc:
            # This Redis now belongs to another results database, and so does the message
            # that came from it: back to the head of its queue, for that run's workers.
            stop_this_worker(str(exc))
            raise Reject(str(exc), requeue=True) from None
        except INFRASTRUCTURE_ERRORS as exc:
            # Redis or the database did not answer: nothing about the sample is known to be
            # wrong, so it waits and tries again, uncounted, rather than being acked and lost.
            delay = backoff_s(settings, UNREACHABLE_BACKOFF_STEP)
            log.warning("%s/%s: %s: %s; retry in %.1fs (not counted as an attempt)",
                        dataset, sample_id, type(exc).__name__, exc, delay)
            get_context(app).metrics.retried(dataset, Retry.UNAVAILABLE)
            send_retry(self, delay)

    return generate


def _attempt(task: Task, ctx: WorkerContext, settings: Settings, dataset: str,
             sample_id: str) -> str:
    try:
        outcome = run_sample(ctx, dataset, sample_id)
    except ServerUnreachable as exc:
        ctx.store.record_attempt(dataset, sample_id, str(exc), count=False)
        delay = backoff_s(settings, UNREACHABLE_BACKOFF_STEP)
        log.warning("%s/%s: %s; retry in %.1fs (not counted as an attempt)",
                    dataset, sample_id, exc, delay)
        ctx.metrics.retried(dataset, Retry.UNREACHABLE)
        send_retry(task, delay)
    except TransientError as exc:
        attempts = ctx.store.record_attempt(dataset, sample_id, str(exc))
        if attempts >= settings.max_attempts:
            return _fail(ctx, dataset, sample_id, f"after {attempts} attempts: {exc}")
        delay = backoff_s(settings, attempts, exc.delay_s)
        log.info("%s/%s attempt %d failed (%s); retry in %.1fs",
                 dataset, sample_id, attempts, exc, delay)
        ctx.metrics.retried(dataset, Retry.ERROR)
        send_retry(task, delay)
    except PermanentError as exc:
        ctx.store.record_attempt(dataset, sample_id, str(exc))
        failed = _fail(ctx, dataset, sample_id, str(exc))
        stop_if_systematic(ctx, dataset, str(exc))
        return failed
    if outcome is Outcome.WAIT:
        ctx.metrics.retried(dataset, Retry.BUDGET_WAIT)
        send_retry(task, ADMISSION_WAIT_S * random.uniform(1, 1.5))
    if outcome is Outcome.GATED:
        # Sent again as a new message: the one it held had waited long, unacked.
        ctx.metrics.retried(dataset, Retry.GATE_WAIT)
        send_retry(task, ADMISSION_WAIT_S * random.uniform(1, 1.5))
    return outcome.value


def send_retry(task: Task, countdown: float, window_s: float = OUTAGE_WINDOW_S) -> NoReturn:
    """``task.retry(countdown=...)``, sent again and again while Redis does not take it.

    Celery turns a retry it cannot send into a reject without requeue. With Redis still
    away, that reject fails too and the message waits in the unacked hash for the
    visibility timeout (41 minutes by default); with Redis back, the message is dropped and
    its prompt stays queued in SQL with no message until the workers' sweep. A task that
    met a Redis outage is the one most likely to meet it again here, so it waits the outage
    out (up to ``window_s``) holding its message, and sends its retry once Redis answers.
    """
    def send() -> NoReturn:
        raise task.retry(countdown=countdown) from None  # sent: Celery acks the message

    wait_out_outage(send, window_s, retry_on=(Reject,),
                    failing=lambda: f"could not send the retry of {task.request.id}")


def _fail(ctx: WorkerContext, dataset: str, sample_id: str, error: str) -> str:
    log.warning("%s/%s failed: %s", dataset, sample_id, error)
    ctx.store.mark_failed(dataset, sample_id, error)
    ctx.metrics.failed.labels(dataset).inc()
    return "failed"
