"""permits itself as a benchmark system (see the interface at the top of harness.py).

A cycle is ``acquire`` of one permit followed by ``release``, through the public sync client, with
every guarantee on: a keyed lease row, a permit row with its fencing token, the count on the semaphore row,
and the database's clock. ``acquire`` waits for room the way a user's ``with client.lease(...)`` does (a
wake-up on PostgreSQL and in the service, jittered polling elsewhere) rather than asking again at once:
on a hot semaphore that is the difference between queueing and a retry storm. A wait longer than
``WAIT_S`` counts as a refusal.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, ClassVar

from harness import Scenario, backend_of, connect, ensure_database
from sqlalchemy.engine import make_url

import permits

#: how long a cycle waits for room before it counts as refused
WAIT_S = 5.0

_TABLES = (
    "permits_admin_log",
    "permits_instance_stat",
    "permits_stat",
    "permits_waiter",
    "permits_permit",
    "permits_lease",
    "permits_capacity_change",
    "permits_semaphore",
    "permits_line",
    "permits_alembic_version",
)


def _reset(url: str) -> None:
    """Drop the permits tables, so every run starts from an empty history."""
    ensure_database(url)
    conn = connect(url)
    cur = conn.cursor()
    for table in _TABLES:
        cur.execute(f"DROP TABLE IF EXISTS {table}")
    if backend_of(url) == "postgresql":
        cur.execute("DROP SEQUENCE IF EXISTS permits_ticket")
    conn.close()


class PermitsSystem:
    """The permits library, talking to the database directly (with ``fair``: on fair semaphores, which
    grant in arrival order instead of to whoever asks first after a release)."""

    def __init__(self, fair: bool = False) -> None:
        self.fair = fair

    def setup(self, backend_url: str, scenario: Scenario) -> None:
        _reset(backend_url)
        with permits.connect(backend_url, auto_upgrade=True) as client:
            for name in scenario.all_semaphores():
                client.create_semaphore(name, scenario.capacity, fair=self.fair)

    def make_client(self, backend_url: str, scenario: Scenario, client_index: int) -> PermitsClient:
        return PermitsClient(backend_url, scenario.semaphores_for(client_index))

    def load_history(self, backend_url: str, scenario: Scenario, rows: int) -> None:
        """``rows`` old released leases, spread over the scenario's semaphores, each with its permit row."""
        backend = backend_of(backend_url)
        names = scenario.all_semaphores()
        conn = connect(backend_url)
        cur = conn.cursor()
        ph = "?" if backend == "sqlite" else "%s"
        ids = []
        for name in names:
            cur.execute(f"SELECT id FROM permits_semaphore WHERE name = {ph}", (name,))
            ids.append(int(cur.fetchone()[0]))
        n = len(ids)
        series = {
            "sqlite": f"WITH RECURSIVE seq(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM seq WHERE i < {rows}) "
            "SELECT i FROM seq",
            "mariadb": f"SELECT seq AS i FROM seq_1_to_{rows}",
            "postgresql": f"SELECT i FROM generate_series(1, {rows}) AS i",
        }[backend]
        concat = "CONCAT('h', i)" if backend == "mariadb" else "'h' || CAST(i AS TEXT)"
        if backend == "sqlite":
            cur.execute("BEGIN")
        # Old leases ended a week ago; ids in the lease table line up with i because it is empty.
        cur.execute(
            "INSERT INTO permits_lease (owner, lease_key, state, end_reason, acquired_at_ms, expires_at_ms,"
            f" ended_at_ms) SELECT 'history', {concat}, 0, 'released', 1000 + i, 61000 + i, 2000 + i"
            f" FROM ({series}) AS s"
        )
        case = " ".join(f"WHEN {k} THEN {sem_id}" for k, sem_id in enumerate(ids))
        # Token i / n + 1 is unique per semaphore: lease i goes to semaphore i mod n.
        cur.execute(
            "INSERT INTO permits_permit (lease_id, semaphore_id, count, token)"
            f" SELECT l.id, CASE (l.id % {n}) {case} END, 1, (l.id / {n}) + 1"
            " FROM permits_lease l WHERE l.owner = 'history'"
        )
        cur.execute(f"UPDATE permits_semaphore SET last_token = {rows // n + 1}")
        if backend == "sqlite":
            cur.execute("COMMIT")
        if backend == "postgresql":
            cur.execute("ANALYZE")
        elif backend == "mariadb":
            cur.execute("ANALYZE TABLE permits_lease, permits_permit, permits_semaphore")
            cur.fetchall()
        conn.close()

    def verify(self, backend_url: str, scenario: Scenario) -> list[str]:
        problems = []
        with permits.connect(backend_url) as client:
            for drift in client.reconcile():
                problems.append(f"drift on {drift.name}: recorded {drift.recorded}, actual {drift.actual}")
            for name in scenario.all_semaphores():
                used = client.get_semaphore(name).used
                if used:
                    problems.append(f"{name}: {used} permits still in use after every client released")
        return problems


class PermitsClient:
    def __init__(self, url: str, names: tuple[str, ...]) -> None:
        self._client = permits.connect(url, owner=f"bench-{uuid.uuid4().hex[:8]}")
        self._wants = {name: 1 for name in names}

    def cycle(self) -> bool:
        try:
            lease = self._client.acquire(self._wants, ttl=60, timeout=WAIT_S)
        except permits.AcquireTimeout:
            return False
        self._client.release(lease)
        return True

    def close(self) -> None:
        self._client.close()


class WithoutLeaseIndexesSystem(PermitsSystem):
    """An experiment, not a way to run permits: the library on a schema without the lease table's two
    secondary indexes (the sweep's and cleanup's), so that on PostgreSQL a release changes no indexed
    column and is a HOT update. It measures what those indexes cost a cycle (docs/benchmarks.md). Not on
    SQLite, whose statements name the index of held leases."""

    #: the sweep's index: of held leases only where the engine has partial indexes (migration 0007)
    SWEEP_INDEX: ClassVar[dict[str, str]] = {
        "mariadb": "ix_permits_lease_state_expires",
        "postgresql": "ix_permits_lease_held",
    }

    def setup(self, backend_url: str, scenario: Scenario) -> None:
        backend = backend_of(backend_url)
        if backend not in self.SWEEP_INDEX:
            raise ValueError("the lease index experiment runs on MariaDB and PostgreSQL")
        super().setup(backend_url, scenario)
        conn = connect(backend_url)
        cur = conn.cursor()
        on_table = " ON permits_lease" if backend == "mariadb" else ""
        for index in ("ix_permits_lease_ended", self.SWEEP_INDEX[backend]):
            cur.execute(f"DROP INDEX {index}{on_table}")
        conn.close()


class PooledPermitsSystem(PermitsSystem):
    """The library on PostgreSQL through a PgBouncer in transaction mode (``?pooler=transaction``): no
    statement prepared on the server, no LISTEN (waiters poll), and PgBouncer's hop on every statement.
    Setup and the final check go to the server directly."""

    def setup(self, backend_url: str, scenario: Scenario) -> None:
        if backend_of(backend_url) != "postgresql":
            raise ValueError("a pooler is measured in front of PostgreSQL only")
        super().setup(backend_url, scenario)
        from private_servers import PGBOUNCER

        # What docs/deployment.md asks of a transaction pooler's users: the session settings permits cannot
        # make through it, set on the server (for this database only, before PgBouncer's first session).
        conn = connect(backend_url)
        database = make_url(backend_url).database
        conn.cursor().execute(f"ALTER DATABASE {database} SET lock_timeout = '5s'")
        conn.cursor().execute(f"ALTER DATABASE {database} SET idle_in_transaction_session_timeout = '30s'")
        if _has_client_check(conn):  # PostgreSQL 14+
            conn.cursor().execute(f"ALTER DATABASE {database} SET client_connection_check_interval = '1s'")
        conn.close()
        url = make_url(backend_url)
        PGBOUNCER.target = (url.host or "127.0.0.1", url.port or 5432, url.username or "postgres", url.password)
        PGBOUNCER.ensure()

    def teardown(self, backend_url: str, scenario: Scenario) -> None:
        conn = connect(backend_url)
        database = make_url(backend_url).database
        names = ["lock_timeout", "idle_in_transaction_session_timeout"]
        names += ["client_connection_check_interval"] if _has_client_check(conn) else []
        for name in names:
            conn.cursor().execute(f"ALTER DATABASE {database} RESET {name}")
        conn.close()

    def make_client(self, backend_url: str, scenario: Scenario, client_index: int) -> PermitsClient:
        from private_servers import PGBOUNCER

        host, _, port = os.environ[PGBOUNCER.env_var].rpartition(":")
        pooled = make_url(backend_url).set(host=host, port=int(port)).update_query_dict({"pooler": "transaction"})
        return PermitsClient(pooled.render_as_string(hide_password=False), scenario.semaphores_for(client_index))


def _has_client_check(conn: Any) -> bool:
    cur = conn.cursor()
    cur.execute("SELECT current_setting('client_connection_check_interval', true) IS NOT NULL")
    return bool(cur.fetchone()[0])


PERMITS = PermitsSystem()
PERMITS_FAIR = PermitsSystem(fair=True)
PERMITS_WITHOUT_LEASE_INDEXES = WithoutLeaseIndexesSystem()
PERMITS_THROUGH_PGBOUNCER = PooledPermitsSystem()
