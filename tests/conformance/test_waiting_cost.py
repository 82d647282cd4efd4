"""What a waiting acquire costs the database (see permits._pacing): a retry that finds no room is one
statement, and the transaction that finds out why runs on the first attempt and then at most once a
second. Counted with the store's statement hook, on every backend."""

from __future__ import annotations

import collections
import threading
import time

import pytest

import permits

#: The statements of the why-refused transaction (flows._why_refused).
WHY_REFUSED = ("LEASE_FIND", "SEMS_READ")


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
    rechecks = max(counts[s] for s in WHY_REFUSED)
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


def test_a_fair_queue_is_served_in_order_while_its_waiters_pace_themselves(db_url: str, ns: str) -> None:
    """Four waiters queue on a fair mutex; each holds it briefly. All are served, in arrival order, and a
    waiter far back in the queue makes fewer attempts than it would polling at the backoff's floor."""
    name = f"{ns}fair"
    with permits.connect(db_url, owner=f"{ns}h") as holder:
        holder.create_semaphore(name, 1, fair=True)
        held = holder.acquire(name, ttl=30)
        order: list[int] = []
        attempts: dict[int, int] = {}
        threads = []
        for index in range(4):

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
        holder.release(held)
        for thread in threads:
            thread.join(60)
    assert order == [0, 1, 2, 3]
    # The last waiter waited about 1.2 s; at the backoff's 20 ms floor it would have asked ~60 times.
    assert attempts[3] < 40, attempts
