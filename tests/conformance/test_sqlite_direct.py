"""SQLite's transactions run on the sqlite3 connection itself (permits/stores/direct.py), without
SQLAlchemy's Connection. What SQLAlchemy's transaction did for them must still hold: a flow that fails
half-way leaves nothing written, driver errors arrive as permits' typed errors, and the connection goes
back to the pool with no transaction open, or is dropped when its state is unknown."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import permits
from permits._core.flows import DuplicateKey, Flow, Stmt


def _store(client: permits.Client) -> Any:
    return client._store


@pytest.fixture
def client(tmp_path: Path, ns: str) -> Iterator[permits.Client]:
    """A client on a SQLite file of its own, with one semaphore, ``<ns>s`` of capacity 2."""
    with permits.connect(f"sqlite:///{tmp_path}/direct.db", owner=f"{ns}o") as client:
        client.create_semaphore(f"{ns}s", 2)
        yield client


def _write_then_fail(ns: str) -> Flow[None]:
    yield Stmt("SEM_INSERT", {"name": f"{ns}new", "capacity": 1, "fair": 0})
    raise ValueError("the flow's own error, after its first write")


def test_a_flow_that_fails_after_a_write_leaves_nothing_written(client: permits.Client, ns: str) -> None:
    with pytest.raises(ValueError, match="after its first write"):
        _store(client).run_flow(lambda: _write_then_fail(ns))
    with pytest.raises(permits.SemaphoreNotFound):
        client.get_semaphore(f"{ns}new")
    assert _store(client).connections_in_use == 0
    # The pooled connection is usable, and outside any transaction.
    lease = client.acquire(f"{ns}s", ttl=30)
    client.release(lease)


def test_a_driver_error_half_way_is_a_typed_error_and_undoes_the_write_before_it(
    client: permits.Client, ns: str
) -> None:
    def write_then_break() -> Flow[None]:
        yield Stmt("SEM_INSERT", {"name": f"{ns}new", "capacity": 1, "fair": 0})
        # capacity >= 1 is a CHECK constraint: the database refuses the second write.
        yield Stmt("SEM_INSERT", {"name": f"{ns}bad", "capacity": 0, "fair": 0})

    with pytest.raises(permits.StorageError) as raised:
        _store(client).run_flow(write_then_break)
    assert not isinstance(raised.value.__cause__, sqlite3.Error)  # wrapped, then translated
    with pytest.raises(permits.SemaphoreNotFound):
        client.get_semaphore(f"{ns}new")
    assert _store(client).connections_in_use == 0
    assert [s.name for s in client.list_semaphores(ns)] == [f"{ns}s"]


def test_a_duplicate_key_reaches_the_flow_inside_the_same_transaction(client: permits.Client, ns: str) -> None:
    """A unique-key error is thrown into the flow, which may go on: what it wrote before still commits.
    That holds on SQLite, where a failed statement is undone alone; on PostgreSQL a failed statement aborts
    the whole transaction, which is why flows restart after a duplicate they did not expect."""

    def insert_twice() -> Flow[str]:
        yield Stmt("SEM_INSERT", {"name": f"{ns}first", "capacity": 1, "fair": 0})
        try:
            yield Stmt("SEM_INSERT", {"name": f"{ns}s", "capacity": 1, "fair": 0})
        except DuplicateKey:
            return "duplicate seen"
        return "no duplicate"

    assert _store(client).run_flow(insert_twice) == "duplicate seen"
    assert client.get_semaphore(f"{ns}first").capacity == 1


def test_a_rollback_that_fails_drops_the_connection_and_keeps_the_first_error(
    client: permits.Client, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the rollback after a failure fails too, the connection's state is unknown: it is dropped, not
    handed out again, and the caller sees the failure that started it, not the rollback's."""
    store = _store(client)
    engine = _BrokenRollbacks(store._direct._engine)
    monkeypatch.setattr(store._direct, "_engine", engine)
    with pytest.raises(ValueError, match="after its first write"):
        store.run_flow(lambda: _write_then_fail(ns))
    assert store.connections_in_use == 0
    assert engine.handed_out[0].dbapi_connection is None  # dropped, not back in the pool
    monkeypatch.undo()
    with pytest.raises(permits.SemaphoreNotFound):
        client.get_semaphore(f"{ns}new")  # the dropped connection's transaction went with it


class _BrokenRollbacks:
    """An engine whose pooled connections' driver connections fail to roll back."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.handed_out: list[Any] = []

    def raw_connection(self) -> Any:
        pooled = self._engine.raw_connection()
        self.handed_out.append(pooled)
        return _Pooled(pooled, _FailingRollback(pooled.driver_connection))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class _Pooled:
    def __init__(self, pooled: Any, driver: Any) -> None:
        self._pooled, self.driver_connection = pooled, driver

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pooled, name)


class _FailingRollback:
    def __init__(self, inner: sqlite3.Connection) -> None:
        self._inner = inner

    def rollback(self) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
