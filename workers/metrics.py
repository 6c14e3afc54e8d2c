"""A worker's Prometheus metrics: what this process did, and the ledgers as they stand.

Counters, gauges and histograms are this process's own and change on a task's path (a
labelled child's update: a lock and an addition). The ledgers are read only when
Prometheus scrapes (``LedgerCollector``: two Redis round trips for all datasets), so a
sample costs nothing for them; every worker exports the same ledger values, so a query
takes their ``max by (dataset)``.

A worker is one process (a threads pool), so each serves its own registry on its own
port (``DATAGEN_METRICS_PORT``): no multiprocess mode and no shared files. Two workers on
one host are given two ports; in compose each replica has a network namespace of its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from wsgiref.simple_server import WSGIServer

import redis
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from common.errors import ConfigError
from common.ledger import Ledger, LedgerState
from common.rows import ResultRow

# From a simulator's tenth of a second to the request timeout's half hour.
LATENCY_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800)
# Powers of two up to the longest outputs (max_new_tokens is 16,384 by default).
OUTPUT_TOKEN_BUCKETS = tuple(float(2 ** k) for k in range(4, 17))


class Retry(StrEnum):
    """Why a task was sent again: ``datagen_sample_retries_total{reason}``."""

    ERROR = "error"  # a transient error, counted as an attempt
    UNREACHABLE = "unreachable"  # SGLang refused the connection
    UNAVAILABLE = "unavailable"  # Redis or the database did not answer
    BUDGET_WAIT = "budget_wait"  # admission said wait: the budget is nearly spent
    GATE_WAIT = "gate_wait"  # concurrency auto: no place at a server for a long while


class WorkerMetrics:
    """This process's metrics, in a registry of its own (a test's workers do not mix)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        ds = ["dataset"]
        self.done = Counter("datagen_samples_done", "Results this worker stored, by the "
                            "finish reason kept", [*ds, "finish_reason"], registry=r)
        self.failed = Counter("datagen_samples_failed", "Prompts this worker marked failed",
                              ds, registry=r)
        self.retries = Counter("datagen_sample_retries", "Tasks this worker sent again, by why",
                               [*ds, "reason"], registry=r)
        self.discarded = Counter("datagen_samples_discarded", "Outputs generated and not kept: "
                                 "refused by the charge or aborted at a close", ds, registry=r)
        self.closes = Counter("datagen_dataset_closes", "Closes this worker made: a budget "
                              "crossed, or a dataset stopped", [*ds, "reason"], registry=r)
        self.in_flight = Gauge("datagen_requests_in_flight", "This worker's /generate "
                               "requests awaiting their answer", ds, registry=r)
        self.latency = Histogram("datagen_request_duration_seconds", "Time from sending a "
                                 "/generate to its answer", ds, buckets=LATENCY_BUCKETS_S,
                                 registry=r)
        self.output_tokens = Histogram("datagen_sample_output_tokens", "Completion tokens of "
                                       "each stored result", ds, buckets=OUTPUT_TOKEN_BUCKETS,
                                       registry=r)
        self.up = Gauge("datagen_worker_up", "1 while this worker consumes its queues; 0 "
                        "while it waits for its services or drains at a shutdown", registry=r)
        self.threads = Gauge("datagen_worker_threads", "Tasks this worker runs at once",
                             registry=r)
        self.started = Gauge("datagen_worker_start_time_seconds", "When this worker started, "
                             "unix seconds", registry=r)
        self.last_store = Gauge("datagen_worker_last_store_timestamp_seconds", "When this "
                                "worker last stored a result, unix seconds", registry=r)
        self.last_beat = Gauge("datagen_worker_last_heartbeat_timestamp_seconds", "When this "
                               "worker's heartbeat last reached Redis, unix seconds", registry=r)
        self.started.set_to_current_time()

    def stored(self, row: ResultRow) -> None:
        self.done.labels(row.dataset, row.finish_reason).inc()
        self.output_tokens.labels(row.dataset).observe(row.completion_tokens)
        self.last_store.set_to_current_time()

    @contextmanager
    def request(self, dataset: str) -> Iterator[None]:
        """Around one /generate: in flight meanwhile; its time observed once answered."""
        gauge = self.in_flight.labels(dataset)
        gauge.inc()
        sent = time.monotonic()
        try:
            yield
            self.latency.labels(dataset).observe(time.monotonic() - sent)
        finally:
            gauge.dec()

    def retried(self, dataset: str, reason: Retry) -> None:
        self.retries.labels(dataset, reason).inc()

    def beat(self) -> None:
        self.last_beat.set_to_current_time()


class LedgerCollector:
    """Every dataset's ledger, read from Redis when Prometheus scrapes."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def describe(self) -> Iterable[Metric]:
        return []  # nothing read from Redis when the collector is registered

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("datagen_ledger_up", "1 if this scrape read the ledgers "
                               "from Redis")
        try:
            states = self.ledger.states(self.ledger.known())
        except redis.RedisError:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from ledger_families(states)


# (name, help, value) of the per-dataset gauges read from each ledger.
_LEDGER_GAUGES = (
    ("datagen_dataset_used_tokens", "Tokens charged to the dataset, on its budget's basis",
     lambda s: s.used_tokens),
    ("datagen_dataset_budget_tokens", "The dataset's budget", lambda s: s.budget_tokens),
    ("datagen_dataset_reserved_tokens", "Expected tokens of the dataset's requests in flight",
     lambda s: s.reserved_tokens),
    ("datagen_dataset_charged_samples", "Samples charged to the dataset", lambda s: s.samples),
    ("datagen_dataset_queued_messages", "Messages waiting in the dataset's queue",
     lambda s: s.queued),
    ("datagen_dataset_inflight_requests", "The dataset's requests in flight, all workers",
     lambda s: s.inflight),
    ("datagen_dataset_open", "1 while the dataset is open, 0 once closed",
     lambda s: int(s.state == "open")),
)


def ledger_families(states: list[LedgerState]) -> Iterator[Metric]:
    for name, doc, value in _LEDGER_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=["dataset"])
        for s in states:
            family.add_metric([s.name], value(s))
        yield family
    closed = GaugeMetricFamily("datagen_dataset_closed_timestamp_seconds", "When a closed "
                               "dataset closed, unix seconds, and why",
                               labels=["dataset", "reason"])
    for s in states:
        if s.state == "closed" and s.closed_at is not None:
            closed.add_metric([s.name, s.close_reason or ""], s.closed_at)
    yield closed


def serve(metrics: WorkerMetrics, port: int, ledger: Ledger) -> WSGIServer:
    """Serve ``/metrics`` on ``port`` (every interface) from a daemon thread."""
    # A `_created` series beside every counter and histogram child doubles what Prometheus
    # stores, for a start time the worker's own start time already gives. The switch is
    # the process's, so it is thrown here, in a worker, not where the app is only imported
    # (Flower's own metrics keep theirs).
    disable_created_metrics()
    metrics.registry.register(LedgerCollector(ledger))
    try:
        server, _thread = start_http_server(port, registry=metrics.registry)
    except OSError as exc:
        raise ConfigError(f"DATAGEN_METRICS_PORT={port}: cannot serve /metrics there "
                          f"({exc.strerror or exc}); give each worker process on a host a "
                          "port of its own, or 0 for none") from None
    return server


def ledger_for_scrapes(redis_url: str) -> Ledger:
    """A ledger on a connection pool of its own, with short timeouts: a scrape while Redis
    is away answers ``datagen_ledger_up 0`` in seconds, and never takes a task's connection."""
    return Ledger(redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2))
