"""A worker of the fault runs: ``python -m tests.faults.worker <json args>``, a real OS process.

It loops until its stop file appears: acquire one permit of the semaphore under a fresh key, write its
fencing token to the fenced register, hold briefly, release. Every operation goes to its history file
(``tests/faults/history.py``). ``url`` is a database (the library) or a ``permits serve`` instance (the
service); the register is always written directly to the database, as a downstream store would be.

An operation whose outcome is unknown (a timeout, a dropped connection, a 503) is retried with the same
key until it has a definite answer, or ``settle`` seconds have passed; each attempt is recorded. An
acquire that could not settle is released by key, in case it was granted.

Each round holds the lease for a random time between ``hold_min`` (0 unless given) and ``hold`` seconds.

``stop_self_at``: on that round, after its first write, the worker SIGSTOPs itself while it holds the
lease (the harness SIGCONTs it later), then writes once more and releases, as a holder that was paused
(a GC pause, a stopped VM) and does not know it.

``PERMITS_WORKER_TRACE=<dir>`` (in the environment): the worker traces its Python allocations
(tracemalloc) and, when it stops, writes to ``<dir>/<proc>.trace`` what grew between its first
``TRACE_BASE_SECONDS`` and its end, largest first, by the five innermost frames that made it: what a
library worker's memory grows by in a soak (docs/faults.md).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import tracemalloc
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

import permits
from permits import AcquireTimeout, IdempotencyConflict, LeaseLost, LeaseNotFound, ReleaseOutcome
from permits.fencing import FencingGuard, StaleFencingToken
from tests.faults.history import FAIL, OK, UNKNOWN, Recorder

REGISTER_DDL = [
    "CREATE TABLE IF NOT EXISTS fault_register (resource VARCHAR(200) PRIMARY KEY, version BIGINT NOT NULL,"
    " token BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS fault_register_log (resource VARCHAR(200) NOT NULL, version BIGINT NOT NULL,"
    " token BIGINT NOT NULL, wid VARCHAR(200) NOT NULL, PRIMARY KEY (resource, version))",
]
#: outcomes of release: the first two mean the lease ended by our release (a retry finds it released)
RELEASE_OUTCOMES = {
    ReleaseOutcome.RELEASED: OK,
    ReleaseOutcome.ALREADY_RELEASED: OK,
    ReleaseOutcome.LOST: FAIL,
    ReleaseOutcome.NOT_FOUND: FAIL,
}


def sync_url(db_url: str) -> str:
    """The SQLAlchemy URL of a permits database URL, for the register's own engine."""
    return db_url.replace("mysql://", "mysql+pymysql://", 1).replace("postgresql://", "postgresql+psycopg://", 1)


def install_register(engine: Any, resource: str) -> None:
    with engine.begin() as conn:
        FencingGuard().install(conn)
        for ddl in REGISTER_DDL:
            conn.execute(text(ddl))
        conn.execute(text("INSERT INTO fault_register (resource, version, token) VALUES (:r, 0, 0)"), {"r": resource})


def _seconds(a: str | datetime, b: str | datetime) -> float:
    def parse(v: str | datetime) -> datetime:
        return v if isinstance(v, datetime) else datetime.fromisoformat(v)

    return (parse(b) - parse(a)).total_seconds()


#: When a traced worker takes the snapshot that its end is compared with: after the imports and the first
#: rounds, so that what grows later is what the run makes.
TRACE_BASE_SECONDS = 30.0


class _AllocationTrace:
    """``PERMITS_WORKER_TRACE``: the growth of the worker's Python allocations from its base to its end."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.started = time.monotonic()
        self.base: tracemalloc.Snapshot | None = None
        tracemalloc.start(5)

    def tick(self) -> None:
        if self.base is None and time.monotonic() - self.started >= TRACE_BASE_SECONDS:
            self.base = self._snapshot()
            tracemalloc.reset_peak()

    def write(self) -> None:
        if self.base is None:
            return
        # The peak since the base: what the worker held at its busiest moment, which the allocator may keep
        # (as RSS) after the objects are gone.
        peak = tracemalloc.get_traced_memory()[1] // 1024
        end = self._snapshot()
        lines = [f"traced at the base {_kib(self.base)} KiB, at the end {_kib(end)} KiB, at the peak {peak} KiB"]
        for stat in end.compare_to(self.base, "traceback")[:15]:
            lines.append(f"{stat.size_diff / 1024:+.1f} KiB, {stat.count_diff:+d} blocks")
            lines.extend(f"    {line}" for line in stat.traceback.format())
        self.out.write_text("\n".join(lines) + "\n")

    @staticmethod
    def _snapshot() -> tracemalloc.Snapshot:
        return tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])


def _kib(snapshot: tracemalloc.Snapshot) -> int:
    return sum(stat.size for stat in snapshot.statistics("filename")) // 1024


class Worker:
    def __init__(self, args: dict[str, Any]) -> None:
        self.args = args
        self.rng = random.Random(args["seed"])
        self.rec = Recorder(Path(args["history"]), args["proc"])
        self.owner = args["owner"]
        self.sem = args["sem"]
        self.resource = args["resource"]
        self.stop_file = Path(args["stop_file"])
        self.client = permits.connect(
            args["url"], owner=self.owner, retries=3, lock_wait_timeout=2, reply_timeout=args.get("reply_timeout")
        )
        self.engine = create_engine(sync_url(args["register_url"]), pool_pre_ping=True)
        self.guard = FencingGuard()
        self.writes = 0
        traced = os.environ.get("PERMITS_WORKER_TRACE")
        self.trace = _AllocationTrace(Path(traced) / f"{args['proc']}.trace") if traced else None

    def run(self) -> None:
        round_ = 0
        while not self.stop_file.exists():
            round_ += 1
            if self.trace is not None:
                self.trace.tick()
            key = f"{self.owner}-{round_}"
            lease = self.acquire(key)
            if lease is None:
                continue
            self.write(key, lease.token)
            if round_ == self.args.get("stop_self_at"):
                self.rec.event("self_stop", key=key, token=lease.token)
                os.kill(os.getpid(), signal.SIGSTOP)  # the harness sends SIGCONT after the TTL has passed
                self.rec.event("resumed", key=key, token=lease.token)
                self.write(key, lease.token)
            time.sleep(self.rng.uniform(self.args.get("hold_min", 0.0), self.args["hold"]))
            self.release(key)
        if self.trace is not None:
            self.trace.write()
        self.client.close()
        self.engine.dispose()
        self.rec.close()

    def _attempts(self, op: str, key: str) -> Iterator[str]:
        """Record and yield one attempt of ``op`` after another, while the caller found its outcome unknown
        and ``settle`` seconds have not passed since the first (then the loop ends)."""
        started = time.monotonic()
        attempt = 0
        while attempt == 0 or time.monotonic() - started < self.args["settle"]:
            if attempt:
                time.sleep(0.1 + self.rng.uniform(0, 0.2))
            attempt += 1
            yield self.rec.invoke(op, key=key, owner=self.owner, sem=self.sem, attempt=attempt)

    def acquire(self, key: str) -> permits.Lease | None:
        for op in self._attempts("acquire", key):
            try:
                lease = self.client.acquire(
                    self.sem, key=key, ttl=self.args["ttl"], timeout=self.args["acquire_timeout"]
                )
            except AcquireTimeout:
                self.rec.complete(op, FAIL, why="no_room")
                return None
            except LeaseLost as exc:  # a retry of a key whose lease has ended meanwhile
                self.rec.complete(op, FAIL, why="lease_lost", reason=str(exc.details.get("reason")))
                self.release(key)
                return None
            except IdempotencyConflict as exc:
                self.rec.complete(op, FAIL, why="idempotency_conflict", error=str(exc))
                return None
            except Exception as exc:  # a timeout, a dropped connection, a 503: it may have been granted
                self.rec.complete(op, UNKNOWN, error=f"{type(exc).__name__}: {exc}"[:300])
                continue
            self.rec.complete(
                op,
                OK,
                token=lease.token,
                acquired_at=lease.acquired_at.isoformat(),
                expires_at=lease.expires_at.isoformat(),
                ttl_db=_seconds(lease.acquired_at, lease.expires_at),
            )
            return lease
        self.release(key)  # never settled: give it back in case it was granted
        return None

    def write(self, key: str, token: int) -> None:
        """Write the token to the fenced register: check and record it, bump the register, log the write,
        in one transaction. Retried (as a new write) after an error that is not a refusal."""
        for _ in range(5):
            self.writes += 1
            wid = f"{self.args['proc']}-w{self.writes}"
            op = self.rec.invoke("write", key=key, sem=self.sem, resource=self.resource, token=token, wid=wid)
            try:
                with self.engine.begin() as conn:
                    self.guard.check(conn, self.resource, token)
                    conn.execute(
                        text("UPDATE fault_register SET version = version + 1, token = :t WHERE resource = :r"),
                        {"t": token, "r": self.resource},
                    )
                    version = conn.execute(
                        text("SELECT version FROM fault_register WHERE resource = :r"), {"r": self.resource}
                    ).scalar_one()
                    conn.execute(
                        text("INSERT INTO fault_register_log (resource, version, token, wid) VALUES (:r, :v, :t, :w)"),
                        {"r": self.resource, "v": version, "t": token, "w": wid},
                    )
            except StaleFencingToken as exc:
                self.rec.complete(op, FAIL, highest=exc.details.get("highest"))
                return
            except Exception as exc:  # a deadlock, a busy database, a dropped connection
                self.rec.complete(op, UNKNOWN, error=f"{type(exc).__name__}: {exc}"[:300])
                time.sleep(0.1)
                continue
            self.rec.complete(op, OK, version=version)
            return

    def release(self, key: str) -> None:
        for op in self._attempts("release", key):
            try:
                outcome = self.client.release(key)
            except LeaseNotFound:
                self.rec.complete(op, FAIL, result="not_found")
                return
            except Exception as exc:
                self.rec.complete(op, UNKNOWN, error=f"{type(exc).__name__}: {exc}"[:300])
                continue
            self.rec.complete(op, RELEASE_OUTCOMES[outcome], result=str(outcome))
            return


if __name__ == "__main__":
    Worker(json.loads(sys.argv[1])).run()
