"""Baseline systems for the benchmark harness (see harness.py for the interface).

``floor``
    One row per semaphore with a ``used`` counter; acquire and release are one
    conditional UPDATE each, in autocommit. Nothing real can be cheaper, so it
    is the lower bound that other designs are measured against. With several
    semaphores per acquire, one conditional UPDATE per semaphore in one
    transaction (rolled back if any finds no room), and the decrements in
    another.

``lease-floor``
    The least that a lease service with permits' guarantees must write: the
    floor's conditional UPDATE, which also raises the semaphore's fencing
    token, and in the same transaction one keyed lease row (owner, key, token,
    expiry on the database's clock), so that a retry can find its grant and an
    expired lease can be reclaimed. Release deletes the row and gives the
    permit back. One request each way, on the raw driver: PostgreSQL as one
    statement (a CTE), MariaDB as one multi-statement batch, SQLite as one
    transaction. One semaphore per acquire only. It keeps no history, no
    end reason and no fair queue, and validates nothing: it is there to show
    how much of the distance between permits and the floor any design with
    these guarantees must pay.

``seed``
    The design of the seed notes (shared/seeds/001_e70c01959f0b2ec5.txt,
    Parts 3-5): semaphore / permit_request / permit tables, acquire as
    idempotency check + locked transaction that sums ACQUIRED permits, release
    as two autocommit UPDATEs. Reproduced as written, including its extra round
    trips (session lock-timeout set and reset), so that an improved design has
    an honest reference.

Both talk to the raw DB-API drivers (sqlite3, pymysql, psycopg 3): no ORM or
pool sits on the measured path. Each child process owns one connection.
"""

from __future__ import annotations

import contextlib
import sqlite3
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import pymysql
from harness import LOCK_WAIT_SECONDS, Scenario, backend_of, connect


class _Db:
    """One autocommit DB-API connection and a cursor reused for every statement.

    Statements are written with ``%s`` placeholders, the style pymysql and
    psycopg share; ``sql()`` rewrites them to ``?`` for sqlite3. Clients call
    it once when they build their statements, not per execution.
    """

    def __init__(self, url: str) -> None:
        self.backend = backend_of(url)
        self.conn: Any = connect(url)
        self.cur: Any = self.conn.cursor()

    def sql(self, text: str) -> str:
        return text.replace("%s", "?") if self.backend == "sqlite" else text

    def run(self, statement: str, params: Sequence[Any] = ()) -> int:
        """Execute; return the affected row count."""
        if params:
            self.cur.execute(statement, params)
        else:
            # No parameters: let the driver send the text untouched (pymysql
            # would otherwise %-format it, breaking a literal "%").
            self.cur.execute(statement)
        return int(self.cur.rowcount)

    def one(self, statement: str, params: Sequence[Any] = ()) -> Any:
        """Execute; return the first row or None."""
        self.run(statement, params)
        return self.cur.fetchone()

    def all(self, statement: str, params: Sequence[Any] = ()) -> list[Any]:
        self.run(statement, params)
        return list(self.cur.fetchall())

    def rollback_quietly(self) -> None:
        # Used on error paths: a failing ROLLBACK (connection gone) must not
        # hide the error that got us here. Every driver's rollback() is a
        # no-op when no transaction is open.
        with contextlib.suppress(Exception):
            self.conn.rollback()

    def close(self) -> None:
        try:
            self.cur.close()
        finally:
            self.conn.close()


# --------------------------------------------------------------------------
# floor
# --------------------------------------------------------------------------

FLOOR_TABLE = "bench_floor_semaphore"


class FloorSystem:
    name = "floor"

    def setup(self, backend_url: str, scenario: Scenario) -> None:
        db = _Db(backend_url)
        try:
            engine = " ENGINE=InnoDB" if db.backend == "mariadb" else ""
            db.run(f"DROP TABLE IF EXISTS {FLOOR_TABLE}")
            db.run(
                f"CREATE TABLE {FLOOR_TABLE} ("
                " name VARCHAR(255) NOT NULL PRIMARY KEY,"
                " capacity INTEGER NOT NULL,"
                " used INTEGER NOT NULL DEFAULT 0"
                f"){engine}"
            )
            insert = db.sql(f"INSERT INTO {FLOOR_TABLE} (name, capacity, used) VALUES (%s, %s, 0)")
            for name in scenario.all_semaphores():
                db.run(insert, (name, scenario.capacity))
        finally:
            db.close()

    def load_history(self, backend_url: str, scenario: Scenario, rows: int) -> None:
        """Nothing to load: the floor keeps no per-acquire rows."""

    def make_client(self, backend_url: str, scenario: Scenario, client_index: int) -> FloorClient:
        return FloorClient(backend_url, scenario.semaphores_for(client_index))

    def verify(self, backend_url: str, scenario: Scenario) -> list[str]:
        db = _Db(backend_url)
        try:
            rows = db.all(f"SELECT name, used FROM {FLOOR_TABLE} WHERE used <> 0")
        finally:
            db.close()
        return [f"semaphore {name!r} still has used={used}" for name, used in rows]


class FloorClient:
    def __init__(self, backend_url: str, names: Sequence[str]) -> None:
        self._db = _Db(backend_url)
        # Sorted: every client takes the rows in the same order, so two
        # multi-semaphore acquires never wait on each other in a cycle.
        self._params = [(name,) for name in sorted(names)]
        # "used + 1 <= capacity" in the WHERE clause makes check-and-increment
        # one atomic statement: the row lock taken by the UPDATE serialises it.
        self._acquire = self._db.sql(
            f"UPDATE {FLOOR_TABLE} SET used = used + 1 WHERE name = %s AND used + 1 <= capacity"
        )
        self._release = self._db.sql(f"UPDATE {FLOOR_TABLE} SET used = used - 1 WHERE name = %s")
        # SQLite has no row locks: BEGIN IMMEDIATE takes the write lock up
        # front rather than failing to upgrade a read lock halfway through.
        self._begin = {"mariadb": "START TRANSACTION", "postgresql": "BEGIN", "sqlite": "BEGIN IMMEDIATE"}[
            self._db.backend
        ]

    def cycle(self) -> bool:
        if len(self._params) == 1:
            # One semaphore: each statement is its own transaction (autocommit).
            if self._db.run(self._acquire, self._params[0]) != 1:
                return False
            self._db.run(self._release, self._params[0])
            return True
        # Several: all or nothing, so the increments share one transaction,
        # and so do the decrements. Still no lease, no token, no history.
        return self._in_transaction(self._acquire_all) and self._in_transaction(self._release_all)

    def _acquire_all(self) -> bool:
        return all(self._db.run(self._acquire, params) == 1 for params in self._params)

    def _release_all(self) -> bool:
        for params in self._params:
            self._db.run(self._release, params)
        return True

    def _in_transaction(self, body: Callable[[], bool]) -> bool:
        """Run ``body`` in one transaction: COMMIT if it returns True, else ROLLBACK."""
        self._db.run(self._begin)
        try:
            done = body()
        except BaseException:
            self._db.rollback_quietly()
            raise
        self._db.run("COMMIT" if done else "ROLLBACK")
        return done

    def close(self) -> None:
        self._db.close()


# --------------------------------------------------------------------------
# lease floor
# --------------------------------------------------------------------------

LEASE_FLOOR_SEMAPHORE = "bench_lease_floor_semaphore"
LEASE_FLOOR_LEASE = "bench_lease_floor_lease"
LEASE_TTL_MS = 30_000
RELEASE_ATTEMPTS = 10

# The database's clock in milliseconds since the epoch: leases are timed by it, as permits' are.
_NOW_MS = {
    "postgresql": "CAST(EXTRACT(EPOCH FROM statement_timestamp()) * 1000 AS BIGINT)",
    "mariadb": "CAST(UNIX_TIMESTAMP(NOW(6)) * 1000 AS SIGNED)",
    "sqlite": "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)",
}


def _lease_floor_statements(backend: str) -> tuple[str, str]:
    """(acquire, release) for one request each. Acquire params: name, owner, key (plus the key's name
    again where a statement needs it twice); it answers the token, or nothing when there is no room."""
    now, sem, lease = _NOW_MS[backend], LEASE_FLOOR_SEMAPHORE, LEASE_FLOOR_LEASE
    if backend == "postgresql":
        acquire = (
            f"WITH taken AS (UPDATE {sem} SET used = used + 1, last_token = last_token + 1"
            " WHERE name = %s AND used + 1 <= capacity RETURNING name, last_token)"
            f" INSERT INTO {lease} (owner, lease_key, name, token, expires_at_ms)"
            f" SELECT %s, %s, name, last_token, {now} + {LEASE_TTL_MS} FROM taken RETURNING token"
        )
        release = (
            f"WITH ended AS (DELETE FROM {lease} WHERE owner = %s AND lease_key = %s RETURNING name)"
            f" UPDATE {sem} s SET used = s.used - 1 FROM ended WHERE s.name = ended.name"
        )
        return acquire, release
    if backend == "mariadb":
        # The token goes through a session variable (NULL: no room, and the INSERT inserts nothing).
        acquire = (
            "START TRANSACTION; SET @lease_floor_token = NULL;"
            f" UPDATE {sem} SET used = used + 1, last_token = (@lease_floor_token := last_token + 1)"
            " WHERE name = %s AND used + 1 <= capacity;"
            f" INSERT INTO {lease} (owner, lease_key, name, token, expires_at_ms)"
            f" SELECT %s, %s, %s, @lease_floor_token, {now} + {LEASE_TTL_MS} FROM DUAL"
            " WHERE @lease_floor_token IS NOT NULL RETURNING token; COMMIT"
        )
        release = (
            f"START TRANSACTION; UPDATE {sem} s JOIN {lease} l ON l.name = s.name SET s.used = s.used - 1"
            " WHERE l.owner = %s AND l.lease_key = %s;"
            f" DELETE FROM {lease} WHERE owner = %s AND lease_key = %s; COMMIT"
        )
        return acquire, release
    # SQLite: one transaction of plain statements (there is no round trip to save).
    acquire = (
        f"UPDATE {sem} SET used = used + 1, last_token = last_token + 1"
        " WHERE name = ? AND used + 1 <= capacity RETURNING last_token"
    )
    release = f"DELETE FROM {lease} WHERE owner = ? AND lease_key = ? RETURNING name"
    return acquire, release


class LeaseFloorSystem:
    name = "lease-floor"
    #: how many leases are still held (``verify``): every row, since a release deletes its lease
    held_leases = f"SELECT COUNT(*) FROM {LEASE_FLOOR_LEASE}"

    def setup(self, backend_url: str, scenario: Scenario) -> None:
        if scenario.per_acquire != 1:
            raise ValueError("the lease floor takes one semaphore per acquire")
        db = _Db(backend_url)
        try:
            engine = " ENGINE=InnoDB" if db.backend == "mariadb" else ""
            db.run(f"DROP TABLE IF EXISTS {LEASE_FLOOR_LEASE}")
            db.run(f"DROP TABLE IF EXISTS {LEASE_FLOOR_SEMAPHORE}")
            db.run(
                f"CREATE TABLE {LEASE_FLOOR_SEMAPHORE} ("
                " name VARCHAR(255) NOT NULL PRIMARY KEY, capacity INTEGER NOT NULL,"
                f" used INTEGER NOT NULL DEFAULT 0, last_token BIGINT NOT NULL DEFAULT 0){engine}"
            )
            # The key is the primary key: the index a retry (and a release) finds its lease by.
            db.run(
                f"CREATE TABLE {LEASE_FLOOR_LEASE} ("
                " owner VARCHAR(255) NOT NULL, lease_key VARCHAR(255) NOT NULL, name VARCHAR(255) NOT NULL,"
                f" token BIGINT NOT NULL, expires_at_ms BIGINT NOT NULL, PRIMARY KEY (owner, lease_key)){engine}"
            )
            insert = db.sql(f"INSERT INTO {LEASE_FLOOR_SEMAPHORE} (name, capacity) VALUES (%s, %s)")
            for name in scenario.all_semaphores():
                db.run(insert, (name, scenario.capacity))
        finally:
            db.close()

    def load_history(self, backend_url: str, scenario: Scenario, rows: int) -> None:
        """Nothing to load: the lease floor deletes a lease when it is released."""

    def make_client(self, backend_url: str, scenario: Scenario, client_index: int) -> LeaseFloorClient:
        (name,) = scenario.semaphores_for(client_index)
        return LeaseFloorClient(backend_url, name, client_index)

    def verify(self, backend_url: str, scenario: Scenario) -> list[str]:
        db = _Db(backend_url)
        try:
            used = db.all(f"SELECT name, used FROM {LEASE_FLOOR_SEMAPHORE} WHERE used <> 0")
            held = db.one(self.held_leases)[0]
        finally:
            db.close()
        problems = [f"semaphore {name!r} still has used={n}" for name, n in used]
        if held:
            problems.append(f"{held} leases still held after every client released")
        return problems


class LeaseFloorClient:
    def __init__(self, backend_url: str, name: str, client_index: int) -> None:
        self._backend = backend_of(backend_url)
        if self._backend == "mariadb":
            # One request per transaction needs several statements per request.
            import pymysql.constants.CLIENT

            self._conn: Any = connect(backend_url, client_flag=pymysql.constants.CLIENT.MULTI_STATEMENTS)
        else:
            self._conn = connect(backend_url)
        self._cur: Any = self._conn.cursor()
        self._name, self._owner = name, f"lease-floor-{client_index}"
        self._acquire, self._release = _lease_floor_statements(self._backend)
        self._insert = (
            f"INSERT INTO {LEASE_FLOOR_LEASE} (owner, lease_key, name, token, expires_at_ms)"
            f" VALUES (?, ?, ?, ?, {_NOW_MS['sqlite']} + {LEASE_TTL_MS})"
        )
        self._give_back = f"UPDATE {LEASE_FLOOR_SEMAPHORE} SET used = used - 1 WHERE name = ?"
        self._serial = 0

    def cycle(self) -> bool:
        self._serial += 1
        key = f"k{self._serial}"
        if self._backend == "sqlite":
            return self._cycle_sqlite(key)
        if self._backend == "postgresql":
            self._cur.execute(self._acquire, (self._name, self._owner, key), prepare=True)
            if self._cur.fetchone() is None:
                return False
            self._cur.execute(self._release, (self._owner, key), prepare=True)
            return True
        self._cur.execute(self._acquire, (self._name, self._owner, key, self._name))
        granted = False
        while True:  # read every result, so the connection is ready for the next request
            if self._cur.description is not None and self._cur.fetchone() is not None:
                granted = True
            if not self._cur.nextset():
                break
        if granted:
            self._cur.execute(self._release, (self._owner, key, self._owner, key))
            while self._cur.nextset():
                pass
        return granted

    def _cycle_sqlite(self, key: str) -> bool:
        self._cur.execute("BEGIN IMMEDIATE")
        try:
            row = self._cur.execute(self._acquire, (self._name,)).fetchone()
            if row is not None:
                self._cur.execute(self._insert, (self._owner, key, self._name, row[0]))
            self._cur.execute("COMMIT" if row is not None else "ROLLBACK")
        except BaseException:
            with contextlib.suppress(Exception):
                self._conn.rollback()
            raise
        if row is None:
            return False
        # SQLite's write lock is not fair between processes, so a release can outwait the busy timeout
        # under load: retry it, as a client that holds a lease would, rather than leave the permit held.
        for attempt in range(RELEASE_ATTEMPTS):
            try:
                self._cur.execute("BEGIN IMMEDIATE")
                (name,) = self._cur.execute(self._release, (self._owner, key)).fetchone()
                self._cur.execute(self._give_back, (name,))
                self._cur.execute("COMMIT")
                return True
            except sqlite3.OperationalError:
                with contextlib.suppress(Exception):
                    self._conn.rollback()
                if attempt + 1 == RELEASE_ATTEMPTS:
                    raise
        return True  # pragma: no cover - the loop returns or raises

    def close(self) -> None:
        try:
            self._cur.close()
        finally:
            self._conn.close()


# --------------------------------------------------------------------------
# seed
# --------------------------------------------------------------------------

SEMAPHORE = "bench_seed_semaphore"
REQUEST = "bench_seed_permit_request"
PERMIT = "bench_seed_permit"
STATE_TYPE = "bench_seed_state"  # PostgreSQL enum type

# Named so that load_history can set them aside on PostgreSQL.
PERMIT_FKS = (
    ("bench_seed_permit_semaphore_fk", f"(semaphore_id) REFERENCES {SEMAPHORE} (id)"),
    ("bench_seed_permit_request_fk", f"(permit_request_id) REFERENCES {REQUEST} (id)"),
)

# The seed retries a transaction that lost a deadlock; 3 attempts in all.
MAX_ATTEMPTS = 3

# Column types that differ per backend. The seed's schema is MySQL; these are
# its closest equivalents. AUTOINCREMENT on SQLite keeps ids strictly
# increasing even after deletes, as the seed relies on permit.id as a fencing
# token. MariaDB alone has ON UPDATE CURRENT_TIMESTAMP; elsewhere the release
# statement sets updated_at itself so that every backend does the same work.
_TYPES: dict[str, dict[str, str]] = {
    "mariadb": {
        "id": "BIGINT UNSIGNED AUTO_INCREMENT PRIMARY KEY",
        "ref": "BIGINT UNSIGNED",
        "state": "ENUM('ACQUIRED', 'RELEASED')",
        "created": "TIMESTAMP DEFAULT CURRENT_TIMESTAMP",
        "updated": "TIMESTAMP DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP",
        "suffix": " ENGINE=InnoDB",
    },
    "postgresql": {
        "id": "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
        "ref": "BIGINT",
        "state": STATE_TYPE,
        "created": "TIMESTAMPTZ DEFAULT CURRENT_TIMESTAMP",
        "updated": "TIMESTAMPTZ DEFAULT CURRENT_TIMESTAMP",
        "suffix": "",
    },
    "sqlite": {
        "id": "INTEGER PRIMARY KEY AUTOINCREMENT",
        "ref": "INTEGER",
        "state": "TEXT CHECK (state IN ('ACQUIRED', 'RELEASED'))",
        "created": "TIMESTAMP DEFAULT CURRENT_TIMESTAMP",
        "updated": "TIMESTAMP DEFAULT CURRENT_TIMESTAMP",
        "suffix": "",
    },
}


def _seed_schema(backend: str) -> list[str]:
    """DROP and CREATE statements for the seed's three tables and indexes."""
    t = _TYPES[backend]
    # The seed declares both permit indexes inside CREATE TABLE (MySQL
    # syntax); index names are per schema elsewhere, hence the prefix.
    inline_indexes = ""
    if backend == "mariadb":
        inline_indexes = (
            ", INDEX bench_seed_idx_semaphore_state (semaphore_id, state)"
            ", INDEX bench_seed_idx_request (permit_request_id)"
        )
    statements = [
        f"DROP TABLE IF EXISTS {PERMIT}",
        f"DROP TABLE IF EXISTS {REQUEST}",
        f"DROP TABLE IF EXISTS {SEMAPHORE}",
    ]
    if backend == "postgresql":
        statements += [
            f"DROP TYPE IF EXISTS {STATE_TYPE}",
            f"CREATE TYPE {STATE_TYPE} AS ENUM ('ACQUIRED', 'RELEASED')",
        ]
    statements += [
        f"CREATE TABLE {SEMAPHORE} ("
        f" id {t['id']},"
        " name VARCHAR(255) NOT NULL UNIQUE,"
        " capacity INTEGER NOT NULL,"
        f" created_at {t['created']},"
        f" updated_at {t['updated']}"
        f"){t['suffix']}",
        f"CREATE TABLE {REQUEST} ("
        f" id {t['id']},"
        " external_id VARCHAR(255) NOT NULL UNIQUE,"
        " owner VARCHAR(255),"
        f" state {t['state']} NOT NULL,"
        " ttl_seconds INTEGER,"
        f" created_at {t['created']},"
        f" updated_at {t['updated']}"
        f"){t['suffix']}",
        # Foreign keys as explicit table constraints: MySQL silently ignores a
        # column-level REFERENCES, MariaDB >= 10.5 enforces it; spelling them
        # out makes every backend enforce them.
        f"CREATE TABLE {PERMIT} ("
        f" id {t['id']},"
        f" semaphore_id {t['ref']} NOT NULL,"
        f" permit_request_id {t['ref']} NOT NULL,"
        " count INTEGER NOT NULL DEFAULT 1,"
        f" state {t['state']} NOT NULL,"
        f" CONSTRAINT {PERMIT_FKS[0][0]} FOREIGN KEY {PERMIT_FKS[0][1]},"
        f" CONSTRAINT {PERMIT_FKS[1][0]} FOREIGN KEY {PERMIT_FKS[1][1]}"
        f"{inline_indexes}"
        f"){t['suffix']}",
    ]
    if backend != "mariadb":
        statements += [
            f"CREATE INDEX bench_seed_idx_semaphore_state ON {PERMIT} (semaphore_id, state)",
            f"CREATE INDEX bench_seed_idx_request ON {PERMIT} (permit_request_id)",
        ]
    return statements


@dataclass(frozen=True)
class _SeedStatements:
    """The seed's statements, in the placeholder style of one backend."""

    begin: str
    set_lock_timeout: str | None
    reset_lock_timeout: str | None
    find_request: str
    lock_semaphore: str
    sum_acquired: str
    insert_request: str
    insert_permit: str
    release_permits: str
    release_request: str

    @classmethod
    def build(cls, db: _Db) -> _SeedStatements:
        backend = db.backend
        # SQLite has no row locks: BEGIN IMMEDIATE takes the database write
        # lock up front, which serialises acquirers as FOR UPDATE would, and
        # its wait is bounded by the busy timeout set in connect().
        begin = {"mariadb": "START TRANSACTION", "postgresql": "BEGIN", "sqlite": "BEGIN IMMEDIATE"}
        set_timeout = {
            "mariadb": f"SET SESSION innodb_lock_wait_timeout = {LOCK_WAIT_SECONDS}",
            # SET LOCAL ends with the transaction, so PostgreSQL needs no reset.
            "postgresql": f"SET LOCAL lock_timeout = '{LOCK_WAIT_SECONDS}s'",
        }
        for_update = "" if backend == "sqlite" else " FOR UPDATE"
        touch = "" if backend == "mariadb" else ", updated_at = CURRENT_TIMESTAMP"
        returning = " RETURNING id" if backend == "postgresql" else ""
        return cls(
            begin=begin[backend],
            set_lock_timeout=set_timeout.get(backend),
            reset_lock_timeout=("SET SESSION innodb_lock_wait_timeout = DEFAULT" if backend == "mariadb" else None),
            find_request=db.sql(f"SELECT id, state FROM {REQUEST} WHERE external_id = %s"),
            lock_semaphore=db.sql(f"SELECT id, capacity FROM {SEMAPHORE} WHERE name = %s{for_update}"),
            sum_acquired=db.sql(f"SELECT SUM(count) FROM {PERMIT} WHERE semaphore_id = %s AND state = 'ACQUIRED'"),
            insert_request=db.sql(
                f"INSERT INTO {REQUEST} (external_id, owner, state, ttl_seconds)"
                f" VALUES (%s, %s, 'ACQUIRED', %s){returning}"
            ),
            insert_permit=db.sql(
                f"INSERT INTO {PERMIT} (semaphore_id, permit_request_id, count, state) VALUES (%s, %s, %s, 'ACQUIRED')"
            ),
            release_permits=db.sql(
                f"UPDATE {PERMIT} SET state = 'RELEASED' WHERE permit_request_id = %s AND state != 'RELEASED'"
            ),
            release_request=db.sql(f"UPDATE {REQUEST} SET state = 'RELEASED'{touch} WHERE id = %s"),
        )


def _is_deadlock(exc: BaseException) -> bool:
    if isinstance(exc, pymysql.err.MySQLError):
        return bool(exc.args) and exc.args[0] == 1213  # ER_LOCK_DEADLOCK
    return isinstance(exc, psycopg.errors.DeadlockDetected)


def _is_duplicate_key(exc: BaseException) -> bool:
    if isinstance(exc, pymysql.err.IntegrityError):
        return bool(exc.args) and exc.args[0] == 1062  # ER_DUP_ENTRY
    if isinstance(exc, sqlite3.IntegrityError):
        return "UNIQUE" in str(exc)
    return isinstance(exc, psycopg.errors.UniqueViolation)


class SeedSystem:
    name = "seed"

    def setup(self, backend_url: str, scenario: Scenario) -> None:
        db = _Db(backend_url)
        try:
            for statement in _seed_schema(db.backend):
                db.run(statement)
            insert = db.sql(f"INSERT INTO {SEMAPHORE} (name, capacity) VALUES (%s, %s)")
            for name in scenario.all_semaphores():
                db.run(insert, (name, scenario.capacity))
        finally:
            db.close()

    def load_history(self, backend_url: str, scenario: Scenario, rows: int) -> None:
        """Add ``rows`` RELEASED requests, one RELEASED permit each, spread
        round-robin over the scenario's semaphores, as a long-running service
        would have accumulated before its 7-day cleanup.

        Generated server-side with one INSERT ... SELECT per table so that a
        million rows take seconds, not a million round trips.
        """
        db = _Db(backend_url)
        try:
            ids = [row[0] for row in db.all(f"SELECT id FROM {SEMAPHORE} ORDER BY id")]
            first, n = ids[0], len(ids)
            # Freshly created tables number their rows 1, 2, ...; rely on it to
            # map request i to semaphore first + i % n without a join.
            if ids != list(range(first, first + n)):
                raise RuntimeError(f"semaphore ids are not contiguous: {ids[:5]}...")
            columns = f"{REQUEST} (external_id, owner, state, created_at, updated_at)"
            if db.backend == "mariadb":
                # seq_1_to_N is a virtual table of the Sequence engine.
                db.run(
                    f"INSERT INTO {columns} SELECT CONCAT('history-', seq), 'history',"
                    " 'RELEASED', NOW() - INTERVAL 1 DAY, NOW() - INTERVAL 1 DAY"
                    f" FROM seq_1_to_{rows:d}"
                )
            elif db.backend == "postgresql":
                db.run(
                    f"INSERT INTO {columns} SELECT 'history-' || g, 'history', 'RELEASED',"
                    " now() - interval '1 day', now() - interval '1 day'"
                    f" FROM generate_series(1, {rows:d}) AS g"
                )
            else:
                db.run(
                    f"WITH RECURSIVE g(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM g WHERE x < {rows:d})"
                    f" INSERT INTO {columns} SELECT 'history-' || x, 'history', 'RELEASED',"
                    " datetime('now', '-1 day'), datetime('now', '-1 day') FROM g"
                )
            # The rows are valid by construction, so skip the per-row foreign
            # key checks (a third of the load time otherwise): PostgreSQL
            # re-adds the constraints afterwards, which validates all rows in
            # one join; MariaDB and SQLite only switch checks off for this
            # connection.
            if db.backend == "postgresql":
                for fk_name, _ in PERMIT_FKS:
                    db.run(f"ALTER TABLE {PERMIT} DROP CONSTRAINT {fk_name}")
            elif db.backend == "mariadb":
                db.run("SET SESSION foreign_key_checks = 0")
            else:
                db.run("PRAGMA foreign_keys = OFF")
            db.run(
                f"INSERT INTO {PERMIT} (semaphore_id, permit_request_id, count, state)"
                f" SELECT {first:d} + id % {n:d}, id, 1, 'RELEASED' FROM {REQUEST}"
            )
            if db.backend == "postgresql":
                for fk_name, fk_definition in PERMIT_FKS:
                    db.run(f"ALTER TABLE {PERMIT} ADD CONSTRAINT {fk_name} FOREIGN KEY {fk_definition}")
            # Fresh statistics (and, on PostgreSQL, a vacuumed visibility map)
            # so the run measures the steady state, not the planner or
            # autovacuum catching up with a bulk load mid-run.
            if db.backend == "mariadb":
                for table in (SEMAPHORE, REQUEST, PERMIT):
                    db.all(f"ANALYZE TABLE {table}")
            elif db.backend == "postgresql":
                for table in (SEMAPHORE, REQUEST, PERMIT):
                    db.run(f"VACUUM (ANALYZE) {table}")
            else:
                db.run("ANALYZE")
        finally:
            db.close()

    def make_client(self, backend_url: str, scenario: Scenario, client_index: int) -> SeedClient:
        return SeedClient(backend_url, scenario.semaphores_for(client_index), client_index)

    def verify(self, backend_url: str, scenario: Scenario) -> list[str]:
        db = _Db(backend_url)
        try:
            permits = db.one(f"SELECT COUNT(*) FROM {PERMIT} WHERE state = 'ACQUIRED'")[0]
            requests = db.one(f"SELECT COUNT(*) FROM {REQUEST} WHERE state = 'ACQUIRED'")[0]
        finally:
            db.close()
        problems = []
        if permits:
            problems.append(f"{permits} permits still ACQUIRED after every client released")
        if requests:
            problems.append(f"{requests} requests still ACQUIRED after every client released")
        return problems


class SeedClient:
    def __init__(self, backend_url: str, names: Sequence[str], client_index: int) -> None:
        self._db = _Db(backend_url)
        self._s = _SeedStatements.build(self._db)
        # Sorted once: every acquirer locks semaphores in the same global
        # order, so multi-semaphore acquires cannot wait on each other in a
        # cycle (the seed's deadlock fix).
        self._names = sorted(names)
        self._owner = f"bench-client-{client_index}"
        self._count = 1
        self._ttl_seconds: int | None = None
        self.deadlock_retries = 0
        self.duplicate_keys = 0

    def cycle(self) -> bool:
        # A fresh idempotency key per operation, as a caller would pass its
        # own operation id.
        external_id = str(uuid.uuid4())
        if not self.acquire(external_id):
            return False
        self.release(external_id)
        return True

    def acquire(self, external_id: str) -> bool:
        db, s = self._db, self._s
        # Idempotency check first: a retried call gets the first outcome
        # without taking any lock.
        found = db.one(s.find_request, (external_id,))
        if found is not None:
            return bool(found[1] == "ACQUIRED")
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                return self._acquire_once(external_id)
            except Exception as exc:
                db.rollback_quietly()
                if _is_duplicate_key(exc):
                    # A concurrent call with the same key passed the check
                    # above too and inserted first; the UNIQUE constraint
                    # stopped us. Its outcome is ours.
                    self.duplicate_keys += 1
                    found = db.one(s.find_request, (external_id,))
                    if found is None:
                        raise
                    return bool(found[1] == "ACQUIRED")
                if _is_deadlock(exc) and attempt < MAX_ATTEMPTS:
                    self.deadlock_retries += 1
                    continue
                raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _acquire_once(self, external_id: str) -> bool:
        db, s = self._db, self._s
        db.run(s.begin)
        if s.set_lock_timeout:
            db.run(s.set_lock_timeout)
        locked: list[tuple[int, int]] = []
        for name in self._names:
            row = db.one(s.lock_semaphore, (name,))
            if row is None:
                raise LookupError(f"no semaphore named {name!r}")
            locked.append((row[0], row[1]))
        # With the semaphore rows locked no other acquirer can add permits, so
        # the sums stay true until COMMIT. Under InnoDB's REPEATABLE READ the
        # snapshot is taken by this first plain SELECT, i.e. after the lock was
        # granted, so it sees every acquire committed before ours.
        for semaphore_id, capacity in locked:
            used = db.one(s.sum_acquired, (semaphore_id,))[0]
            if int(used or 0) + self._count > capacity:
                db.run("ROLLBACK")
                return False
        if db.backend == "postgresql":
            request_id = db.one(s.insert_request, (external_id, self._owner, self._ttl_seconds))[0]
        else:
            db.run(s.insert_request, (external_id, self._owner, self._ttl_seconds))
            request_id = db.cur.lastrowid
        for semaphore_id, _ in locked:
            db.run(s.insert_permit, (semaphore_id, request_id, self._count))
        if s.reset_lock_timeout:
            db.run(s.reset_lock_timeout)
        db.run("COMMIT")
        return True

    def release(self, external_id: str) -> None:
        db, s = self._db, self._s
        found = db.one(s.find_request, (external_id,))
        if found is None or found[1] != "ACQUIRED":
            return  # unknown, or already released: nothing to write
        request_id = found[0]
        # Deliberately two autocommit statements, permits first, as in the
        # seed: the state only moves ACQUIRED -> RELEASED and both WHEREs are
        # idempotent, so a crash in between is repaired by releasing again.
        db.run(s.release_permits, (request_id,))
        db.run(s.release_request, (request_id,))

    def stats(self) -> dict[str, int]:
        return {"deadlock_retries": self.deadlock_retries, "duplicate_keys": self.duplicate_keys}

    def close(self) -> None:
        self._db.close()


FLOOR = FloorSystem()
LEASE_FLOOR = LeaseFloorSystem()
SEED = SeedSystem()
