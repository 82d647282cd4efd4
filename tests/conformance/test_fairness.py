"""Fair mode and read-write locks, on every backend, directly and through the service.

Fair mode promises: waiting acquires are granted in the order they started waiting; a request at the head
of the queue is not overtaken by later ones, however small; a waiter that stops asking (gave up, died)
loses its place within PLACE_MS.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

import permits
from permits._async.store import PLACE_MS
from tests._service import wait_until


def _waiting(client: Any, name: str, count: int) -> bool:
    return len(client.waiters(name)) >= count


def test_waiters_are_granted_in_arrival_order(client_url: str, ns: str) -> None:
    name = f"{ns}fair"
    with permits.connect(client_url, owner=f"{ns}holder") as holder:
        holder.create_semaphore(name, 1, fair=True)
        assert holder.get_semaphore(name).fair
        held = holder.acquire(name, ttl=30)
        order: list[int] = []
        threads = []
        for i in range(4):

            def wait_in_line(i: int = i) -> None:
                with permits.connect(client_url, owner=f"{ns}w{i}") as client:
                    lease = client.acquire(name, ttl=30, timeout=30)
                    order.append(i)
                    time.sleep(0.05)
                    client.release(lease)

            thread = threading.Thread(target=wait_in_line)
            thread.start()
            threads.append(thread)
            wait_until(lambda i=i: _waiting(holder, name, i + 1), timeout=10)  # in line before the next comes
        queue = holder.waiters(name)
        assert [w.owner for w in queue] == [f"{ns}w{i}" for i in range(4)]
        assert [w.ticket for w in queue] == sorted(w.ticket for w in queue)
        assert all(w.count == 1 and 0 < w.place_expires_in <= PLACE_MS / 1000 for w in queue)
        holder.release(held)
        for thread in threads:
            thread.join(60)
        assert order == [0, 1, 2, 3]
        assert holder.waiters(name) == []
        assert holder.reconcile() == []


def test_a_large_request_is_not_starved_by_small_ones(client_url: str, ns: str) -> None:
    name = f"{ns}fair"
    stop = threading.Event()
    small_grants = [0]

    def small_stream(i: int) -> None:
        with permits.connect(client_url, owner=f"{ns}small{i}") as client:
            while not stop.is_set():
                lease = client.acquire(name, ttl=30, timeout=30)
                small_grants[0] += 1
                time.sleep(0.02)
                client.release(lease)

    with permits.connect(client_url, owner=f"{ns}big") as big:
        big.create_semaphore(name, 3, fair=True)
        stream = [threading.Thread(target=small_stream, args=(i,)) for i in range(3)]
        for thread in stream:
            thread.start()
        try:
            wait_until(lambda: small_grants[0] > 10, timeout=20)
            started = time.monotonic()
            lease = big.acquire({name: 3}, ttl=30, timeout=20)  # all of it: needs every small one out
            waited = time.monotonic() - started
            big.release(lease)
        finally:
            stop.set()
            for thread in stream:
                thread.join(60)
        # Once in line, the large request is next: the small ones behind it wait until it is served.
        assert waited < 5, waited
        assert big.reconcile() == []


def test_rwlock_readers_share_and_a_waiting_writer_is_not_overtaken(client_url: str, ns: str) -> None:
    lock = f"{ns}schema"
    with (
        permits.connect(client_url, owner=f"{ns}r1") as r1,
        permits.connect(client_url, owner=f"{ns}r2") as r2,
        permits.connect(client_url, owner=f"{ns}writer") as writer,
    ):
        r1.create_rwlock(lock)
        read1 = r1.acquire(permits.shared(lock), ttl=30)
        read2 = r2.acquire(permits.shared(lock), ttl=30)  # readers share
        assert writer.try_acquire(permits.exclusive(lock)) is None
        got: list[Any] = []
        waiting_writer = threading.Thread(
            target=lambda: got.append(writer.acquire(permits.exclusive(lock), ttl=30, timeout=30))
        )
        waiting_writer.start()
        wait_until(lambda: _waiting(r1, lock, 1), timeout=10)
        # There is room for a reader, but a writer waits: a new reader waits behind it.
        assert r2.try_acquire(permits.shared(lock), key=f"{ns}late-reader") is None
        r1.release(read1)
        r2.release(read2)
        waiting_writer.join(30)
        assert got and got[0].counts == {lock: permits.RWLOCK_READERS}
        assert r1.try_acquire(permits.shared(lock)) is None  # the writer excludes readers
        writer.release(got[0])
        assert r1.try_acquire(permits.shared(lock)) is not None


def test_shared_lock_combines_with_other_wants_in_one_acquire(client_url: str, ns: str) -> None:
    with permits.connect(client_url, owner=f"{ns}w") as client:
        client.create_rwlock(f"{ns}schema")
        client.create_semaphore(f"{ns}backup-slots", 2)
        lease = client.acquire([permits.shared(f"{ns}schema"), (f"{ns}backup-slots", 1)], ttl=30)
        assert lease.counts == {f"{ns}schema": 1, f"{ns}backup-slots": 1}
        assert client.try_acquire(permits.exclusive(f"{ns}schema")) is None
        with pytest.raises(permits.CountExceedsCapacity):
            client.try_acquire(permits.exclusive(f"{ns}backup-slots"))  # not a read-write lock
        client.release(lease)


def test_a_waiter_that_stops_asking_loses_its_place(client_url: str, ns: str, via: str) -> None:
    name = f"{ns}fair"
    with permits.connect(client_url, owner=f"{ns}holder") as holder:
        holder.create_semaphore(name, 1, fair=True)
        held = holder.acquire(name, ttl=60)
        with permits.connect(client_url, owner=f"{ns}quitter") as quitter, pytest.raises(permits.AcquireTimeout):
            quitter.acquire(name, ttl=30, timeout=0.5)
        # A client that timed out gives its place up at once (through the service, the place lasts
        # until it expires: the service cannot tell a client that stopped from one about to ask again).
        if via == "db":
            assert holder.waiters(name) == []
        else:
            wait_until(lambda: holder.waiters(name) == [], timeout=PLACE_MS / 1000 + 3)
        holder.release(held)
        assert holder.try_acquire(name) is not None


def test_a_cancelled_waiter_gives_its_place_up_at_once(client_url: str, ns: str) -> None:
    """An asyncio waiter cancelled while it waits (its caller's own timeout, a shutdown) gives its place in
    the fair queue up as a timeout does, not when the place lapses (PLACE_MS) with every waiter behind it
    held up meanwhile. Through the service, the request's connection closes and the client gives the place
    up (``/v1/leases/give-up``)."""
    name = f"{ns}fair"

    async def scenario() -> float:
        async with (
            permits.connect_async(client_url, owner=f"{ns}holder") as holder,
            permits.connect_async(client_url, owner=f"{ns}w") as waiter,
        ):
            await holder.create_semaphore(name, 1, fair=True)
            held = await holder.acquire(name, ttl=60)
            task = asyncio.create_task(waiter.acquire(name, ttl=30, timeout=20))
            while not await holder.waiters(name):
                await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            cancelled = time.monotonic()
            while await holder.waiters(name) and time.monotonic() - cancelled < PLACE_MS / 1000 + 3:
                await asyncio.sleep(0.02)
            gone_after = time.monotonic() - cancelled
            await holder.release(held)
            return gone_after

    assert asyncio.run(scenario()) < 1.5


def test_a_waiter_cancelled_at_any_moment_of_its_first_attempt_leaves_no_place(client_url: str, ns: str) -> None:
    """Cancelled at every moment of its first attempt, a new client's waiter leaves no place behind: not
    while its place's transaction commits with the reply on the way, nor while it starts listening for
    calls after that (on PostgreSQL, which a Ctrl-C in CI once hit: the place held the queue up until
    it lapsed)."""
    name = f"{ns}fair"

    async def scenario() -> list[int]:
        left_behind = []
        async with permits.connect_async(client_url, owner=f"{ns}holder") as holder:
            await holder.create_semaphore(name, 1, fair=True)
            held = await holder.acquire(name, ttl=120)
            for step in range(30):
                async with permits.connect_async(client_url, owner=f"{ns}w{step}") as waiter:
                    task = asyncio.create_task(waiter.acquire(name, ttl=30, timeout=20))
                    await asyncio.sleep(step * 0.003)
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                cancelled = time.monotonic()
                while await holder.waiters(name) and time.monotonic() - cancelled < 1.5:
                    await asyncio.sleep(0.02)
                if await holder.waiters(name):
                    left_behind.append(step)
                    await holder.delete_semaphore(name, force=True)
                    await holder.create_semaphore(name, 1, fair=True)
                    held = await holder.acquire(name, ttl=120)
            await holder.release(held)
        return left_behind

    assert asyncio.run(scenario()) == []


@pytest.mark.parametrize("verdict", ["capacity lowered", "semaphore deleted"])
def test_a_waiter_whose_request_fails_gives_its_place_up_at_once(client_url: str, ns: str, verdict: str) -> None:
    """A waiter whose request can no longer be granted (the capacity lowered below its count, another of its
    semaphores deleted) raises, and its place goes with it: the queue behind it moves now, not when the place
    lapses (PLACE_MS). Before, the semaphore refused every request for those seconds, with nothing used."""
    name, other = f"{ns}fair", f"{ns}other"
    with (
        permits.connect(client_url, owner=f"{ns}holder") as holder,
        permits.connect(client_url, owner=f"{ns}w") as waiter,
    ):
        holder.create_semaphore(name, 4, fair=True)
        holder.create_semaphore(other, 1)
        held = holder.acquire({name: 2}, ttl=60)
        outcome: dict[str, BaseException] = {}

        def wait() -> None:
            try:
                waiter.acquire({name: 3, other: 1}, ttl=30, timeout=20)
            except permits.PermitsError as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=wait)
        thread.start()
        wait_until(lambda: _waiting(holder, name, 1), timeout=10)
        if verdict == "capacity lowered":
            holder.set_capacity(name, 2, reason="a smaller pool")
        else:
            holder.delete_semaphore(other, force=True)
        thread.join(20)
        assert not thread.is_alive()
        expected = permits.CountExceedsCapacity if verdict == "capacity lowered" else permits.SemaphoreNotFound
        assert isinstance(outcome.get("error"), expected), outcome
        assert holder.waiters(name) == []
        holder.release(held)
        assert holder.try_acquire(name, ttl=5) is not None  # at once: no place left ahead of it


@pytest.mark.parametrize("via", ["service"])
def test_a_plain_http_waiter_whose_request_fails_gives_its_place_up_at_once(client_url: str, ns: str) -> None:
    """The same through the service for any HTTP client (no give-up of its own, no ``keep_place``): the
    service gives the place up as it answers the verdict, not when the place lapses."""
    import httpx

    name = f"{ns}fair"
    with permits.connect(client_url, owner=f"{ns}holder") as holder:
        holder.create_semaphore(name, 4, fair=True)
        held = holder.acquire({name: 2}, ttl=60)
        answer: dict[str, httpx.Response] = {}
        body = {"wants": [{"name": name, "count": 3}], "key": "k", "owner": f"{ns}w", "ttl": 30, "wait": 20}

        def wait() -> None:
            answer["response"] = httpx.post(f"{client_url}/v1/leases", json=body, timeout=30)

        thread = threading.Thread(target=wait)
        thread.start()
        wait_until(lambda: _waiting(holder, name, 1), timeout=10)
        holder.set_capacity(name, 2, reason="a smaller pool")
        thread.join(30)
        assert not thread.is_alive()
        assert answer["response"].json()["error"]["code"] == "count_exceeds_capacity", answer["response"].text
        assert holder.waiters(name) == []
        holder.release(held)


def test_a_waiter_interrupted_by_ctrl_c_gives_its_place_up_at_once(client_url: str, ns: str) -> None:
    """The sync client's twin of the test above: a process whose waiting acquire gets SIGINT."""
    name = f"{ns}fair"
    # Ctrl-C reaches a foreground process, where Python turns SIGINT into KeyboardInterrupt. A process that
    # a shell without job control started in the background (``(./scripts/test &)``) inherits SIGINT
    # ignored, and Python then leaves it ignored: the child takes Python's own handler back first.
    code = (
        "import signal, sys, permits\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "with permits.connect(sys.argv[1], owner=sys.argv[3]) as client:\n"
        "    client.acquire(sys.argv[2], ttl=30, timeout=20)\n"
    )
    with permits.connect(client_url, owner=f"{ns}holder") as holder:
        holder.create_semaphore(name, 1, fair=True)
        held = holder.acquire(name, ttl=60)
        waiting = subprocess.Popen(
            [sys.executable, "-c", code, client_url, name, f"{ns}w"], stderr=subprocess.PIPE, text=True
        )
        assert wait_until(lambda: holder.waiters(name) != [], timeout=20)
        waiting.send_signal(signal.SIGINT)
        assert waiting.wait(timeout=20) != 0
        assert waiting.stderr is not None and "KeyboardInterrupt" in waiting.stderr.read()
        assert holder.waiters(name) == []  # at once, not PLACE_MS later
        holder.release(held)


def test_waiters_of_an_unknown_semaphore(client_url: str, ns: str) -> None:
    with permits.connect(client_url) as client, pytest.raises(permits.SemaphoreNotFound):
        client.waiters(f"{ns}nope")


def test_a_recreated_semaphore_starts_with_an_empty_queue(client: Any, db_url: str, ns: str) -> None:
    """A place left on a deleted semaphore (a waiter's enqueue that read its id before the delete, made
    here by hand) does not hold up the queue of the semaphore created again under that name."""
    from sqlalchemy import create_engine, text

    from tests.conftest import sqlalchemy_url

    name = f"{ns}again"
    client.create_semaphore(name, 1, fair=True)
    client.delete_semaphore(name)
    url = sqlalchemy_url(db_url)
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO permits_waiter (semaphore_id, ticket, owner, lease_key, count, enqueued_at_ms,"
                " expires_at_ms) SELECT id, 1, 'late', 'late-key', 1, 0, 9000000000000 FROM permits_semaphore"
                " WHERE name = :n"
            ),
            {"n": name},
        )
    engine.dispose()
    client.create_semaphore(name, 1, fair=True)
    assert client.waiters(name) == []
    assert client.try_acquire(name) is not None


def test_an_expired_lease_does_not_block_a_fair_semaphore_that_a_waiter_ahead_shares(client_url: str, ns: str) -> None:
    """Fair ``f`` of capacity 2: an expired lease holds one permit, and a waiter ahead (for ``f`` and the
    full ``y``) keeps its place for another. The room for a count is there, but the gate counts the waiter
    ahead, so only the expired lease's permit stands in the way: a request for ``f`` reclaims it and is
    granted. A version that reclaimed only where the count did not fit refused it until the sweep, and
    the waiter ahead, whose reclaims did not include ``f``, lost its place meanwhile."""
    f, y = f"{ns}f", f"{ns}y"
    with permits.connect(client_url, owner=f"{ns}holder") as holder:
        holder.create_semaphore(f, 2, fair=True)
        holder.create_semaphore(y, 1)
        holder.acquire(f, ttl=0.5, timeout=5)  # left to expire, as by a crashed holder
        busy = holder.acquire(y, ttl=30, timeout=5)
        waited: list[Any] = []

        def wait_ahead() -> None:
            with permits.connect(client_url, owner=f"{ns}ahead") as client:
                waited.append(client.acquire({f: 1, y: 1}, ttl=30, timeout=20))

        thread = threading.Thread(target=wait_ahead)
        thread.start()
        wait_until(lambda: _waiting(holder, f, 1), timeout=10)
        time.sleep(0.7)  # the first lease has expired
        with permits.connect(client_url, owner=f"{ns}later") as later:
            lease = later.try_acquire(f, ttl=30)
            assert lease is not None
            later.release(lease)
        time.sleep(PLACE_MS / 1000 + 1)  # the waiter ahead keeps its place all along
        assert [w.owner for w in holder.waiters(f)] == [f"{ns}ahead"]
        holder.release(busy)
        thread.join(30)
        assert waited and set(waited[0].tokens) == {f, y}
        holder.release(waited[0])
        assert holder.reconcile() == []
