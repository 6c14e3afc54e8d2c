"""Every Redis key and queue name datagen uses, in one place.

No other module spells a key string; tests import these functions too.

    key                                   type    written by                      TTL
    ------------------------------------  ------  ------------------------------  ----
    datagen:store                         string  the first command to pair this  none
                                                  Redis with a results database:
                                                  that database's store_id
    datagen:datasets                      set     producer (SADD name)            none
    datagen:ds:{name}:ledger              hash    Lua only (ledger.py)            none
        used           tokens charged so far on the dataset's basis
        samples        samples charged so far (at 0 tokens too: not kept, basis kept)
        sumsq          sum of squared sample costs (admission's spread estimate)
        budget         budget in tokens
        basis          "output" | "total" | "kept" (for people; the scripts read
                       prompt_weight and kept_only)
        prompt_weight  1 if prompt tokens count, else 0 (Budget.prompt_weight)
        kept_only      1 if only kept samples are charged, else 0 (Budget.kept_only)
        policy         "drain" | "abort" | "exact"
        state          "open" | "closed"
        reserved       expected tokens of requests in flight (admission)
        closed_at      unix seconds of the close        (set once, at the close)
        close_reason   "budget" | "manual" | "stopped" (common/failures.py)
        used_at_close  ``used`` when the close happened
    datagen:ds:{name}:charged             hash    Lua only: sample_id -> tokens    none
    datagen:ds:{name}:inflight            hash    Lua only: rid -> expected tokens none
    datagen:ds:{name}:started             set     workers add, Lua removes: rids   none
                                                  of a drain dataset's requests the
                                                  server has started (first token
                                                  streamed); removed with the rid's
                                                  inflight entry (charge, release)
    datagen:workers                       zset    workers: name -> last heartbeat none
    datagen:worker:{name}:tags            set     that worker: delivery tags of   none
                                                  the messages it holds unacked
    datagen:worker:{name}:rids            set     that worker: rids of its        2 x dead
                                                  requests in flight (heartbeat)   after
    datagen:reaper                        string  the worker reaping dead ones    20 s
    datagen:sweeper                       string  the worker re-enqueueing lost    5 min
                                                  prompts (SQL queued, not in Redis)
    datagen:rebuilt                       string  the worker that rebuilt this     none
                                                  Redis from SQL: when (unix s);
                                                  absent = Redis lost its data
    datagen:rebuilding                    string  the worker rebuilding it now     2 min
    datagen:server_loads                  hash    the worker polling the servers:  2 x poll
                                                  server URL -> its /v1/loads,     interval
                                                  as ServerLoad JSON (server_loads.py)
    datagen:server_loads:poll             string  the worker polling them now      1 poll
                                                                                   interval
    datagen:auto_limits                   hash    the worker polling the servers:  10 x poll
                                                  server URL -> the fleet's        interval,
                                                  concurrency limit there, as      >= 60 s
                                                  LimitState JSON (concurrency.py)
    datagen.q.{name} (+ kombu's \\x06\\x16{3,6,9} priority lists)
                                          list    kombu (Celery's Redis transport)
    unacked                               hash    kombu: delivery tag -> message  none
                                                  delivered, not yet acked
    unacked_index                         zset    kombu: delivery tag -> delivery none
                                                  time, beside ``unacked``
"""

from __future__ import annotations

from dataclasses import dataclass

from common.names import validate_dataset_name

PREFIX = "datagen"
# The store_id of the SQL database whose queues and ledgers this Redis holds (pairing.py).
STORE_ID = f"{PREFIX}:store"
DATASETS = f"{PREFIX}:datasets"
WORKERS = f"{PREFIX}:workers"
REAPER_LOCK = f"{PREFIX}:reaper"
SWEEPER_LOCK = f"{PREFIX}:sweeper"
# Written once a worker has rebuilt every ledger and queue from SQL: a Redis that comes
# back without it lost its data, and the first worker to see that rebuilds it at once.
REBUILT = f"{PREFIX}:rebuilt"
REBUILD_LOCK = f"{PREFIX}:rebuilding"
# The servers' loads, read by one worker per interval and shared with every other.
SERVER_LOADS = f"{PREFIX}:server_loads"
SERVER_LOADS_LOCK = f"{PREFIX}:server_loads:poll"
# The fleet's requests in flight at each server under concurrency auto, stepped by the
# worker that polled the loads.
AUTO_LIMITS = f"{PREFIX}:auto_limits"
QUEUE_PREFIX = f"{PREFIX}.q."

# kombu's Redis transport keeps one list per priority step: the bare queue name for
# step 0 and ``name + sep + step`` for the others. ``celery_config`` keeps two steps (a
# conversation's next turns in the bare name, new prompts in step 3's list); a purge
# still deletes all four, for lists an older version or another client filled.
KOMBU_PRIORITY_SEP = "\x06\x16"
KOMBU_PRIORITY_STEPS = (0, 3, 6, 9)
# The two steps the app uses: a conversation's next turns (the bare name), new prompts.
AHEAD_PRIORITY = 0
PROMPT_PRIORITY = 3
# kombu's Redis transport keeps delivered, unacked messages under these names (its
# defaults); ``celery_config`` names them in its transport options and sets none that
# renames them (``global_keyprefix``), which a test checks against a channel the app opens.
KOMBU_UNACKED = "unacked"
KOMBU_UNACKED_INDEX = "unacked_index"


@dataclass(frozen=True)
class DatasetKeys:
    """The keys of one dataset, built once from a validated name."""

    name: str
    ledger: str
    charged: str
    inflight: str
    queue: str
    started: str

    @property
    def prompts(self) -> str:
        """The list new prompts wait in (their priority step's)."""
        return _priority_list(self.queue, PROMPT_PRIORITY)

    @property
    def queue_lists(self) -> tuple[str, ...]:
        return tuple(_priority_list(self.queue, step) for step in KOMBU_PRIORITY_STEPS)

    @property
    def script_keys(self) -> list[str]:
        """KEYS of the ledger's scripts, in the order common/ledger_scripts.py reads them."""
        return [self.ledger, self.charged, self.inflight, *self.queue_lists, self.started]


def dataset_keys(name: str) -> DatasetKeys:
    validate_dataset_name(name)
    base = f"{PREFIX}:ds:{name}"
    return DatasetKeys(
        name=name,
        ledger=f"{base}:ledger",
        charged=f"{base}:charged",
        inflight=f"{base}:inflight",
        queue=queue_name(name),
        started=f"{base}:started",
    )


def worker_tags(worker: str) -> str:
    return f"{PREFIX}:worker:{worker}:tags"


def worker_rids(worker: str) -> str:
    return f"{PREFIX}:worker:{worker}:rids"


def queue_name(dataset: str) -> str:
    return QUEUE_PREFIX + validate_dataset_name(dataset)


def dataset_of_queue(queue: str) -> str | None:
    if not queue.startswith(QUEUE_PREFIX):
        return None
    return queue[len(QUEUE_PREFIX) :]


def _priority_list(queue: str, step: int) -> str:
    return queue if step == 0 else f"{queue}{KOMBU_PRIORITY_SEP}{step}"
