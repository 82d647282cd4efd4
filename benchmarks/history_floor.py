"""A measurement, not permits: the lease floor that keeps its history, on PostgreSQL (docs/benchmarks.md,
"PostgreSQL's floor cells: a floor that keeps the history").

``baselines.LEASE_FLOOR`` is the least a lease service with permits' guarantees writes, but its release
deletes the lease. permits keeps ended leases as history (the issue's history scenario loads 1,000,000 of
them, and the dashboard and the audit read them), and finds held ones by an index that holds only them,
so that a sweep or a reclaim never reads the history. ``HISTORY_FLOOR`` is the lease floor with exactly
that added: a release marks its lease ended, on the database's clock, instead of deleting it, and the
lease table carries a partial index of held leases by expiry (for the sweep) and an index of ended leases
by end time (for cleanup), as permits' table does. The same two requests per cycle on the raw driver,
prepared, as the lease floor sends them.

So it is a floor for any design that keeps permits' history: where it stays above 0.7x of ``floor``, the
target is within reach of such a design, and what is left between it and permits is permits' own cost.

    cd benchmarks && python harness.py \
        --system baselines:FLOOR,baselines:LEASE_FLOOR,history_floor:HISTORY_FLOOR,systems:PERMITS \
        --backend postgresql --scenario hot,spread --clients 1,16 --seconds 5 --warmup 1 --cpu
"""

from __future__ import annotations

from baselines import (
    _NOW_MS,
    LEASE_FLOOR_LEASE,
    LEASE_FLOOR_SEMAPHORE,
    LEASE_TTL_MS,
    LeaseFloorClient,
    LeaseFloorSystem,
    _Db,
)
from harness import Scenario, backend_of

_NOW = _NOW_MS["postgresql"]
ACQUIRE = (
    f"WITH taken AS (UPDATE {LEASE_FLOOR_SEMAPHORE} SET used = used + 1, last_token = last_token + 1"
    " WHERE name = %s AND used + 1 <= capacity RETURNING name, last_token)"
    f" INSERT INTO {LEASE_FLOOR_LEASE} (owner, lease_key, name, token, state, expires_at_ms)"
    f" SELECT %s, %s, name, last_token, 1, {_NOW} + {LEASE_TTL_MS} FROM taken RETURNING token"
)
# Only a held lease is ended, once: a second release of the same key finds nothing and gives nothing back.
RELEASE = (
    f"WITH ended AS (UPDATE {LEASE_FLOOR_LEASE} SET state = 0, ended_at_ms = {_NOW}"
    " WHERE owner = %s AND lease_key = %s AND state = 1 RETURNING name)"
    f" UPDATE {LEASE_FLOOR_SEMAPHORE} s SET used = s.used - 1 FROM ended WHERE s.name = ended.name"
)


class HistoryFloorSystem(LeaseFloorSystem):
    name = "history-floor"
    held_leases = f"SELECT COUNT(*) FROM {LEASE_FLOOR_LEASE} WHERE state = 1"

    def setup(self, backend_url: str, scenario: Scenario) -> None:
        if backend_of(backend_url) != "postgresql":
            raise ValueError("the history floor is written for PostgreSQL")
        super().setup(backend_url, scenario)
        db = _Db(backend_url)
        try:
            db.run(
                f"ALTER TABLE {LEASE_FLOOR_LEASE}"
                " ADD COLUMN state SMALLINT NOT NULL DEFAULT 1, ADD COLUMN ended_at_ms BIGINT"
            )
            db.run(f"CREATE INDEX bench_history_floor_held ON {LEASE_FLOOR_LEASE} (expires_at_ms) WHERE state = 1")
            db.run(f"CREATE INDEX bench_history_floor_ended ON {LEASE_FLOOR_LEASE} (ended_at_ms)")
        finally:
            db.close()

    def make_client(self, backend_url: str, scenario: Scenario, client_index: int) -> LeaseFloorClient:
        client = super().make_client(backend_url, scenario, client_index)
        client._acquire, client._release = ACQUIRE, RELEASE
        return client


HISTORY_FLOOR = HistoryFloorSystem()
