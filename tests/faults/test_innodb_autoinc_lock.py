"""A grant on MariaDB that loses a wait for InnoDB's AUTO-INC table lock is retried, not raised.

With innodb_autoinc_lock_mode = 1 (MariaDB's default), an INSERT ... SELECT holds a table-level AUTO-INC
lock until the statement ends, and a grant of one semaphore inserts its lease row that way. A grant that
waits for that lock and loses (a deadlock victim, or a lock wait timeout) gets error 1467, "Failed to read
auto-increment value from storage engine", in place of 1213 or 1205. CI met it once as a deadlock of three
(a grant holding the lease table's AUTO-INC lock, waiting on a release's gap lock; the release waiting on
a second grant's semaphore row; that grant waiting on the AUTO-INC lock): a child of
tests/concurrency/test_many_processes.py died of it. Here the wait is made to time out on purpose.
"""

from __future__ import annotations

import threading
import time

import pymysql
import pytest

import permits
from tests.conftest import mariadb_session


@pytest.mark.parametrize("backend", ["mysql"])
def test_a_grant_that_times_out_on_the_autoinc_lock_is_retried(db_url: str, ns: str) -> None:
    with permits.connect(db_url) as admin:
        first = admin.create_semaphore(f"{ns}first", 1)
        blocker = admin.create_semaphore(f"{ns}blocker", 1)
        admin.create_semaphore(f"{ns}target", 1)
    first_id, blocker_id = (_semaphore_id(db_url, s.name) for s in (first, blocker))
    assert first_id < blocker_id

    # The row lock that will stall the INSERT ... SELECT after its first row.
    row_holder = mariadb_session(db_url)
    row_holder.cursor().execute("SELECT id FROM permits_semaphore WHERE id = %s FOR UPDATE", (blocker_id,))
    # Inserts its first lease row (taking the AUTO-INC lock), then waits for the blocker's row, lock held.
    autoinc_holder = mariadb_session(db_url)
    stalled = threading.Thread(target=_insert_then_stall, args=(autoinc_holder, ns, first_id, blocker_id), daemon=True)
    stalled.start()
    time.sleep(0.5)

    retries: list[str] = []

    def on_retry(kind: str) -> None:
        # The AUTO-INC wait was lost: now let the stalled insert end, so that the retry gets the lock. (A
        # timer for this, 3 s on, would come before the lost wait where connecting took over 1.5 s.)
        if kind == "conflict" and "conflict" not in retries:
            row_holder.rollback()
        retries.append(kind)

    with permits.connect(db_url, lock_wait_timeout=1) as client:
        client._store.on_retry = on_retry
        started = time.monotonic()
        lease = client.acquire(f"{ns}target", key="k", ttl=30, timeout=20)
        waited = time.monotonic() - started
        assert lease.counts == {f"{ns}target": 1}
        assert "conflict" in retries, (retries, waited)  # the 1467 met while the AUTO-INC lock was held
        assert waited >= 1.0
        client.release(lease)
    stalled.join(timeout=10)
    row_holder.close()
    autoinc_holder.close()
    with permits.connect(db_url) as client:
        assert client.get_semaphore(f"{ns}target").used == 0


def _semaphore_id(db_url: str, name: str) -> int:
    conn = mariadb_session(db_url)
    try:
        cursor = conn.cursor()
        cursor.execute("SELECT id FROM permits_semaphore WHERE name = %s", (name,))
        row = cursor.fetchone()
        assert row is not None
        return int(row[0])
    finally:
        conn.close()


def _insert_then_stall(conn: pymysql.connections.Connection, ns: str, first_id: int, blocker_id: int) -> None:  # type: ignore[type-arg]
    try:
        # A primary-key scan in id order: the first semaphore's row is read and inserted, then the
        # blocker's row waits for its lock, with the lease table's AUTO-INC lock still held.
        conn.cursor().execute(
            "INSERT INTO permits_lease (owner, lease_key, state, acquired_at_ms, expires_at_ms)"
            " SELECT %s, CONCAT('stall-', id), 1, 0, 0 FROM permits_semaphore WHERE id BETWEEN %s AND %s",
            (f"{ns}stall", first_id, blocker_id),
        )
    finally:
        conn.rollback()
