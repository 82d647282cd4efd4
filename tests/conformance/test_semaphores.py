"""Semaphores: create, get, list, capacity changes with their audit trail, delete. Every backend, both
clients."""

from __future__ import annotations

from typing import Any

import pytest

import permits


def test_create_get_list(client: Any, ns: str) -> None:
    created = client.create_semaphore(f"{ns}backups", 10)
    assert (created.name, created.capacity, created.used, created.last_token) == (f"{ns}backups", 10, 0, 0)
    assert created.available == 10
    client.create_semaphore(f"{ns}alpha", 1)
    got = client.get_semaphore(f"{ns}backups")
    assert got.capacity == 10 and got.used == 0
    assert [s.name for s in client.list_semaphores(ns)] == [f"{ns}alpha", f"{ns}backups"]


def test_create_twice(client: Any, ns: str) -> None:
    client.create_semaphore(f"{ns}s", 2)
    with pytest.raises(permits.SemaphoreExists):
        client.create_semaphore(f"{ns}s", 2)
    assert client.create_semaphore(f"{ns}s", 2, exist_ok=True).capacity == 2
    with pytest.raises(permits.SemaphoreExists, match="capacity 2"):
        client.create_semaphore(f"{ns}s", 3, exist_ok=True)


def test_unknown_semaphore(client: Any, ns: str) -> None:
    with pytest.raises(permits.SemaphoreNotFound):
        client.get_semaphore(f"{ns}nope")
    with pytest.raises(permits.SemaphoreNotFound):
        client.try_acquire(f"{ns}nope")
    with pytest.raises(permits.SemaphoreNotFound):
        client.set_capacity(f"{ns}nope", 3, reason="x")
    with pytest.raises(permits.SemaphoreNotFound):
        client.delete_semaphore(f"{ns}nope")
    with pytest.raises(permits.SemaphoreNotFound):
        client.holders(f"{ns}nope")


def test_names_compare_byte_exact(client: Any, ns: str) -> None:
    # MariaDB's default collations would make these one key; permits keeps them apart everywhere.
    names = [f"{ns}lock", f"{ns}Lock", f"{ns}lock ", f"{ns}lóck", f"{ns}lo\u0301ck"]
    for name in names:
        client.create_semaphore(name, 1)
    assert sorted(s.name for s in client.list_semaphores(ns)) == sorted(names)
    for name in names:
        assert client.try_acquire(name) is not None, name
    for name in names:
        assert client.get_semaphore(name).used == 1


def test_set_capacity_records_who_why_when(client: Any, ns: str) -> None:
    client.create_semaphore(f"{ns}s", 2)
    change = client.set_capacity(f"{ns}s", 5, reason="more backup slots", who="alice")
    assert (change.old_capacity, change.new_capacity, change.changed_by, change.reason) == (
        2,
        5,
        "alice",
        "more backup slots",
    )
    history = client.capacity_history(f"{ns}s")
    assert [(h.old_capacity, h.new_capacity) for h in history] == [(2, 5), (None, 2)]
    assert history[0].changed_at >= history[1].changed_at
    assert client.get_semaphore(f"{ns}s").capacity == 5


def test_lowering_capacity_revokes_nothing(client: Any, ns: str) -> None:
    name = f"{ns}s"
    client.create_semaphore(name, 3)
    leases = [client.try_acquire(name) for _ in range(3)]
    assert all(leases)
    client.set_capacity(name, 1, reason="shrink")
    assert client.get_semaphore(name).used == 3  # nobody lost a permit
    assert all(client.get_lease(lease.key).held for lease in leases)
    client.release(leases[0])
    client.release(leases[1])
    assert client.try_acquire(name) is None  # 1 in use, capacity 1: no room yet
    client.release(leases[2])
    assert client.try_acquire(name) is not None


def test_delete_refused_while_held(client: Any, ns: str) -> None:
    client.create_semaphore(f"{ns}s", 2)
    lease = client.try_acquire(f"{ns}s")
    with pytest.raises(permits.SemaphoreInUse):
        client.delete_semaphore(f"{ns}s")
    assert client.get_semaphore(f"{ns}s").used == 1
    client.release(lease)
    assert client.delete_semaphore(f"{ns}s") == 0
    with pytest.raises(permits.SemaphoreNotFound):
        client.get_semaphore(f"{ns}s")


def test_forced_delete_revokes_whole_leases(client: Any, ns: str) -> None:
    client.create_semaphore(f"{ns}a", 2)
    client.create_semaphore(f"{ns}b", 2)
    lease = client.try_acquire({f"{ns}a": 1, f"{ns}b": 2})
    assert client.delete_semaphore(f"{ns}a", force=True) == 1
    ended = client.get_lease(lease.key)
    assert ended.end_reason == permits.EndReason.REVOKED
    assert client.get_semaphore(f"{ns}b").used == 0  # the lease's other permits came back too
    with pytest.raises(permits.LeaseLost) as lost:
        client.extend(lease, 10)
    assert lost.value.reason == "revoked"
    assert client.reconcile() == []


def test_tokens_survive_delete_and_recreate(client: Any, ns: str) -> None:
    name = f"{ns}s"
    client.create_semaphore(name, 1)
    tokens = []
    for _ in range(3):
        lease = client.try_acquire(name)
        tokens.append(lease.token)
        client.release(lease)
    client.delete_semaphore(name)
    client.create_semaphore(name, 4)
    again = client.try_acquire(name)
    assert again.token > max(tokens), "a recreated semaphore must not hand out old tokens again"
    assert client.capacity_history(name)[0].new_capacity == 4


def test_a_deleted_semaphore_takes_its_fair_queue_with_it(db_url: str, ns: str) -> None:
    """Places in a fair queue belong to the semaphore: deleting it deletes them. A semaphore created again
    under the name (which revives the row and its id) starts with an empty queue, and a newcomer is not
    kept out by the waiters of the one that was deleted."""
    name = f"{ns}q"
    with permits.connect(db_url, owner=f"{ns}o") as client:
        client.create_semaphore(name, 1, fair=True)
        held = client.acquire(name, ttl=30)
        store: Any = client._store
        assert store.try_acquire(f"{ns}w", "k", (permits.Want(name, 1),), 30_000, wait=5.0) is None
        assert len(client.waiters(name)) == 1
        assert client.delete_semaphore(name, force=True) == 1
        client.create_semaphore(name, 1, fair=True)
        assert client.waiters(name) == []
        lease = client.try_acquire(name)
        assert lease is not None and lease.key != held.key
        client.release(lease)
