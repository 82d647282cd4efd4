"""What a waiting acquire costs the database (see permits._pacing): a retry that finds no room is one
statement, and the transaction that finds out why runs on the first attempt and then at most once a
second. Counted with the store's statement hook, on every backend."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import psycopg
import pymysql
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

import permits
from permits import Want
from tests.conftest import sqlalchemy_url

#: The read that finds out why an acquire was refused (flows._why_refused).
WHY_REFUSED = "REFUSAL_READ"


def test_a_waiter_rechecks_why_it_was_refused_at_most_once_a_second(db_url: str, ns: str) -> None:
    name = f"{ns}full"
    with permits.connect(db_url, owner=f"{ns}h") as holder, permits.connect(db_url, owner=f"{ns}w") as waiter:
        holder.create_semaphore(name, 1)
        held = holder.acquire(name, ttl=30)
        counts: collections.Counter[str] = collections.Counter()
        waiter._store.after_statement = lambda statement: counts.update([statement])  # type: ignore[attr-defined]
        started = time.monotonic()
        with pytest.raises(permits.AcquireTimeout):
            waiter.acquire(name, ttl=30, timeout=2.5)
        waited = time.monotonic() - started
        holder.release(held)
    attempts = counts["ACQUIRE_ONE"] or counts["SEM_TAKE"]
    rechecks = counts[WHY_REFUSED]
    assert attempts >= 4, counts  # it kept asking
    # The first attempt, then one a second: 3 in 2.5 s (one more if a second boundary falls just so).
    assert 1 <= rechecks <= int(waited) + 2, counts
    assert rechecks < attempts, counts


def test_a_waiting_acquire_still_finds_its_earlier_grant_at_once(db_url: str, ns: str) -> None:
    """A retry after a lost reply must return the lease the first attempt got, even with no room left
    (the lease itself fills the semaphore): the first attempt of every acquire is a full check."""
    name = f"{ns}one"
    with permits.connect(db_url, owner=f"{ns}w") as client:
        client.create_semaphore(name, 1)
        first = client.acquire(name, key=f"{ns}k", ttl=30)
        started = time.monotonic()
        again = client.acquire(name, key=f"{ns}k", ttl=30, timeout=10)
        assert time.monotonic() - started < 1.0
        assert again.tokens == first.tokens
        client.release(again)


def _connection_lost(backend: str) -> BaseException:
    """The driver's error for a connection lost during a statement, as the store would see it."""
    if backend == "mysql":
        return pymysql.err.OperationalError(2013, "Lost connection to server during query")
    return psycopg.OperationalError("server closed the connection unexpectedly")


@pytest.mark.parametrize("via", ["db"], indirect=True)  # the store's statement hook is the database's
@pytest.mark.parametrize("backend", ["mysql", "postgresql"], indirect=True)
def test_a_grant_whose_reply_was_lost_is_the_answer_when_conflicts_outlast_the_callers_time(
    db_url: str, backend: str, make_client: Any, ns: str
) -> None:
    """The grant commits and its reply is lost (the connection drops after the statement: raised here by the
    store's statement hook, after the real commit); every retry then meets a row lock that another session
    holds past the caller's time. The acquire ended in AcquireTimeout, and the lease it had got held its
    permit, unknown to anyone, until its TTL. The lease under the key is the answer."""
    name, key = f"{ns}s", f"{ns}k"
    client = make_client(owner=f"{ns}w", lock_wait_timeout=1)  # sync or asyncio
    client.create_semaphore(name, 2)
    engine = create_engine(sqlalchemy_url(db_url))
    try:
        with engine.connect() as blocker:
            lost: list[str] = []

            def lose_the_reply(statement: str) -> None:
                if statement.startswith("ACQUIRE") and not lost:
                    lost.append(statement)
                    locking = text("SELECT used FROM permits_semaphore WHERE name = :n FOR UPDATE")
                    blocker.execute(locking, {"n": name})
                    raise OperationalError(statement, {}, _connection_lost(backend))

            client._store.after_statement = lose_the_reply  # type: ignore[attr-defined]
            started = time.monotonic()
            try:
                lease = client.acquire(name, key=key, ttl=60, timeout=3)
            finally:
                blocker.rollback()
    finally:
        engine.dispose()
    assert lost, "no grant statement was sent"
    assert 2.5 <= time.monotonic() - started < 10  # it did wait out the conflicts
    assert (lease.key, lease.counts) == (key, {name: 1})
    assert [h.key for h in client.holders(name)] == [key]
    assert client.release(lease) is permits.ReleaseOutcome.RELEASED


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_on_sqlite_a_queued_waiter_reads_its_place_until_it_fits(db_url: str, ns: str) -> None:
    """On SQLite every attempt takes the database's one write lock, which the grants and releases ahead of
    a queued waiter need. So between full checks a waiter that is still short of fitting reads its place
    (which takes no lock) and asks only once the read says it fits: while a holder keeps the fair mutex,
    the only attempts are the full checks' own."""
    name = f"{ns}fairfull"
    with permits.connect(db_url, owner=f"{ns}h") as holder, permits.connect(db_url, owner=f"{ns}w") as waiter:
        holder.create_semaphore(name, 1, fair=True)
        held = holder.acquire(name, ttl=30)
        counts: collections.Counter[str] = collections.Counter()
        waiter._store.after_statement = lambda statement: counts.update([statement])  # type: ignore[attr-defined]
        with pytest.raises(permits.AcquireTimeout):
            waiter.acquire(name, ttl=30, timeout=2.5)
        holder.release(held)
        assert holder.waiters(name) == []  # the timeout gave its place up
    attempts = counts["ACQUIRE_ONE"] or counts["SEM_TAKE"]
    rechecks = counts[WHY_REFUSED]
    assert attempts == rechecks, counts
    assert counts["WAITER_SHORT"] >= rechecks + 4, counts  # it kept asking, by reading


def test_a_waiter_that_fits_its_fair_queue_but_not_a_full_plain_semaphore_does_not_spin(db_url: str, ns: str) -> None:
    """A request for a fair semaphore with room and a plain one that is full fits its fair queue (short 0)
    and is still refused. It used to ask again at once, every time: about 18,000 attempts in 2 s on SQLite,
    each a write. Now it backs off as any waiter does, and is granted when the plain semaphore frees."""
    fair, plain = f"{ns}fair", f"{ns}plain"
    with permits.connect(db_url, owner=f"{ns}h") as holder, permits.connect(db_url, owner=f"{ns}w") as waiter:
        holder.create_semaphore(fair, 1, fair=True)
        holder.create_semaphore(plain, 1)
        held = holder.acquire(plain, ttl=30)
        counts: collections.Counter[str] = collections.Counter()
        waiter._store.after_statement = lambda statement: counts.update([statement])  # type: ignore[attr-defined]
        with pytest.raises(permits.AcquireTimeout):
            waiter.acquire({fair: 1, plain: 1}, ttl=30, timeout=2.0)
        assert counts["SEM_TAKE"] < 100, counts
        threading.Timer(0.3, holder.release, args=(held,)).start()
        lease = waiter.acquire({fair: 1, plain: 1}, ttl=30, timeout=10)
        assert lease.counts == {fair: 1, plain: 1}
        waiter.release(lease)


def _queue_behind_a_holder(
    db_url: str, ns: str, name: str, waiters: int, settle: float = 0.0
) -> tuple[list[int], dict[int, int]]:
    """``waiters`` clients queue, in turn, on the fair mutex ``name`` that a holder holds; each holds it for
    0.3 s once granted. Returns the order they were granted in, and each one's acquire attempts."""
    with permits.connect(db_url, owner=f"{ns}h") as holder:
        holder.create_semaphore(name, 1, fair=True)
        held = holder.acquire(name, ttl=30)
        order: list[int] = []
        attempts: dict[int, int] = {}
        threads = []
        for index in range(waiters):

            def wait(index: int = index) -> None:
                with permits.connect(db_url, owner=f"{ns}w{index}") as client:
                    seen: collections.Counter[str] = collections.Counter()
                    client._store.after_statement = lambda statement: seen.update([statement])  # type: ignore[attr-defined]
                    lease = client.acquire(name, ttl=30, timeout=30)
                    order.append(index)
                    time.sleep(0.3)
                    client.release(lease)
                    attempts[index] = seen["ACQUIRE_ONE"] or seen["SEM_TAKE"]

            thread = threading.Thread(target=wait)
            thread.start()
            threads.append(thread)
            while len(holder.waiters(name)) < index + 1:  # arrival order is queue order
                time.sleep(0.01)
        time.sleep(settle)
        holder.release(held)
        for thread in threads:
            thread.join(60)
    return order, attempts


def test_a_fair_queue_is_served_in_order_while_its_waiters_pace_themselves(db_url: str, ns: str) -> None:
    """Four waiters queue on a fair mutex; each holds it briefly. All are served, in arrival order, and a
    waiter far back in the queue makes fewer attempts than it would polling at the backoff's floor."""
    order, attempts = _queue_behind_a_holder(db_url, ns, f"{ns}fair", 4)
    assert order == [0, 1, 2, 3]
    # The last waiter waited about 1.2 s; at the backoff's 20 ms floor it would have asked ~60 times.
    assert attempts[3] < 40, attempts


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_on_postgresql_a_fair_queue_calls_its_head_and_the_rest_sleep(db_url: str, ns: str) -> None:
    """On PostgreSQL a queued waiter is called on its process's own channel when its turn comes (see
    permits/_async/listener.py): it asks about once per call instead of polling by a prediction, and no
    release wakes the waiters behind the head."""
    # The pause lets every waiter's listener come up and its place record its channel.
    order, attempts = _queue_behind_a_holder(db_url, ns, f"{ns}called", 5, settle=0.5)
    assert order == [0, 1, 2, 3, 4]
    # The last waited about 2 s behind four holders: its first attempts, one when the listener came up
    # (which records its channel), then one per call or per second. Pacing by prediction asks 10-20 times.
    assert attempts[4] <= 7, attempts


def test_a_queued_request_learns_how_many_permits_it_is_short(db_url: str, ns: str) -> None:
    """The shortfall a refused request learns when it joins a fair queue (one statement on PostgreSQL,
    four elsewhere) and each time it asks again: the permits in use, plus those wanted by the live
    waiters ahead of it and by itself, minus the capacity. A kept place does not count itself, and the
    place read between full checks (WAITER_SHORT) agrees."""
    name = f"{ns}short"
    with permits.connect(db_url, owner=f"{ns}h") as holder:
        holder.create_semaphore(name, 3, fair=True)
        held = holder.acquire({name: 2}, ttl=30)
        store: Any = holder._store
        first, second = (Want(name, 2),), (Want(name, 1),)
        assert store.try_acquire(f"{ns}a", "k", first, 30_000, wait=5.0) is None
        assert store.queue_short(f"{ns}a", "k") == 2 + 2 - 3  # in use + its own - capacity
        assert store.try_acquire(f"{ns}b", "k", second, 30_000, wait=5.0) is None
        assert store.queue_short(f"{ns}b", "k") == 2 + 2 + 1 - 3  # and the waiter ahead
        for recheck in (True, False):  # the full check keeps the place; the quick one reads it
            assert store.try_acquire(f"{ns}a", "k", first, 30_000, wait=5.0, recheck=recheck) is None
            assert store.queue_short(f"{ns}a", "k") == 1
            assert store.try_acquire(f"{ns}b", "k", second, 30_000, wait=5.0, recheck=recheck) is None
            assert store.queue_short(f"{ns}b", "k") == 2
        holder.release(held)
        granted = store.try_acquire(f"{ns}a", "k", first, 30_000, wait=5.0)
        assert granted is not None and granted.counts == {name: 2}
        assert store.try_acquire(f"{ns}b", "k", second, 30_000, wait=5.0, recheck=False) is not None


def test_a_newcomer_behind_a_fair_queue_reclaims_an_expired_lease_and_waits(db_url: str, ns: str) -> None:
    """An expired lease holds a fair semaphore's only permit and a waiter is queued. A newcomer finds the
    expired lease and ends it, which makes room, but the queue is ahead of it: the reclaim must stand (it
    used to roll back with the refusal, and the newcomer found the same lease again, restart after restart,
    until it failed with StorageError), and the newcomer waits like any refused request."""
    name = f"{ns}reclaim"
    with (
        permits.connect(db_url, owner=f"{ns}holder") as holder,
        permits.connect(db_url, owner=f"{ns}queued") as queued,
        permits.connect(db_url, owner=f"{ns}newcomer") as newcomer,
    ):
        holder.create_semaphore(name, 1, fair=True)
        stale = holder.acquire(name, ttl=0.2)
        store: Any = queued._store
        assert store.try_acquire(f"{ns}queued", "k", (Want(name, 1),), 30_000, wait=5.0) is None
        time.sleep(0.3)  # the holder's lease expires; the queued waiter keeps its place (5 s)
        with pytest.raises(permits.AcquireTimeout):
            newcomer.acquire(name, ttl=30, timeout=0.1)
        assert holder.get_lease(stale.key).end_reason == "expired"  # the reclaim stood
        assert holder.get_semaphore(name).used == 0
        lease = store.try_acquire(f"{ns}queued", "k", (Want(name, 1),), 30_000, wait=5.0, recheck=False)
        assert lease is not None  # the queue's head takes the permit the reclaim gave back


def test_expired_leases_are_reclaimed_only_where_they_would_make_the_room_lacking(db_url: str, ns: str) -> None:
    """A request for two plain semaphores is refused: ``full`` is held by a live lease, and ``roomy`` has
    room and an expired lease on it. Ending that lease would make no room the request lacks, so no
    transaction is spent on it (the read says which semaphores expired leases hold, not only whether any
    of the request's do); it is left to the sweep. An expired lease on ``full`` itself is reclaimed, and
    the request granted."""
    full, roomy = f"{ns}full", f"{ns}roomy"
    with permits.connect(db_url, owner=f"{ns}h") as holder, permits.connect(db_url, owner=f"{ns}w") as waiter:
        holder.create_semaphore(full, 1)
        holder.create_semaphore(roomy, 2)
        live = holder.acquire(full, ttl=30)
        stale = holder.acquire(roomy, ttl=0.2)
        time.sleep(0.3)
        seen: collections.Counter[str] = collections.Counter()
        waiter._store.after_statement = lambda statement: seen.update([statement])  # type: ignore[attr-defined]
        with pytest.raises(permits.AcquireTimeout):
            waiter.acquire({full: 1, roomy: 1}, ttl=30, timeout=0)
        assert seen[WHY_REFUSED] == 1 and "EXPIRED_FOR_SEMS" not in seen, seen
        assert holder.get_lease(stale.key).end_reason is None  # past its TTL, not yet ended: the sweep's to end
        holder.release(live)
        on_full = holder.acquire(full, ttl=0.2)
        time.sleep(0.3)
        seen.clear()
        lease = waiter.acquire({full: 1, roomy: 1}, ttl=30, timeout=0)
        assert seen["EXPIRED_FOR_SEMS"] == 1, seen
        assert holder.get_lease(on_full.key).end_reason == "expired"
        waiter.release(lease)
        holder.release(stale)  # ends it (as expired), rather than leave it to another test's sweep


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
def test_a_waiting_grant_gives_up_queue_places_only_where_it_may_hold_some(db_url: str, ns: str, fair: bool) -> None:
    """A grant to a caller that waits deletes the request's places in fair queues (it may have taken some
    in an earlier attempt, or through another store). Places are only ever taken in fair queues, so where
    the statement that takes the room also says the semaphores are plain, there is nothing to delete and
    no statement is spent on it. Two semaphores, so that SQLite takes the room with SEM_TAKE; PostgreSQL and
    MariaDB grant them in one statement (one request), which deletes the places in the same request,
    whatever the semaphores."""
    names = [f"{ns}a", f"{ns}b"]
    with permits.connect(db_url, owner=f"{ns}w") as client:
        for name in names:
            client.create_semaphore(name, 2, fair=fair)
        seen: collections.Counter[str] = collections.Counter()
        client._store.after_statement = lambda statement: seen.update([statement])  # type: ignore[attr-defined]
        lease = client.acquire(dict.fromkeys(names, 1), ttl=30, timeout=5)
        client.release(lease)
    if db_url.startswith(("postgresql", "mysql")):
        assert seen["ACQUIRE_MANY"] + seen["ACQUIRE_MANY_QUEUED"] == 1 and "WAITERS_DELETE" not in seen, seen
        return
    assert seen["SEM_TAKE"] == 2, seen
    assert seen["WAITERS_DELETE"] == (0 if not fair else 1), seen
