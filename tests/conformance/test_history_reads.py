"""Reads that must not grow with the history: held leases are few (at most the sum of the capacities, plus
expired ones not yet swept), ended ones grow until cleanup deletes them. Each statement below runs on a
database whose one semaphore has HISTORY old leases, and must read a handful of rows, not the history.

What counts is the rows the engine read, not time: PostgreSQL's and MariaDB's own counts of the rows
each plan step read (``EXPLAIN ANALYZE`` / ``ANALYZE FORMAT=JSON``), and for SQLite the virtual machine's
steps (a progress handler). PostgreSQL is analyzed first, as autovacuum does (its default): without
statistics its planner guesses. SQLite runs twice: as permits leaves it (no statistics, SQLite's default)
and after ``ANALYZE`` (which a user may run), whose per-column averages once made the planner scan the
lease table for a reclaim (migration 0007).

Before migration 0007 and these statements, with 1,000,000 old rows: SQLite read a semaphore's whole
history for its holders (100 ms), its refusal read and its reclaim scanned the lease table (after
ANALYZE); PostgreSQL without statistics read it for the holders, the gauges and the dashboard's feed
(0.6-1 s each). The reconcile check (``DRIFT_CHECK``) reads every permit row by design: it looks for
permits whose lease is gone (docs/api.md).
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

import permits
from permits.dialects.base import Dialect
from permits.dialects.mysql import MariaDB
from permits.dialects.postgresql import PostgreSQL
from permits.dialects.sqlite import SQLite
from tests.conftest import own_database, sqlalchemy_url

HISTORY = 20_000
#: rows a statement may read (PostgreSQL, MariaDB): a scan of the history reads HISTORY
ROWS = 300
#: SQLite virtual machine steps a statement may take: a scan of the history takes several per row
STEPS = 20_000

FLAT = [
    "REFUSAL_READ",
    "LEASE_FIND",
    "HOLDERS",
    "HELD_OWNERS",
    "HELD_BY_OWNER",
    "HELD_OLDER_THAN",
    "LEASES_HELD_BY",
    "LEASES_PER_SEMAPHORE",
    "EXPIRED_BATCH",
    "EXPIRED_FOR_SEMS",
    "LEASES_HOLDING",
    "USED_ACTUAL_ONE",
    "TOKEN_HIGHEST_ONE",
    "ENDED_OLDER_THAN",
    "EVENTS_HEAD",
    "EVENTS_GRANTS",
    "EVENTS_ENDS",
    "STAT_ENDED",
    "ENDINGS",
]

_SERIES = {
    "sqlite": f"WITH RECURSIVE seq(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM seq WHERE i < {HISTORY})"
    " SELECT i FROM seq",
    "mysql": f"SELECT seq AS i FROM seq_1_to_{HISTORY}",
    "postgresql": f"SELECT i FROM generate_series(1, {HISTORY}) AS i",
}


def _load(url: str, backend: str) -> dict[str, Any]:
    """The schema, a semaphore with HISTORY old leases, two held ones and one held past its expiry, a second
    semaphore with nothing; returns the statements' parameters."""
    with permits.connect(url, auto_upgrade=True, owner="holder") as client:
        client.create_semaphore("hot", 10)
        client.create_semaphore("other", 10)
        client.acquire("hot", ttl=300)
        client.acquire("hot", ttl=300)
        client.acquire("hot", ttl=0.001)
    engine = create_engine(sqlalchemy_url(url))
    concat = "CONCAT('h', i)" if backend == "mysql" else "'h' || CAST(i AS TEXT)"
    try:
        with engine.begin() as conn:
            sem_id = conn.execute(text("SELECT id FROM permits_semaphore WHERE name = 'hot'")).scalar_one()
            base = conn.execute(text("SELECT MAX(id) FROM permits_lease")).scalar_one()
            conn.execute(
                text(
                    "INSERT INTO permits_lease"
                    " (id, owner, lease_key, state, end_reason, acquired_at_ms, expires_at_ms, ended_at_ms)"
                    f" SELECT {base} + i, 'history', {concat}, 0, 'released', 1000 + i, 61000 + i, 2000 + i"
                    f" FROM ({_SERIES[backend]}) s"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO permits_permit (lease_id, semaphore_id, count, token)"
                    f" SELECT id, {sem_id}, 1, id + 1000 FROM permits_lease WHERE owner = 'history'"
                )
            )
            conn.execute(text(f"UPDATE permits_semaphore SET last_token = {base + HISTORY + 1000} WHERE id = {sem_id}"))
        head = base + HISTORY
    finally:
        engine.dispose()
    return {
        "name": "hot",
        "names": ["hot", "other"],
        "sem_id": sem_id,
        "sem_ids": [sem_id],
        "owner": "holder",
        "key": "no-such-key",
        "exact": "holder",
        "low": "holder/",
        "high": "holder0",
        "age_ms": 1000,
        "after": head - 1,
        "settle_ms": 0,
        "since_ms": 10**9,  # after every old ending
        "until_ms": 10**13,
        "limit": 50,
        "ids": [1, 2, 3],
    }


def _statement(dialect: Dialect, name: str, params: dict[str, Any], placeholder: Callable[[str], str]) -> str:
    """The statement as the dialect sends it, with ``placeholder(param)`` for each parameter (a list one, as
    SQLAlchemy expands it, as one placeholder per item)."""
    sql = re.sub(r"\(__\[POSTCOMPILE_(\w+)\]\)", r"(:\1)", dialect.sql(name))

    def one(match: re.Match[str]) -> str:
        key = match.group(1)
        if isinstance(params[key], list) and "= ANY(:" + key not in sql:
            return ", ".join(placeholder(f"{key}_{i}") for i in range(len(params[key])))
        return placeholder(key)

    return re.sub(r"(?<!:):([a-z_]+)", one, sql)


def _flat_params(params: dict[str, Any]) -> dict[str, Any]:
    flat = dict(params)
    for key, value in params.items():
        if isinstance(value, list):
            flat.update({f"{key}_{i}": item for i, item in enumerate(value)})
    return flat


def _postgresql_rows(url: str, params: dict[str, Any]) -> dict[str, int]:
    import psycopg

    def read(node: dict[str, Any]) -> int:
        own = 0
        if "Relation Name" in node or "Index Name" in node:
            own = (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)) * node.get("Actual Loops", 1)
        return own + sum(read(child) for child in node.get("Plans", []))

    flat = _flat_params(params)
    found = {}
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        conn.execute("ANALYZE")
        for name in FLAT:
            sql = _statement(PostgreSQL(), name, params, lambda key: f"%({key})s")
            ((plan,),) = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, flat).fetchall()
            found[name] = read(plan[0]["Plan"])
    return found


def _mariadb_rows(url: str, params: dict[str, Any]) -> dict[str, int]:
    def read(node: Any) -> int:
        if isinstance(node, list):
            return sum(read(item) for item in node)
        if not isinstance(node, dict):
            return 0
        table = node.get("table")
        own = int((table.get("r_rows") or 0) * (table.get("r_loops") or 1)) if isinstance(table, dict) else 0
        return own + sum(read(value) for value in node.values())

    flat = _flat_params(params)
    engine = create_engine(sqlalchemy_url(url))
    found = {}
    try:
        with engine.connect() as conn:
            conn.execute(text("ANALYZE TABLE permits_lease, permits_permit, permits_semaphore"))
            for name in FLAT:
                sql = _statement(MariaDB(), name, params, lambda key: f":{key}")
                (plan,) = conn.execute(text("ANALYZE FORMAT=JSON " + sql), flat).one()
                found[name] = read(json.loads(plan))
    finally:
        engine.dispose()
    return found


def _steps(conn: sqlite3.Connection, sql: str, params: dict[str, Any]) -> int:
    """SQLite virtual machine steps (to the nearest hundred) that running ``sql`` takes."""
    steps = [0]

    def count() -> int:
        steps[0] += 100
        return 0

    conn.set_progress_handler(count, 100)
    try:
        conn.execute(sql, {k: v for k, v in params.items() if f":{k}" in sql}).fetchall()
    finally:
        conn.set_progress_handler(None, 0)
    return steps[0]


def _sqlite_steps(path: Path, params: dict[str, Any]) -> dict[str, int]:
    flat = _flat_params(params)
    conn = sqlite3.connect(path)
    try:
        return {name: _steps(conn, _statement(SQLite(), name, params, lambda key: f":{key}"), flat) for name in FLAT}
    finally:
        conn.close()


@pytest.fixture(params=["sqlite", "sqlite-analyzed", "mysql", "postgresql"])
def reads(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[dict[str, int], int]]:
    """What each statement of FLAT read on a database with HISTORY old leases, and the most it may read."""
    backend = str(request.param)
    if backend.startswith("sqlite"):
        path = tmp_path / "history.db"
        params = _load(f"sqlite:///{path}", "sqlite")
        if backend == "sqlite-analyzed":
            with sqlite3.connect(path) as conn:
                conn.execute("ANALYZE")
        yield _sqlite_steps(path, params), STEPS
        return
    with own_database(backend, "permits_history") as url:
        params = _load(url, backend)
        found = _postgresql_rows(url, params) if backend == "postgresql" else _mariadb_rows(url, params)
        yield found, ROWS


def test_reads_of_held_leases_and_recent_events_do_not_grow_with_the_history(reads: tuple[dict[str, int], int]) -> None:
    found, most = reads
    print(found)  # shown with -s
    assert set(found) == set(FLAT)
    grown = {name: n for name, n in found.items() if n > most}
    assert not grown, f"read more than {most} with {HISTORY} old leases: {grown}"


def _drift_check_steps(path: Path, semaphores: int) -> int:
    """SQLite's steps for DRIFT_CHECK over ``semaphores`` semaphores, each with one held lease."""
    with permits.connect(f"sqlite:///{path}", auto_upgrade=True) as client:
        client.list_semaphores()  # the schema
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM permits_permit")
        conn.execute("DELETE FROM permits_lease")
        conn.execute("DELETE FROM permits_semaphore")
        for i in range(1, semaphores + 1):
            conn.execute(
                "INSERT INTO permits_semaphore (id, name, capacity, used, last_token, deleted, created_at_ms,"
                " updated_at_ms) VALUES (?, ?, 1, 1, 1, 0, 0, 0)",
                (i, f"s{i}"),
            )
            conn.execute(
                "INSERT INTO permits_lease (id, owner, lease_key, state, acquired_at_ms, expires_at_ms)"
                " VALUES (?, 'o', ?, 1, 0, 99999999999999)",
                (i, f"k{i}"),
            )
            conn.execute(
                "INSERT INTO permits_permit (lease_id, semaphore_id, count, token) VALUES (?, ?, 1, 1)", (i, i)
            )
    conn = sqlite3.connect(path)
    try:
        return _steps(conn, _statement(SQLite(), "DRIFT_CHECK", {}, lambda key: f":{key}"), {})
    finally:
        conn.close()


def test_the_reconcile_check_grows_with_the_semaphores_not_with_their_square(tmp_path: Path) -> None:
    """Each semaphore's held permits are summed in one pass over the held leases, not by a pass per
    semaphore (which took 5 s with 5,000 semaphores, each with a lease)."""
    small = _drift_check_steps(tmp_path / "small.db", 200)
    large = _drift_check_steps(tmp_path / "large.db", 2000)
    assert large < 20 * small, (small, large)  # ten times the semaphores: about ten times the steps


def test_the_reconcile_check_does_read_the_history(tmp_path: Path) -> None:
    """The counter-check: the measure sees a statement that reads every permit row."""
    path = tmp_path / "history.db"
    params = _load(f"sqlite:///{path}", "sqlite")
    conn = sqlite3.connect(path)
    try:
        steps = _steps(conn, _statement(SQLite(), "DRIFT_CHECK", params, lambda key: f":{key}"), params)
    finally:
        conn.close()
    assert steps > 5 * STEPS
