"""What a worker process holds for its whole life: store, ledger, HTTP client, caches."""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from celery import Celery

from common.celery_app import make_celery
from common.concurrency import FALLBACK
from common.errors import ConfigError
from common.ledger import ChargeResult, Ledger
from common.publish import Publisher
from common.routing import LoadRouter
from common.rows import ResultRow
from common.settings import Settings
from common.sglang_client import Completion, SGLangClient
from common.store import DatasetRow, Store
from common.tokenizer_files import code_class, load_tokenizer
from workers import steps
from workers.gate import Gate
from workers.grouping import MAX_GROUP, GroupCall, step_group
from workers.inflight import LiveRids
from workers.metrics import WorkerMetrics
from workers.results import ResultWriter
from workers.started import StartedMarks
from workers.turns import NextTurns

log = logging.getLogger(__name__)
DATASET_CACHE_S = 5.0
# The oldest terms a task goes on with while another thread re-reads them; older ones are
# waited for. So a row is never used longer than this after it was read, and a command
# that changes a dataset's sampling knows when no worker sends the old values any more.
DATASET_STALE_S = 2 * DATASET_CACHE_S
Decoder = steps.Decoder


@dataclass
class WorkerContext:
    settings: Settings
    store: Store
    ledger: Ledger
    client: SGLangClient
    app: Celery | None = None
    results: ResultWriter = field(init=False)
    admissions: GroupCall[steps.AdmitItem, steps.Admitted] = field(init=False)
    settlements: GroupCall[steps.SettleItem, steps.Settled] = field(init=False)
    next_turns: NextTurns = field(init=False)
    started: StartedMarks = field(init=False)  # drain's started marks
    live_rids: LiveRids = field(default_factory=LiveRids)
    gate: Gate | None = None  # concurrency auto's (workers/gate.py); None: fixed
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    _datasets: dict[str, tuple[float, DatasetRow]] = field(default_factory=dict)
    _decoders: dict[str, Decoder | None] = field(default_factory=dict)
    _reading: dict[str, threading.Lock] = field(default_factory=dict)  # one per dataset
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.results = ResultWriter(self.store)
        self.started = StartedMarks(self.ledger.mark_started)
        self.next_turns = NextTurns(self.store, self.settings.trust_remote_code, self.client)
        self.metrics.threads.set(self.settings.threads)
        most = max(1, min(MAX_GROUP, self.settings.threads))
        # With every slot busy, a worker's tasks are split between the two steps (and
        # their requests): a leader waiting for more than half of them would wait for
        # tasks that reach its step only after the other step's group is served, its whole
        # linger, while its own group's tasks hold their slots idle: at full rate that
        # wait, not CPU, would bound the worker.
        # Under auto most threads wait at the gate, outside both steps: half of what a
        # server runs at once (the fallback's 64 as its measure) is the mark.
        busy = self.settings.threads
        if self.settings.auto_concurrency:
            busy = min(busy, FALLBACK)
        enough = max(1, min(most, busy // 2))
        self.admissions = step_group(
            lambda items: steps.admit_group(self.store, self.ledger, items), most, enough)
        self.settlements = step_group(
            lambda items: steps.settle_group(self.store, self.ledger, self.result_row, items,
                                             self.next_turns.build), most, enough)

    @classmethod
    def build(cls, settings: Settings, app: Celery | None = None) -> WorkerContext:
        client = SGLangClient(
            settings.sglang_urls,
            connect_timeout_s=settings.connect_timeout_s,
            read_timeout_s=settings.request_timeout_s,
            api_key=settings.sglang_api_key,
            router=load_router(settings),
        )
        ledger = Ledger(redis.Redis.from_url(settings.redis_url, health_check_interval=25))
        store = Store(settings.database_url, settings.db_connections)
        # The app's metrics, when it has them: its server may be up before the context.
        metrics = getattr(app, "datagen_metrics", None) or WorkerMetrics()
        return cls(settings, store, ledger, client, app, metrics=metrics,
                   gate=auto_gate(settings))

    def dataset(self, name: str) -> DatasetRow:
        """The dataset's terms, re-read every few seconds so budget changes arrive.

        One thread re-reads them while the others go on with the terms they have (up to
        DATASET_STALE_S old): if every task reaching this point at full rate read the
        expired row at once, each would take a pooled connection of its own and warm up
        its cache."""
        cached = self._datasets.get(name)
        if cached is not None and time.monotonic() - cached[0] <= DATASET_CACHE_S:
            return cached[1]
        with self._lock:
            reading = self._reading.setdefault(name, threading.Lock())
        if cached is None or time.monotonic() - cached[0] > DATASET_STALE_S:
            reading.acquire()
        elif not reading.acquire(blocking=False):
            return cached[1]  # another thread is re-reading them
        try:
            cached = self._datasets.get(name)  # a thread that read it meanwhile
            if cached is not None and time.monotonic() - cached[0] <= DATASET_CACHE_S:
                return cached[1]
            row = self.store.dataset(name)
            self._datasets[name] = (time.monotonic(), row)
            return row
        finally:
            reading.release()

    @functools.cached_property
    def publisher(self) -> Publisher:
        """Publishes conversations' next turns: through the worker's app, or (a context
        built without one) an app of its own."""
        return Publisher(self.app if self.app is not None else make_celery(self.settings))

    def result_row(self, ds: DatasetRow, sample_id: str, c: Completion,
                   charge: ChargeResult, closer: str | None) -> ResultRow:
        return steps.result_row(ds, sample_id, c, charge, closer,
                                model=self.client.model(c.server), decoder=self.decoder)

    def decoder(self, tokenizer: str) -> Decoder | None:
        """A decoder for cut outputs, loaded once."""
        if tokenizer not in self._decoders:
            fn = _load_decoder(tokenizer, self.settings.trust_remote_code)
            with self._lock:
                self._decoders[tokenizer] = fn
        return self._decoders[tokenizer]


def _load_decoder(tokenizer: str, trust_remote_code: bool) -> Decoder | None:
    """With the light ``tokenizers`` library from tokenizer.json; a tokenizer that is
    Python code (no tokenizer.json) with transformers, when its code is trusted."""
    path = Path(tokenizer) / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        return lambda ids: str(tok.decode(list(ids), skip_special_tokens=True))
    code = code_class(Path(tokenizer))
    if code is not None and trust_remote_code:
        try:
            hf = load_tokenizer(tokenizer, trust_remote_code=True)
        except ConfigError as exc:
            log.warning("outputs cut to a budget get no text: %s", exc)
            return None
        return lambda ids: str(hf.decode(list(ids), skip_special_tokens=True))
    log.warning("outputs cut to a budget get no text: no %s%s", path,
                "; its tokenizer is Python code, decoded with DATAGEN_TRUST_REMOTE_CODE=1"
                if code is not None else "")
    return None


_context_lock = threading.Lock()


def load_router(settings: Settings) -> LoadRouter | None:
    """A router by the servers' loads where there is a choice to make and it is on."""
    if len(settings.sglang_urls) < 2 or not settings.load_poll_s:
        return None
    # A reading three intervals old (a poller that missed two) no longer steers requests.
    return LoadRouter(settings.sglang_urls, stale_after_s=max(3 * settings.load_poll_s, 2.0))


def auto_gate(settings: Settings) -> Gate | None:
    """The gate of concurrency auto; None for a fixed concurrency (its threads are it)."""
    if not settings.auto_concurrency:
        return None
    if not settings.load_poll_s:
        log.warning("concurrency auto reads the servers' loads, and DATAGEN_LOAD_POLL_S=0 "
                    "turns that off: at most %d requests at once per server", FALLBACK)
    # The first readings come within an interval of the consumer's start. A task gives
    # its place in the queue back well before its message could be delivered again.
    return Gate(settings.sglang_urls, FALLBACK, ready_s=3 * settings.load_poll_s + 2.0,
                max_wait_s=settings.visibility_timeout_s / 4)


def get_context(app: Celery) -> WorkerContext:
    """The app's context, built on first use (after the pool forks, if it does)."""
    ctx = getattr(app, "datagen_context", None)
    if ctx is not None:  # every task asks: no lock once it exists
        return ctx
    with _context_lock:
        ctx = getattr(app, "datagen_context", None)
        if ctx is None:
            ctx = WorkerContext.build(app.datagen_settings, app)  # type: ignore[attr-defined]
            app.datagen_context = ctx  # type: ignore[attr-defined]
        return ctx
