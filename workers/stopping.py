"""Stopping a dataset whose prompts all fail the same way (common/failures.py says why).

Called after a prompt failed permanently. The stop is a close with the reason
``stopped``: the ledger's CLOSE marks it and purges its queue in one atomic step, and
only the task whose CLOSE did it goes on to record it in SQL and revoke what workers
hold, exactly as the task whose charge crosses a budget does.
"""

from __future__ import annotations

import logging

import redis

from common.closing import after_close
from common.db import UNAVAILABLE
from common.failures import STOPPED, streak
from workers.context import WorkerContext
from workers.pipeline import wait_out_outage

log = logging.getLogger(__name__)


def stop_if_systematic(ctx: WorkerContext, dataset: str, error: str) -> bool:
    """Stop ``dataset`` if its last failures, with no result between them, all had
    ``error``; True if this call stopped it."""
    limit = ctx.settings.stop_after_failures
    if limit <= 0:
        return False
    failed = streak(ctx.store, dataset, error)
    if failed < limit:
        return False
    if not ctx.ledger.close(dataset, STOPPED).closed_now:
        return False  # closed already: by its budget, by hand, or by another task's stop
    ctx.metrics.closes.labels(dataset, STOPPED).inc()
    log.warning("dataset %s stopped: %d prompts in a row failed with: %s. Its other prompts "
                "stay queued; fix the cause, then `datagen retry %s`",
                dataset, failed, error, dataset)
    # Only this task knows of the stop, so it waits out an outage to record it.
    wait_out_outage(lambda: after_close(dataset, store=ctx.store, ledger=ctx.ledger,
                                        app=ctx.app, client=ctx.client),
                    retry_on=(*UNAVAILABLE, redis.RedisError))
    return True
