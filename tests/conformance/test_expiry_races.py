"""Races between a lease's holder and whoever ends expired leases, forced with a row lock held by the test.

A lease is ended for its expiry by a sweep, or by an acquire that reclaims room. Both read which leases
are expired, then lock those leases and end them. An extend can commit in between: it started while the
lease was still held, so the database lets it through. The lease must then stay held, with its new
expiry, rather than be ended as expired a moment after its holder was told it had been extended.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import create_engine, text

import permits
from tests.conftest import sqlalchemy_url


def _in_thread(target: Any) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = target()
        except Exception as exc:  # the test reads it
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("ender", ["sweep", "reclaim", "delete"])
def test_an_extend_that_wins_the_lease_row_keeps_the_lease(db_url: str, backend: str, ns: str, ender: str) -> None:
    """The extend starts before the expiry and waits for the lease's row, which the test holds locked;
    the expiry passes; the sweep (or an acquire that needs the room) then reads the lease as expired and
    queues for the row behind the extend. The test lets go: the extend commits first, so whoever comes
    next must find the lease held and leave it be."""
    if backend == "sqlite":
        pytest.skip("SQLite runs one writing transaction at a time: no other can commit between two statements")
    name, ttl = f"{ns}s", 1.0
    with (
        permits.connect(db_url, owner=f"{ns}holder") as holder,
        permits.connect(db_url, owner=f"{ns}other") as other,
    ):
        holder.create_semaphore(name, 1)
        lease = holder.acquire(name, ttl=ttl)
        locker = create_engine(sqlalchemy_url(db_url))
        try:
            with locker.connect() as conn:
                conn.execute(
                    text("SELECT id FROM permits_lease WHERE owner = :o AND lease_key = :k FOR UPDATE"),
                    {"o": f"{ns}holder", "k": lease.key},
                )
                extending, extended = _in_thread(lambda: holder.extend(lease, ttl=30))
                time.sleep(ttl + 0.3)  # the extend waits for the row; meanwhile the lease's TTL runs out
                if ender == "sweep":
                    ending, ended = _in_thread(other.sweep)
                elif ender == "reclaim":
                    ending, ended = _in_thread(lambda: other.try_acquire(name, ttl=5))
                else:  # a delete without force, which only expired leases may not stop
                    ending, ended = _in_thread(lambda: other.delete_semaphore(name))
                time.sleep(0.5)  # the ender has read the lease as expired and waits for its row
                conn.rollback()
            extending.join(10)
            ending.join(10)
        finally:
            locker.dispose()
        if "error" in extended:
            # InnoDB may hand the row to the ender first: the extend waits for the lease's key in the
            # (owner, lease_key) index, the ender for the row itself. Then the lease ends and the extend is
            # refused, which is as consistent. PostgreSQL queues both for the same row lock, in order.
            assert backend == "mysql" and isinstance(extended["error"], permits.LeaseLost), extended
            assert not holder.get_lease(lease.key).held
            assert "error" not in ended, ended
            if ender == "sweep":
                assert ended["value"].leases == 1, ended
            elif ender == "reclaim":
                assert ended["value"] is not None, "the room of the expired lease was not reclaimed"
            else:
                assert ended["value"] == 0, ended  # it found the lease expired: nothing to revoke
                with pytest.raises(permits.SemaphoreNotFound):
                    holder.get_semaphore(name)
            return
        assert extended["value"].expires_in > 25, "the extend did not get through"
        stored = holder.get_lease(lease.key)
        assert stored.held and stored.end_reason is None, stored
        if ender == "delete":
            assert isinstance(ended.get("error"), permits.SemaphoreInUse), ended
        else:
            assert "error" not in ended, ended
        if ender == "sweep":
            assert ended["value"].leases == 0, ended
        elif ender == "reclaim":
            assert ended["value"] is None, "an acquire got the room of a lease that had just been extended"
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
                granting, granted = _in_thread(lambda: client.acquire(name, ttl=5))
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
