"""How each database error is handled: retried as a conflict, retried on a fresh connection, refused as a
read-only replica, or raised. Covers the engines of docs/engines.md that cannot run here (their errors
are built as their drivers report them); the ones that can run are also met for real by the tests."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy.engine import make_url

from permits.dialects.base import Fault
from permits.dialects.mysql import MariaDB, MySQL
from permits.dialects.postgresql import PostgreSQL
from tests.conftest import SERVER_URLS


class _MySQLError(Exception):
    """What PyMySQL raises: args are (error number, message)."""


class _PostgresError(Exception):
    """What psycopg raises: the SQLSTATE is an attribute."""

    def __init__(self, sqlstate: str) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


@pytest.mark.parametrize(
    ("code", "fault", "engine"),
    [
        (1213, Fault.CONFLICT, "MariaDB/MySQL deadlock; Galera certification failure; Vitess deadlock"),
        (1205, Fault.CONFLICT, "lock wait timeout"),
        (1467, Fault.CONFLICT, "InnoDB lost a wait for an AUTO-INC table lock (deadlock or timeout)"),
        (3101, Fault.CONFLICT, "MySQL Group Replication: rolled back at commit by certification"),
        (9007, Fault.CONFLICT, "TiDB optimistic mode: write conflict"),
        (8002, Fault.CONFLICT, "TiDB optimistic mode: SELECT FOR UPDATE write conflict"),
        (8022, Fault.CONFLICT, "TiDB: commit failed, safe to retry"),
        (8028, Fault.CONFLICT, "TiDB: schema changed"),
        (1047, Fault.UNAVAILABLE, "Galera node not synced"),
        (3100, Fault.UNAVAILABLE, "Group Replication member without quorum"),
        (9001, Fault.UNAVAILABLE, "TiDB: PD timeout"),
        (9002, Fault.UNAVAILABLE, "TiDB: TiKV timeout"),
        (9005, Fault.UNAVAILABLE, "TiDB: region unavailable"),
        (2013, Fault.UNAVAILABLE, "connection lost (an Aurora failover, a node killed)"),
        (1049, Fault.UNAVAILABLE, "no such database: a failed connection, as PostgreSQL's driver says"),
        (1044, Fault.UNAVAILABLE, "no access to that database: a failed connection"),
        (1045, Fault.OTHER, "a wrong password: not retried, each try would count towards locking the account"),
        (1698, Fault.OTHER, "access denied, no password given: not retried either"),
        (1290, Fault.READ_ONLY, "read_only / super_read_only: a replica, an Aurora reader, a GR secondary"),
        (1836, Fault.READ_ONLY, "read-only mode"),
        (1062, Fault.DUPLICATE, "duplicate key"),
        (1105, Fault.OTHER, "unknown error: raised, not retried"),
    ],
)
def test_mysql_family_errors(code: int, fault: Fault, engine: str) -> None:
    for dialect in (MariaDB(), MySQL()):
        assert dialect._classify(_MySQLError(code, engine)) is fault, engine


@pytest.mark.parametrize(
    ("sqlstate", "fault", "engine"),
    [
        ("40001", Fault.CONFLICT, "serialization failure: PostgreSQL, CockroachDB, YugabyteDB retries"),
        ("40P01", Fault.CONFLICT, "deadlock"),
        ("55P03", Fault.CONFLICT, "lock_timeout"),
        ("40003", Fault.UNAVAILABLE, "CockroachDB: statement completion unknown (ambiguous commit)"),
        ("57P01", Fault.UNAVAILABLE, "admin shutdown (a restart, a failover)"),
        ("57P03", Fault.UNAVAILABLE, "cannot connect now: starting up, or being promoted"),
        ("08006", Fault.UNAVAILABLE, "connection failure"),
        ("25006", Fault.READ_ONLY, "read-only transaction: a hot standby, an Aurora reader"),
        ("23505", Fault.DUPLICATE, "unique violation"),
        ("42601", Fault.OTHER, "syntax error: raised, not retried"),
    ],
)
def test_postgresql_family_errors(sqlstate: str, fault: Fault, engine: str) -> None:
    assert PostgreSQL()._classify(_PostgresError(sqlstate)) is fault, engine


def test_only_conflicts_and_outages_are_retried() -> None:
    assert {f for f in Fault if f.retryable} == {Fault.CONFLICT, Fault.UNAVAILABLE}


def _refused_connection(url: str) -> BaseException:
    try:
        psycopg.connect(url, connect_timeout=5).close()
    except psycopg.OperationalError as exc:
        return exc
    raise AssertionError(f"{url} connected")


def test_a_postgresql_login_refused_is_not_an_outage() -> None:
    """libpq reports every failed connection without a SQLSTATE. A login the server refuses (no such role, a
    wrong password, no pg_hba.conf entry) is raised at once, as MariaDB's access denied is: retrying it would
    count failed logins, and ``permits run`` would wait through it as an outage. A database that does not
    exist yet, or a server that does not answer, is still retried. Met for real on the shared server (trust
    authentication: no password can be wrong there, so that one is built as psycopg reports it)."""
    server = make_url(SERVER_URLS["postgresql"])
    base = f"postgresql://{server.username or 'postgres'}@{server.host}:{server.port or 5432}"
    no_role = _refused_connection(f"postgresql://no_such_role_here@{server.host}:{server.port or 5432}/postgres")
    assert "does not exist" in str(no_role)
    assert PostgreSQL()._classify(no_role) is Fault.OTHER
    assert PostgreSQL()._classify(_refused_connection(f"{base}/no_such_database_here")) is Fault.UNAVAILABLE
    assert PostgreSQL()._classify(_refused_connection(f"postgresql://u@{server.host}:1/x")) is Fault.UNAVAILABLE
    for refusal in (
        'FATAL:  password authentication failed for user "app"',
        'FATAL:  no pg_hba.conf entry for host "10.0.0.7", user "app", database "permits", no encryption',
        'FATAL:  role "app" is not permitted to log in',
        "fe_sendauth: no password supplied",  # libpq's own, before any FATAL: a cron line without PGPASSWORD
        'FATAL:  pg_hba.conf rejects connection for host "10.0.0.7", user "app", database "permits"',
        'FATAL:  permission denied for database "permits"',
        "FATAL:  unsupported startup parameter: options",  # PgBouncer before 1.20
    ):
        reported = psycopg.OperationalError(
            f'connection failed: connection to server at "db", port 5432 failed: {refusal}'
        )
        assert PostgreSQL()._classify(reported) is Fault.OTHER, refusal
