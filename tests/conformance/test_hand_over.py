"""A line's turn (``HAND_OVER``, the service's group commit): one statement releases leases over one
semaphore and grants waiting requests for it, in order, as far as the room then goes.

Driven through the store on the servers that have it (PostgreSQL, MariaDB 10.6+); the service's own use of
it is tested in tests/service/test_instance.py, and every behaviour test runs through the service too.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import create_engine, text

import permits
from permits import EndReason
from tests.conftest import sqlalchemy_url

#: The servers whose dialects have the turn's statement.
servers = pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)


def _store(client: permits.Client) -> Any:
    store = client._store  # type: ignore[attr-defined]
    assert store.hands_over
    return store


def _requests(ns: str, *keys: str) -> list[tuple[str, str, int]]:
    return [(f"{ns}o", f"{ns}{key}", 30_000) for key in keys]


@servers
def test_a_turn_grants_in_order_as_far_as_the_room_goes(db_url: str, ns: str) -> None:
    name = f"{ns}sem"
    with permits.connect(db_url, owner=f"{ns}o") as client:
        client.create_semaphore(name, 3)
        held = client.acquire(name, ttl=30)
        handed = _store(client).hand_over(name, [], _requests(ns, "a", "b", "c", "d"), 5.0)
        granted = [lease for lease in handed.leases if lease is not None]
        assert [lease.key for lease in granted] == [f"{ns}a", f"{ns}b"]  # the room left, in the order given
        assert handed.leases[2:] == [None, None] and not handed.ask_alone and not handed.fair
        assert handed.room == 0
        # Tokens go on from the last one, in that order, and every grant is a lease like any other.
        assert [lease.tokens[name] for lease in granted] == [held.tokens[name] + 1, held.tokens[name] + 2]
        for lease in granted:
            stored = client.get_lease(lease.key)
            assert stored.held and stored.tokens == lease.tokens and stored.expires_at == lease.expires_at
            assert 29 < (lease.expires_at - lease.acquired_at).total_seconds() <= 30
        sem = client.get_semaphore(name)
        assert (sem.used, sem.last_token) == (3, held.tokens[name] + 2)
        assert client.reconcile() == []


@servers
def test_a_turn_hands_the_permits_it_releases_to_the_requests(db_url: str, ns: str) -> None:
    name = f"{ns}sem"
    with permits.connect(db_url, owner=f"{ns}o") as client:
        client.create_semaphore(name, 2)
        first, second = client.acquire(name, ttl=30), client.acquire(name, ttl=30)
        gone = [(f"{ns}o", first.key), (f"{ns}o", second.key)]
        handed = _store(client).hand_over(name, gone, _requests(ns, "a", "b", "c"), 5.0)
        assert handed.released == [True, True]
        assert [lease is not None for lease in handed.leases] == [True, True, False]
        assert client.get_lease(first.key).end_reason is EndReason.RELEASED
        assert client.get_lease(second.key).end_reason is EndReason.RELEASED
        assert client.get_semaphore(name).used == 2
        assert client.reconcile() == []
        # Releases alone give their permits back, as a release does.
        handed = _store(client).hand_over(name, [(f"{ns}o", f"{ns}a")], [], None)
        assert handed.released == [True] and handed.leases == [] and handed.room == 1
        assert client.get_semaphore(name).used == 1
        assert client.reconcile() == []


@servers
def test_a_release_that_is_not_held_is_left_to_its_caller(db_url: str, ns: str) -> None:
    name = f"{ns}sem"
    with permits.connect(db_url, owner=f"{ns}o") as client:
        client.create_semaphore(name, 2)
        done = client.acquire(name, ttl=30)
        client.release(done)
        expiring = client.acquire(name, ttl=0.2)
        held = client.acquire(name, ttl=30)
        time.sleep(0.3)
        gone = [(f"{ns}o", done.key), (f"{ns}o", f"{ns}never"), (f"{ns}o", expiring.key), (f"{ns}o", held.key)]
        handed = _store(client).hand_over(name, gone, [], None)
        # Released before, never granted, expired: not this turn's to release; the held one is.
        assert handed.released == [False, False, False, True]
        assert client.release(expiring) is permits.ReleaseOutcome.LOST  # alone, it says what it was
        assert client.get_semaphore(name).used == 0
        assert client.reconcile() == []


@servers
def test_a_key_that_has_a_lease_makes_the_turn_do_nothing(db_url: str, ns: str) -> None:
    """A retry of a granted request in a turn: nothing is done, and everything asks alone, where the retry
    is answered from its lease."""
    name = f"{ns}sem"
    with permits.connect(db_url, owner=f"{ns}o") as client:
        client.create_semaphore(name, 5)
        held = client.acquire(name, ttl=30)
        other = client.acquire(name, ttl=30)
        requests = [*_requests(ns, "a"), (f"{ns}o", held.key, 30_000), *_requests(ns, "b")]
        handed = _store(client).hand_over(name, [(f"{ns}o", other.key)], requests, 5.0)
        assert handed.released == [False] and handed.leases == [None, None, None] and handed.ask_alone
        assert client.get_lease(other.key).held  # the release in it was not done either
        assert client.get_semaphore(name).used == 2
        again = client.acquire(name, key=held.key, ttl=30)
        assert again.tokens == held.tokens
        assert client.reconcile() == []


@servers
def test_a_fair_semaphore_takes_no_part(db_url: str, ns: str) -> None:
    name = f"{ns}fair"
    with permits.connect(db_url, owner=f"{ns}o") as client:
        client.create_semaphore(name, 2, fair=True)
        held = client.acquire(name, ttl=30)
        handed = _store(client).hand_over(name, [(f"{ns}o", held.key)], _requests(ns, "a"), 5.0)
        assert handed.fair and handed.ask_alone
        assert handed.released == [False] and handed.leases == [None]
        assert client.get_lease(held.key).held and client.get_semaphore(name).used == 1


@servers
def test_a_lease_over_another_semaphore_too_is_left_to_its_caller(db_url: str, ns: str) -> None:
    a, b = f"{ns}a", f"{ns}b"
    with permits.connect(db_url, owner=f"{ns}o") as client:
        client.create_semaphore(a, 2)
        client.create_semaphore(b, 2)
        both = client.acquire({a: 1, b: 1}, ttl=30)
        handed = _store(client).hand_over(a, [(f"{ns}o", both.key)], [], None)
        assert handed.released == [False]
        assert client.get_lease(both.key).held
        assert (client.get_semaphore(a).used, client.get_semaphore(b).used) == (1, 1)


@servers
def test_a_semaphore_that_does_not_exist(db_url: str, ns: str) -> None:
    with permits.connect(db_url, owner=f"{ns}o") as client:
        handed = _store(client).hand_over(f"{ns}nothing", [], _requests(ns, "a"), 5.0)
        assert handed.leases == [None] and handed.ask_alone and not handed.fair and handed.room is None
        with pytest.raises(permits.SemaphoreNotFound):
            client.try_acquire(f"{ns}nothing", key=f"{ns}a")


@servers
def test_a_capacity_lowered_below_use_still_takes_the_releases(db_url: str, ns: str) -> None:
    name = f"{ns}sem"
    with permits.connect(db_url, owner=f"{ns}o") as client:
        client.create_semaphore(name, 3)
        leases = [client.acquire(name, ttl=30) for _ in range(3)]
        client.set_capacity(name, 1, reason="test")
        handed = _store(client).hand_over(name, [(f"{ns}o", leases[0].key)], _requests(ns, "a"), 5.0)
        assert handed.released == [True] and handed.leases == [None]  # 2 in use, capacity 1: no room
        assert client.get_semaphore(name).used == 2
        assert client.reconcile() == []


@servers
def test_a_release_committed_while_a_turn_waits_is_counted_with_it(db_url: str, ns: str) -> None:
    """The semaphore is full when a turn begins; while it waits for the lease it releases, another release
    commits, and the turn locks the row with room in it. Its one write of the row must take both its release
    and its grants: on PostgreSQL a count in that write's WHERE was checked against the row as the
    statement's snapshot had it (full), and the write was skipped, the turn's release with it (a permit
    lost for good, found by the fault tests)."""
    name = f"{ns}sem"
    with permits.connect(db_url, owner=f"{ns}o") as client:
        client.create_semaphore(name, 3)
        first, second, _ = (client.acquire(name, ttl=30) for _ in range(3))
        engine = create_engine(sqlalchemy_url(db_url))
        try:
            with engine.connect() as holder:
                lock = "SELECT id FROM permits_lease WHERE owner = :o AND lease_key = :k FOR UPDATE"
                holder.execute(text(lock), {"o": f"{ns}o", "k": second.key})
                turn: dict[str, Any] = {}
                waiting = threading.Thread(
                    target=lambda: turn.update(
                        handed=_store(client).hand_over(name, [(f"{ns}o", second.key)], _requests(ns, "a", "b"), 10.0)
                    )
                )
                waiting.start()
                time.sleep(0.5)  # the turn has begun, and waits for the lease row
                with permits.connect(db_url, owner=f"{ns}o") as other:
                    assert other.release(first.key) is permits.ReleaseOutcome.RELEASED
                holder.rollback()  # the lease row is free: the turn goes on, and finds room for both
                waiting.join(20)
        finally:
            engine.dispose()
        handed = turn["handed"]
        assert handed.released == [True]
        assert [lease is not None for lease in handed.leases] == [True, True]
        assert client.get_semaphore(name).used == 3
        assert client.reconcile() == []


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_sqlite_has_no_turns(db_url: str) -> None:
    with permits.connect(db_url) as client:
        assert not client._store.hands_over  # type: ignore[attr-defined]
