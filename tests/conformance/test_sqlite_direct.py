"""SQLite's transactions run on the sqlite3 connection itself (permits/stores/direct.py), without
SQLAlchemy's Connection. What SQLAlchemy's transaction did for them must still hold: a flow that fails
half-way leaves nothing written, driver errors arrive as permits' typed errors, and the connection goes
back to the pool with no transaction open."""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest

import permits
from permits._core.flows import DuplicateKey, Flow, Stmt


def _store(client: permits.Client) -> Any:
    return client._store


def test_a_flow_that_fails_after_a_write_leaves_nothing_written(tmp_path: pytest.TempPathFactory, ns: str) -> None:
    url = f"sqlite:///{tmp_path}/direct.db"
    with permits.connect(url, owner=f"{ns}o") as client:
        client.create_semaphore(f"{ns}s", 2)

        def write_then_fail() -> Flow[None]:
            yield Stmt("SEM_INSERT", {"name": f"{ns}new", "capacity": 1, "fair": 0})
            raise ValueError("the flow's own error, after its first write")

        with pytest.raises(ValueError, match="after its first write"):
            _store(client).run_flow(write_then_fail)
        with pytest.raises(permits.SemaphoreNotFound):
            client.get_semaphore(f"{ns}new")
        assert _store(client).connections_in_use == 0
        # The pooled connection is usable, and outside any transaction.
        lease = client.acquire(f"{ns}s", ttl=30)
        client.release(lease)


def test_a_driver_error_half_way_is_a_typed_error_and_undoes_the_write_before_it(
    tmp_path: pytest.TempPathFactory, ns: str
) -> None:
    url = f"sqlite:///{tmp_path}/direct.db"
    with permits.connect(url, owner=f"{ns}o") as client:
        client.create_semaphore(f"{ns}s", 2)

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


def test_a_duplicate_key_reaches_the_flow_inside_the_same_transaction(
    tmp_path: pytest.TempPathFactory, ns: str
) -> None:
    """A unique-key error is thrown into the flow, which may go on: what it wrote before still commits."""
    url = f"sqlite:///{tmp_path}/direct.db"
    with permits.connect(url, owner=f"{ns}o") as client:
        client.create_semaphore(f"{ns}taken", 1)

        def insert_twice() -> Flow[str]:
            yield Stmt("SEM_INSERT", {"name": f"{ns}first", "capacity": 1, "fair": 0})
            try:
                yield Stmt("SEM_INSERT", {"name": f"{ns}taken", "capacity": 1, "fair": 0})
            except DuplicateKey:
                return "duplicate seen"
            return "no duplicate"

        assert _store(client).run_flow(insert_twice) == "duplicate seen"
        assert client.get_semaphore(f"{ns}first").capacity == 1
