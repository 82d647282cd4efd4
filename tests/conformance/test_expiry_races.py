"""Races around a lease's times, forced with row locks the test holds itself (MariaDB, PostgreSQL).

A lease is ended for its expiry by a sweep, by an acquire that reclaims room, or by a delete. Each reads
which leases are expired, then locks those leases and ends them. An extend can commit in between: it
started while the lease was still held, so the database let it through. The lease must then stay held,
with its new expiry, rather than be ended as expired a moment after its holder was told it had been
extended. And a grant that waited for its semaphore's row must be stamped after the wait.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from sqlalchemy import create_engine, text

import permits
from tests.conftest import in_thread, sqlalchemy_url

#: How many sessions of this database wait for (or, on MariaDB, run) a locking read of permits_lease now.
_LOCK_WAITS = {
    "postgresql": """
        SELECT count(*) FROM pg_stat_activity
        WHERE wait_event_type = 'Lock' AND datname = current_database() AND query LIKE '%FROM permits_lease%'""",
    # INNODB_TRX does not always say LOCK WAIT for a locking read by primary key: MariaDB reads that row
    # while it plans the statement. The statement itself shows, locking reads being the ender's only.
    "mysql": """
        SELECT count(*) FROM information_schema.PROCESSLIST
        WHERE COMMAND = 'Query' AND DB = DATABASE() AND INFO LIKE '%FROM permits_lease%FOR UPDATE'""",
}


@pytest.mark.parametrize("ender", ["sweep", "reclaim", "delete"])
def test_an_extend_that_commits_while_the_lease_is_being_ended_keeps_the_lease(
    db_url: str, backend: str, ns: str, ender: str
) -> None:
    """The test's own transaction plays an extend that started before the expiry: it pushes the lease's
    expiry 30 s on, and holds its row uncommitted while the old expiry passes. The sweep (or an acquire
    that needs the room, or a delete) reads the lease as expired, then waits for its row. Once it is seen
    waiting, the extend commits: whoever ends expired leases must now find this one held, and leave it."""
    if backend == "sqlite":
        pytest.skip("SQLite runs one writing transaction at a time: no other can commit between two statements")
    name, ttl = f"{ns}s", 1.0
    with (
        permits.connect(db_url, owner=f"{ns}holder") as holder,
        permits.connect(db_url, owner=f"{ns}other") as other,
    ):
        holder.create_semaphore(name, 1)
        lease = holder.acquire(name, ttl=ttl)
        engine = create_engine(sqlalchemy_url(db_url))
        try:
            with engine.connect() as extend, engine.connect() as watch:
                extend.execute(
                    text(
                        "UPDATE permits_lease SET expires_at_ms = expires_at_ms + 30000"
                        " WHERE owner = :o AND lease_key = :k AND state = 1"
                    ),
                    {"o": f"{ns}holder", "k": lease.key},
                )
                time.sleep(ttl + 0.2)  # the committed lease has expired; the extend has not committed yet
                if ender == "sweep":
                    ending, ended = in_thread(other.sweep)
                elif ender == "reclaim":
                    ending, ended = in_thread(lambda: other.try_acquire(name, ttl=5))
                else:  # a delete without force, which only expired leases may not stop
                    ending, ended = in_thread(lambda: other.delete_semaphore(name))
                waited_for = time.monotonic() + 4
                while watch.execute(text(_LOCK_WAITS[backend])).scalar_one() == 0:
                    watch.rollback()  # a fresh snapshot for the next look
                    assert time.monotonic() < waited_for and ending.is_alive(), f"the {ender} never waited: {ended}"
                    time.sleep(0.02)
                extend.commit()
            ending.join(10)
        finally:
            engine.dispose()
        assert not ending.is_alive(), f"the {ender} did not finish"
        stored = holder.get_lease(lease.key)
        assert stored.held and stored.end_reason is None, stored
        assert stored.expires_in > 25, stored
        if ender == "sweep":
            # (The database is shared: other tests' expired leases may be swept with it, this one not.)
            assert (f"{ns}holder", lease.key) not in ended["value"].keys, ended
        elif ender == "reclaim":
            assert "error" not in ended and ended["value"] is None, "an acquire took the room of an extended lease"
        else:
            assert isinstance(ended.get("error"), permits.SemaphoreInUse), ended
        assert holder.get_semaphore(name).used == 1
        assert holder.reconcile() == []


_CLOCK_MS = {
    "postgresql": "SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
    "mysql": "SELECT CAST(UNIX_TIMESTAMP(SYSDATE(6)) * 1000 AS SIGNED)",
}


def test_a_grant_that_waited_for_the_row_is_stamped_after_the_wait(db_url: str, backend: str, ns: str) -> None:
    """The test holds the semaphore's row for a second while a grant waits for it. The lease must be stamped
    after the test let go: its TTL then counts from the grant, not from when its statement started, and
    its ``acquired_at`` comes after the end of every transaction it waited for."""
    if backend == "sqlite":
        pytest.skip("SQLite has no row lock to hold: its writers wait for the database's before they begin")
    name = f"{ns}s"
    with permits.connect(db_url, owner=f"{ns}w") as client:
        client.create_semaphore(name, 1)
        locker = create_engine(sqlalchemy_url(db_url))
        try:
            with locker.connect() as conn:
                conn.execute(text("SELECT 1 FROM permits_semaphore WHERE name = :n FOR UPDATE"), {"n": name})
                granting, granted = in_thread(lambda: client.acquire(name, ttl=5))
                time.sleep(1.0)
                let_go_ms = conn.execute(text(_CLOCK_MS[backend])).scalar_one()
                conn.rollback()
            granting.join(10)
        finally:
            locker.dispose()
    assert "error" not in granted, granted
    lease = granted["value"]
    acquired_ms = round(lease.acquired_at.timestamp() * 1000)
    assert acquired_ms >= let_go_ms, f"stamped {let_go_ms - acquired_ms} ms before the row was let go"
    assert lease.expires_at - lease.acquired_at == timedelta(seconds=5)
