"""On PostgreSQL a waiting acquire hears a release (LISTEN/NOTIFY) instead of finding it at its next
poll. With polling alone, a waiter whose backoff has grown to its one-second cap finds the room 0.5 to
1 s after the release; with the notification, at once."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

import permits


@pytest.fixture
def pg_url(servers: Any) -> str:
    return str(servers.url_for("postgresql").render_as_string(hide_password=False))


def test_a_sync_waiter_hears_the_release(pg_url: str, ns: str) -> None:
    with permits.connect(pg_url, owner=f"{ns}h") as holder, permits.connect(pg_url, owner=f"{ns}w") as waiter:
        holder.create_semaphore(f"{ns}s", 1)
        held = holder.acquire(f"{ns}s", ttl=30)
        granted: list[float] = []

        def wait() -> None:
            lease = waiter.acquire(f"{ns}s", ttl=30, timeout=20)
            granted.append(time.monotonic())
            waiter.release(lease)

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(2.5)  # the waiter's backoff is at its cap by now
        released = time.monotonic()
        holder.release(held)
        thread.join(30)
        assert granted and granted[0] - released < 0.2, granted[0] - released


def test_an_asyncio_waiter_hears_a_capacity_raise(pg_url: str, ns: str) -> None:
    async def scenario() -> float:
        async with (
            permits.connect_async(pg_url, owner=f"{ns}h") as holder,
            permits.connect_async(pg_url, owner=f"{ns}w") as waiter,
        ):
            await holder.create_semaphore(f"{ns}s", 1)
            await holder.acquire(f"{ns}s", ttl=30)
            task = asyncio.create_task(waiter.acquire(f"{ns}s", ttl=30, timeout=20))
            await asyncio.sleep(2.5)
            raised = time.monotonic()
            await holder.set_capacity(f"{ns}s", 2, reason="more room")
            await task
            return time.monotonic() - raised

    assert asyncio.run(scenario()) < 0.2


def test_each_semaphore_notifies_its_own_channel_whatever_its_name(pg_url: str, ns: str) -> None:
    """The channel is the md5 of the name, computed alike by the SQL and by the listener, so a name in
    any script reaches its waiters, and a process listens only to its waiters' semaphores."""
    import psycopg

    from permits._async.listener import channel_for

    wanted, other = f"{ns}écluse-水門-🔒", f"{ns}elsewhere"
    observer = psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True)
    observer.execute(f"LISTEN {channel_for(wanted)}; LISTEN {channel_for(other)}")
    with permits.connect(pg_url, owner=f"{ns}h") as holder, permits.connect(pg_url, owner=f"{ns}w") as waiter:
        holder.create_semaphore(wanted, 1)
        holder.create_semaphore(other, 5)
        held = holder.acquire(wanted, ttl=30)
        granted: list[float] = []

        def wait() -> None:
            lease = waiter.acquire(wanted, ttl=30, timeout=20)
            granted.append(time.monotonic())
            waiter.release(lease)

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(2.5)
        holder.release(holder.acquire(other, ttl=30))
        listener = waiter._store._listener  # type: ignore[attr-defined]
        assert listener._subscribed == {wanted}  # not the other semaphore's channel
        released = time.monotonic()
        holder.release(held)
        thread.join(30)
        assert granted and granted[0] - released < 0.2, granted[0] - released
    notes = [(n.channel, n.payload) for n in observer.notifies(timeout=1.0)]
    observer.close()
    assert (channel_for(other), other) in notes
    assert (channel_for(wanted), wanted) in notes
