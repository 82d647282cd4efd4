"""A try that does not wait (``try_acquire``, ``acquire(timeout=0)``, ``permits run -n``) behind a row lock
that another session holds and does not let go of (a frozen process, a forgotten transaction in a SQL
console): it answers ``StorageConflict`` within one lock wait. Before, it retried the conflict five times,
each after a whole lock wait: 30 s to learn nothing, directly and through a service (which retried too)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, create_engine, text

import permits
from permits._deadline import caller_deadline
from tests.conftest import sqlalchemy_url

#: the service's lock wait (its default); the direct client is given a shorter one
SERVICE_LOCK_WAIT = 5.0
DIRECT_LOCK_WAIT = 1.0


@contextlib.contextmanager
def _row_held(db_url: str, backend: str, name: str) -> Iterator[Connection]:
    """Another session's transaction, holding the lock on the semaphore's row (on SQLite, which has no row
    locks, the database's write lock, which its writers wait for) until it rolls back or the block ends."""
    holder = create_engine(sqlalchemy_url(db_url))
    try:
        with holder.connect() as conn:
            locking = (
                "UPDATE permits_semaphore SET used = used WHERE name = :n"
                if backend == "sqlite"
                else "SELECT 1 FROM permits_semaphore WHERE name = :n FOR UPDATE"
            )
            conn.execute(text(locking), {"n": name})
            yield conn
    finally:
        holder.dispose()


@pytest.mark.parametrize("flavour", ["sync"])  # the asyncio client runs the same store code
def test_a_try_behind_a_held_row_lock_answers_within_one_lock_wait(
    make_client: Callable[..., Any], via: str, db_url: str, backend: str, ns: str
) -> None:
    if backend == "sqlite":
        pytest.skip("SQLite has no row lock to hold: its writers wait for the database's before they begin")
    lock_wait = DIRECT_LOCK_WAIT if via == "db" else SERVICE_LOCK_WAIT
    client = make_client(**({"lock_wait_timeout": DIRECT_LOCK_WAIT} if via == "db" else {}))
    name = f"{ns}s"
    client.create_semaphore(name, 1)
    with _row_held(db_url, backend, name) as conn:
        started = time.monotonic()
        with pytest.raises(permits.StorageConflict):
            client.try_acquire(name, key=f"{ns}try")
        took = time.monotonic() - started
        # acquire(timeout=0), as permits run -n asks: no room could be seen, and it says why
        started = time.monotonic()
        with pytest.raises(permits.AcquireTimeout, match="held up"):
            client.acquire(name, key=f"{ns}try", timeout=0)
        took_acquire = time.monotonic() - started
        conn.rollback()
    assert lock_wait * 0.8 <= took < 2 * lock_wait + 1.5, took
    assert took_acquire < 2 * lock_wait + 1.5, took_acquire
    # Nothing was granted under the key; once the lock is let go the same try is granted, once.
    lease = client.try_acquire(name, key=f"{ns}try")
    assert lease is not None and client.get_semaphore(name).used == 1
    again = client.try_acquire(name, key=f"{ns}try")
    assert again is not None and again.tokens == lease.tokens and client.get_semaphore(name).used == 1


#: the wants of an acquire, by the statement each takes: one permit (the line's, where there is one), several
#: permits of one semaphore, and several semaphores (the held one first, then last)
SHAPES = {
    "one": lambda name: name,
    "several-permits": lambda name: {name: 2},
    "several-semaphores": lambda name: [name, f"{name}b"],
    "held-one-last": lambda name: [f"{name}b", name],
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_an_acquire_behind_a_held_row_lock_answers_within_its_timeout(
    make_client: Callable[..., Any], db_url: str, backend: str, ns: str, shape: str
) -> None:
    """A timeout shorter than the lock wait bounds the wait for a row lock too (on SQLite, for the database's
    write lock): ``acquire(timeout=1)`` behind a lock that another session holds answers ``AcquireTimeout``
    after about a second. Before, MariaDB and SQLite waited the whole lock wait (5 s by default) whatever the
    caller's timeout, and PostgreSQL did so outside its line (several permits of one semaphore, and every
    grant through the service)."""
    client = make_client()  # the default lock wait, 5 s, directly and in the service
    name = f"{ns}s"
    client.create_semaphore(name, 3)
    client.create_semaphore(f"{name}b", 3)
    with _row_held(db_url, backend, name) as conn:
        started = time.monotonic()
        with pytest.raises(permits.AcquireTimeout):
            client.acquire(SHAPES[shape](name), key=f"{ns}k", timeout=1)
        took = time.monotonic() - started
        conn.rollback()
    # MariaDB counts its lock waits in whole seconds: at most one, then the answer
    assert took < 2.5, took
    # Nothing was granted; once the lock is let go the same acquire is granted.
    assert client.get_semaphore(name).used == 0
    lease = client.acquire(SHAPES[shape](name), key=f"{ns}k", timeout=5)
    assert client.get_semaphore(name).used == (2 if shape == "several-permits" else 1)
    client.release(lease)


def test_the_last_attempt_of_an_acquire_whose_time_ran_out_is_not_a_try(db_url: str, backend: str, ns: str) -> None:
    """An ``acquire`` asks once more when its timeout runs out. That attempt still has the caller's bound on a
    lock wait: it was sent as a try (no time left), and a try waits for a lock the whole lock wait, so a row
    lock taken just then made ``acquire(timeout=1)`` take 6 s. (The asyncio client runs the same loop, and so
    does the service's own, where a client of the service sends one long poll.)"""
    with permits.connect(db_url) as client:  # the default lock wait, 5 s
        name = f"{ns}s"
        client.create_semaphore(name, 1)
        held = client.acquire(name, key=f"{ns}held")
        holder = create_engine(sqlalchemy_url(db_url))
        conn = holder.connect()
        store, waits = client._store, []
        asked = store.try_acquire

        def try_acquire(*args: Any, **options: Any) -> Any:
            wait = args[4]
            if wait < 0.01 and waits:  # the last attempt: the row is locked just before it
                locking = (
                    "UPDATE permits_semaphore SET used = used WHERE name = :n"
                    if backend == "sqlite"
                    else "SELECT 1 FROM permits_semaphore WHERE name = :n FOR UPDATE"
                )
                conn.execute(text(locking), {"n": name})
            waits.append(wait)
            return asked(*args, **options)

        store.try_acquire = try_acquire
        try:
            started = time.monotonic()
            with pytest.raises(permits.AcquireTimeout):
                client.acquire(name, key=f"{ns}k", timeout=1)
            took = time.monotonic() - started
        finally:
            store.try_acquire = asked
            conn.rollback()
            conn.close()
            holder.dispose()
        assert len(waits) >= 2 and waits[-1] < 0.01, waits  # the last attempt came, with its row locked
        assert all(wait > 0 for wait in waits), waits
        assert took < 3, took  # MariaDB counts lock waits in whole seconds: at most one more
        client.release(held)


@pytest.mark.parametrize("flavour", ["sync"])  # the asyncio client runs the same store code
@pytest.mark.parametrize("via", ["db"])  # the caller's deadline below is this process's
def test_an_attempt_sent_late_still_waits_for_a_healthy_answer(
    make_client: Callable[..., Any], db_url: str, backend: str, ns: str
) -> None:
    """An attempt sent past its caller's deadline (a try after a long wait for a pooled connection, or for
    the service's pre-lock) waits for a healthy database's answer as long as a try may legitimately take,
    behind a row lock held for a while: it is not cut as if the link hung (``permits._deadline``). With a
    bound of 1 s it was, and raised ``StorageUnavailable`` where the try would have been granted."""
    if backend == "sqlite":
        pytest.skip("SQLite has no link to cut")
    client = make_client()  # the default lock wait, 5 s
    name = f"{ns}s"
    client.create_semaphore(name, 1)
    with _row_held(db_url, backend, name) as conn:
        letting_go = threading.Timer(3.0, conn.rollback)
        letting_go.start()
        try:
            with caller_deadline(time.monotonic() - 60):  # long past, and past its grace
                lease = client.try_acquire(name, key=f"{ns}late")
        finally:
            letting_go.join()
    assert lease is not None and client.get_semaphore(name).used == 1
