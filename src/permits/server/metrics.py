"""Prometheus metrics. Names carry their units; each app has its own registry (several apps can run in one
process, as the tests do).

Per-semaphore gauges come from a snapshot that a background task refreshes (a scrape never waits on the
database), for at most ``metrics_max_semaphores`` names, since every name becomes a label.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from permits._models import Semaphore

# The *_created series only say when the process started counting: noise on every scrape.
disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus-client

access_log = logging.getLogger("permits.server.access")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TURN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
_HOLD_BUCKETS = (0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 86400)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "permits_http_requests_total", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.acquires = Counter(
            "permits_acquire_total",
            "Acquire requests by outcome: granted, refused (no room, no wait), timeout (no room within the wait),"
            " gone (the client closed its connection while waiting), conflict (idempotency conflict), limited"
            " (a bound of this service: max_waiters, max_leases_per_client), rejected (the caller's mistake: no"
            " such semaphore, a count over its capacity, bad input, a key whose lease has ended), error (the"
            " database or the service failed)",
            ["outcome"],
            registry=r,
        )
        self.acquire_seconds = Histogram(
            "permits_acquire_seconds",
            "Time to answer an acquire request, waits included",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.acquire_wait_seconds = Histogram(
            "permits_acquire_wait_seconds",
            "Time granted acquires spent waiting for room",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.hold_seconds = Histogram(
            "permits_hold_seconds",
            "How long leases released through this instance were held",
            buckets=_HOLD_BUCKETS,
            registry=r,
        )
        self.releases = Counter("permits_release_total", "Releases by outcome", ["outcome"], registry=r)
        self.reclaims = Counter(
            "permits_reclaims_total",
            "Leases ended by the service rather than their holder, by reason (swept, owner_dead, stale, revoked)",
            ["reason"],
            registry=r,
        )
        self.store_retries = Counter(
            "permits_store_retries_total", "Database transactions retried, by fault", ["fault"], registry=r
        )
        self.reply_cuts = Counter(
            "permits_store_reply_cuts_total",
            "Database connections whose answer was overdue past reply_timeout and were cut (cut), and what"
            " became of each one's server session (ended, gone, other_server, refused)",
            ["event"],
            registry=r,
        )
        self.storage_errors = Counter(
            "permits_storage_errors_total", "Requests that failed on the database, by error code", ["code"], registry=r
        )
        self.prelock_waiting = Gauge(
            "permits_prelock_waiting", "Requests queued in this instance's pre-lock now", registry=r
        )
        self.prelock_wait_seconds = Histogram(
            "permits_prelock_wait_seconds",
            "Time a request queued in the pre-lock before its database attempt",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.turn_grants = Histogram(
            "permits_turn_grants",
            "Requests granted per turn of a line (group commit: one statement for a line's grants and releases)",
            buckets=_TURN_BUCKETS,
            registry=r,
        )
        self.turn_releases = Histogram(
            "permits_turn_releases", "Leases released per turn of a line", buckets=_TURN_BUCKETS, registry=r
        )
        self.waiters = Gauge("permits_waiters", "Requests waiting for room on this instance now", registry=r)
        self.db_connections = Gauge(
            "permits_db_connections_in_use", "Database connections at work for this instance now", registry=r
        )
        self.maintenance_runs = Counter(
            "permits_maintenance_runs_total",
            "Maintenance task runs by task and outcome (done, skipped: another instance runs it, failed)",
            ["task", "outcome"],
            registry=r,
        )
        self.semaphores = _SemaphoreGauges()
        r.register(self.semaphores)

    def observe_turn(self, granted: int, released: int) -> None:
        self.turn_grants.observe(granted)
        self.turn_releases.observe(released)

    def record_request(self, method: str, route: str, status: int, started: float, identity: str | None) -> None:
        """Count a request, and write its access log line when that log is on (``started``: its
        ``time.monotonic()``)."""
        self.requests.labels(route, str(status)).inc()
        if access_log.isEnabledFor(logging.INFO):
            access_log.info(
                "%s %s %s",
                method,
                route,
                status,
                extra={
                    "method": method,
                    "route": route,
                    "status": status,
                    "duration_ms": round((time.monotonic() - started) * 1000, 2),
                    "identity": identity,
                },
            )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SemaphoreGauges(Collector):
    def __init__(self) -> None:
        self.snapshot: list[Semaphore] = []
        self.leases: dict[str, int] = {}
        self.total = 0

    def collect(self) -> Iterable[GaugeMetricFamily]:
        capacity = GaugeMetricFamily("permits_semaphore_capacity", "Capacity per semaphore", labels=["semaphore"])
        used = GaugeMetricFamily("permits_semaphore_used", "Permits in use per semaphore", labels=["semaphore"])
        leases = GaugeMetricFamily(
            "permits_semaphore_leases",
            "Held leases per semaphore (expired, unreclaimed included)",
            labels=["semaphore"],
        )
        count = GaugeMetricFamily("permits_semaphores", "Semaphores that exist")
        for sem in self.snapshot:
            capacity.add_metric([sem.name], sem.capacity)
            used.add_metric([sem.name], sem.used)
            leases.add_metric([sem.name], self.leases.get(sem.name, 0))
        count.add_metric([], self.total)
        yield capacity
        yield used
        yield leases
        yield count
