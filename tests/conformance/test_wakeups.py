"""On PostgreSQL a waiting acquire hears a release (LISTEN/NOTIFY) instead of finding it at its next
poll. With polling alone, a waiter whose backoff has grown to its one-second cap finds the room 0.5 to
1 s after the release; with the notification, at once.

These tests slow polling down to seconds (the ``slow_polling`` fixture), so that a waiter granted within
their bounds can only have heard the release, and the bounds leave room for a loaded machine: a bound
near the one-second poll would be a race against the scheduler, lost now and then under CI's parallel
tests."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

import permits

#: How late a waiter may be granted after the event that wakes it; polling, as ``slow_polling`` sets it,
#: would find the room 10 s or more after the waiter's last attempt.
HEARD_WITHIN = 1.5


def _start_waiting(waiter: permits.Client, name: str) -> tuple[threading.Thread, list[float]]:
    """A thread that waits for one permit of ``name``, notes when it was granted, and releases it."""
    granted: list[float] = []

    def wait() -> None:
        lease = waiter.acquire(name, ttl=30, timeout=20)
        granted.append(time.monotonic())
        waiter.release(lease)

    thread = threading.Thread(target=wait)
    thread.start()
    return thread, granted


@pytest.fixture
def pg_url(servers: Any) -> str:
    return str(servers.url_for("postgresql").render_as_string(hide_password=False))


def test_a_sync_waiter_hears_the_release(pg_url: str, ns: str, slow_polling: None) -> None:
    with permits.connect(pg_url, owner=f"{ns}h") as holder, permits.connect(pg_url, owner=f"{ns}w") as waiter:
        holder.create_semaphore(f"{ns}s", 1)
        held = holder.acquire(f"{ns}s", ttl=30)
        thread, granted = _start_waiting(waiter, f"{ns}s")
        time.sleep(2.5)  # the waiter's backoff is at its cap by now
        released = time.monotonic()
        holder.release(held)
        thread.join(30)
        assert granted and granted[0] - released < HEARD_WITHIN, granted[0] - released


def test_an_asyncio_waiter_hears_a_capacity_raise(pg_url: str, ns: str, slow_polling: None) -> None:
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

    assert asyncio.run(scenario()) < HEARD_WITHIN


def test_an_asyncio_waiter_hears_the_release(pg_url: str, ns: str, slow_polling: None) -> None:
    """A release notifies only a semaphore that a listener has marked as listened to: the asyncio client's
    listener marks it too."""

    async def scenario() -> float:
        async with (
            permits.connect_async(pg_url, owner=f"{ns}h") as holder,
            permits.connect_async(pg_url, owner=f"{ns}w") as waiter,
        ):
            await holder.create_semaphore(f"{ns}s", 1)
            held = await holder.acquire(f"{ns}s", ttl=30)
            task = asyncio.create_task(waiter.acquire(f"{ns}s", ttl=30, timeout=20))
            await asyncio.sleep(2.5)  # the waiter's backoff is at its cap by now
            released = time.monotonic()
            await holder.release(held)
            await task
            return time.monotonic() - released

    assert asyncio.run(scenario()) < HEARD_WITHIN


def test_each_semaphore_notifies_its_own_channel_whatever_its_name(pg_url: str, ns: str, slow_polling: None) -> None:
    """The channel is the md5 of the name, computed alike by the SQL and by the listener, so a name in
    any script reaches its waiters, and a process listens only to its waiters' semaphores. A semaphore
    nobody waits for is not notified at all, even if some connection LISTENs to its channel: only a
    permits listener marks it as listened to."""
    import psycopg

    from permits._async.listener import channel_for

    wanted, other = f"{ns}écluse-水門-🔒", f"{ns}elsewhere"
    observer = psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True)
    observer.execute(f"LISTEN {channel_for(wanted)}; LISTEN {channel_for(other)}")
    with permits.connect(pg_url, owner=f"{ns}h") as holder, permits.connect(pg_url, owner=f"{ns}w") as waiter:
        holder.create_semaphore(wanted, 1)
        holder.create_semaphore(other, 5)
        held = holder.acquire(wanted, ttl=30)
        thread, granted = _start_waiting(waiter, wanted)
        time.sleep(2.5)
        holder.release(holder.acquire(other, ttl=30))
        listener = waiter._store._listener  # type: ignore[attr-defined]
        assert listener._subscribed == {wanted}  # not the other semaphore's channel
        released = time.monotonic()
        holder.release(held)
        thread.join(30)
        assert granted and granted[0] - released < HEARD_WITHIN, granted[0] - released
    notes = [(n.channel, n.payload) for n in observer.notifies(timeout=1.0)]
    observer.close()
    assert (channel_for(other), other) not in notes
    assert (channel_for(wanted), wanted) in notes


def _listened_until(pg_url: str, name: str) -> tuple[int, int]:
    """The semaphore's mark and the database's clock, in ms."""
    import psycopg

    with psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        row = conn.execute(
            "SELECT listened_until_ms, CAST(EXTRACT(EPOCH FROM statement_timestamp()) * 1000 AS BIGINT)"
            " FROM permits_semaphore WHERE name = %s",
            (name,),
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def test_releases_notify_only_while_a_listener_marks_the_semaphore(
    pg_url: str, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NOTIFY makes its commit wait for every other notifying commit in the database, so a release
    notifies only while some listener marks its semaphore as listened to. The mark is set as soon as a
    waiter listens, renewed for as long as it waits (here through several mark lifetimes), and runs out
    after the listener stops listening."""
    import psycopg

    from permits._async.listener import channel_for
    from permits._sync import listener as sync_listener

    monkeypatch.setattr(sync_listener, "MARK_SECONDS", 1.0)
    name = f"{ns}s"
    observer = psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True)
    observer.execute(f"LISTEN {channel_for(name)}")
    with permits.connect(pg_url, owner=f"{ns}h") as holder, permits.connect(pg_url, owner=f"{ns}w") as waiter:
        holder.create_semaphore(name, 1)
        holder.release(holder.acquire(name, ttl=30))
        assert not list(observer.notifies(timeout=0.5))  # nobody marked it: no notification
        held = holder.acquire(name, ttl=30)
        thread, granted = _start_waiting(waiter, name)
        time.sleep(3.5)  # three and a half mark lifetimes: the mark must have been renewed
        until, now = _listened_until(pg_url, name)
        assert until > now
        released = time.monotonic()
        holder.release(held)
        thread.join(30)
        assert granted and granted[0] - released < HEARD_WITHIN, granted[0] - released
        assert [n.payload for n in observer.notifies(timeout=0.5)][:1] == [name]
        # The listener stops listening LINGER after its last waiter; its mark runs out a second later.
        time.sleep(sync_listener.LINGER + 3.0)
        assert not waiter._store._listener._subscribed  # type: ignore[attr-defined]
        until, now = _listened_until(pg_url, name)
        assert until <= now
        list(observer.notifies(timeout=0.1))  # drain
        holder.release(holder.acquire(name, ttl=30))
        assert not list(observer.notifies(timeout=0.5))
    observer.close()


def test_a_fair_waiter_is_called_when_the_waiter_ahead_of_it_leaves(pg_url: str, ns: str, slow_polling: None) -> None:
    """A large request at the head of a fair queue holds up a small one that would fit. When the large
    one's wait times out, the statement that gives up its place calls the small one on its process's
    wake channel: it is granted at once, not at its next poll (at most a second later)."""
    name = f"{ns}s"
    with permits.connect(pg_url, owner=f"{ns}h") as holder:
        holder.create_semaphore(name, 2, fair=True)
        holder.acquire(name, ttl=30)
        big_gave_up: list[float] = []
        small_granted: list[float] = []

        def big() -> None:
            with permits.connect(pg_url, owner=f"{ns}big") as client, pytest.raises(permits.AcquireTimeout):
                try:
                    client.acquire({name: 2}, ttl=30, timeout=2.5)
                finally:
                    big_gave_up.append(time.monotonic())

        def small() -> None:
            with permits.connect(pg_url, owner=f"{ns}small") as client:
                # A place records the wake channel only once the channel is up: here, from the start. (A
                # waiter's second attempt, 20 ms after its first refusal, records it; slow_polling would
                # put that attempt 10 s off.)
                listener = client._store._listener  # type: ignore[attr-defined]
                listener.want_calls()
                listener.start()
                while listener.wake_channel is None:
                    time.sleep(0.01)
                client.acquire(name, ttl=30, timeout=20)
                small_granted.append(time.monotonic())

        threads = [threading.Thread(target=big)]
        threads[0].start()
        while len(holder.waiters(name)) < 1:
            time.sleep(0.01)
        threads.append(threading.Thread(target=small))
        threads[1].start()
        for thread in threads:
            thread.join(30)
    assert big_gave_up and small_granted
    assert small_granted[0] - big_gave_up[0] < HEARD_WITHIN, small_granted[0] - big_gave_up[0]


def test_a_listener_stops_listening_once_its_waiters_are_gone(pg_url: str, ns: str) -> None:
    """PostgreSQL signals every backend that LISTENs to anything at each NOTIFY in the database, so a
    client that no longer waits must not stay subscribed: its listener UNLISTENs its channels, the
    semaphores' and its own wake channel, a little after its last waiter (listener.LINGER)."""
    from permits._sync.listener import LINGER, SUBSCRIBE_EVERY

    name = f"{ns}s"
    with permits.connect(pg_url, owner=f"{ns}h") as holder, permits.connect(pg_url, owner=f"{ns}w") as waiter:
        holder.create_semaphore(name, 1, fair=True)
        held = holder.acquire(name, ttl=30)
        thread = threading.Thread(target=lambda: waiter.release(waiter.acquire(name, ttl=30, timeout=20)))
        thread.start()
        listener = waiter._store._listener  # type: ignore[attr-defined]
        deadline = time.monotonic() + 5
        while listener.wake_channel is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert listener.wake_channel is not None  # a fair waiter's process listens for its calls
        holder.release(held)
        thread.join(30)
        time.sleep(LINGER + 3 * SUBSCRIBE_EVERY)
        assert listener.wake_channel is None
        assert not listener._subscribed


def test_a_mark_that_finds_the_row_locked_is_tried_again(pg_url: str, ns: str, slow_polling: None) -> None:
    """Marking writes the semaphore rows, which a transaction may hold locked. The listener skips such a
    row rather than wait for it (it would deliver nothing meanwhile), marks the others in the same turn,
    keeps its connection, and marks the skipped row once it is free."""
    import psycopg

    locked, free = f"{ns}locked", f"{ns}free"
    raw_url = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with permits.connect(pg_url, owner=f"{ns}h") as holder, permits.connect(pg_url, owner=f"{ns}w") as waiter:
        held = []
        for name in (locked, free):
            holder.create_semaphore(name, 1)
            held.append(holder.acquire(name, ttl=30))
        with psycopg.connect(raw_url) as locker:
            locker.execute("SELECT 1 FROM permits_semaphore WHERE name = %s FOR UPDATE", (locked,))
            waits = [_start_waiting(waiter, name) for name in (locked, free)]
            time.sleep(1.5)  # the mark is tried several times meanwhile
            listener = waiter._store._listener  # type: ignore[attr-defined]
            assert listener._runner is not None  # still connected
            until, now = _listened_until(pg_url, free)
            assert until > now  # marked in the same turns, not held up by the locked row
            until, now = _listened_until(pg_url, locked)
            assert until <= now
            locker.rollback()
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            until, now = _listened_until(pg_url, locked)
            if until > now:
                break
            time.sleep(0.05)
        assert until > now
        # Both waiters listen for their semaphore's release by now: the one held up by the locked row made
        # its attempt once the row was let go, and a loaded machine may take a while over it.
        deadline = time.monotonic() + 10
        while {locked, free} - set(listener._waiting) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {locked, free} <= set(listener._waiting)
        for lease, (thread, granted) in zip(held, waits, strict=True):
            released = time.monotonic()
            holder.release(lease)
            thread.join(30)
            assert granted and granted[0] - released < HEARD_WITHIN, granted[0] - released


def test_a_listener_that_breaks_wakes_its_waiters(pg_url: str, ns: str) -> None:
    """What a broken LISTEN connection would have heard is lost: its waiters must ask again now, not sleep
    out a delay chosen on the promise of a notification."""
    import psycopg

    with permits.connect(pg_url, owner=f"{ns}w") as client:
        listener = client._store._listener  # type: ignore[attr-defined]
        assert listener.start()
        woken: list[tuple[bool, float]] = []
        thread = threading.Thread(target=lambda: woken.append((listener.wait([f"{ns}s"], 20), time.monotonic())))
        thread.start()
        deadline = time.monotonic() + 5
        while f"{ns}s" not in listener._subscribed:  # the waiter is in, and its channel LISTENed
            assert time.monotonic() < deadline
            time.sleep(0.01)
        backend = listener._connection.info.backend_pid
        with psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (backend,))
        broken = time.monotonic()
        thread.join(30)
    assert woken and woken[0][0] is True
    assert woken[0][1] - broken < HEARD_WITHIN, woken[0][1] - broken
