"""A client closed while another thread (or task) is still at work in it: that work finishes as it would
have, a waiting acquire is told the client is closed, and once they are done the client holds no
connection to the database. SQLAlchemy's ``dispose()`` alone would leave each connection that was checked
out at close in a pool nobody disposes (closed only when the garbage collector finds it), and would open
new ones for an operation that goes on after it."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, event, make_url, text

import permits
from permits.stores._engine import sync_engine
from tests.conftest import AsyncFacade, in_thread, sqlalchemy_url

pytestmark = pytest.mark.usefixtures("servers")


@pytest.fixture
def via() -> str:
    """Overrides the conformance fixture: the stores and their pools, not the service."""
    return "db"


def _store(client: Any) -> Any:
    store = client._client._store if isinstance(client, AsyncFacade) else client._store
    return getattr(store, "_inner", store)  # the asyncio client runs SQLite's sync store on a thread


class _OpenConnections:
    """The connections a store's pools have opened and not closed yet (recreated pools included: pool
    events set on the engine are carried over)."""

    def __init__(self, store: Any) -> None:
        self._guard = threading.Lock()
        self.opened = self.closed = 0
        engine = sync_engine(store._engine)
        event.listen(engine, "connect", self._on_connect)
        event.listen(engine, "close", self._on_close)
        event.listen(engine, "close_detached", self._on_close)

    def _on_connect(self, *_: Any) -> None:
        with self._guard:
            self.opened += 1

    def _on_close(self, *_: Any) -> None:
        with self._guard:
            self.closed += 1

    @property
    def still_open(self) -> int:
        return self.opened - self.closed


@contextlib.contextmanager
def _semaphore_row_locked(db_url: str, backend: str, name: str, for_seconds: float) -> Iterator[None]:
    """Another transaction holds the semaphore's row (SQLite: the database's write lock) for ``for_seconds``
    from the block's start, so that a grant begun in the block is still at work when the block's code
    goes on."""
    if backend == "sqlite":
        with contextlib.closing(
            sqlite3.connect(make_url(db_url).database or "", isolation_level=None, check_same_thread=False)
        ) as raw:
            raw.execute("BEGIN IMMEDIATE")
            with _rolled_back_after(raw, for_seconds):
                yield
        return
    engine = create_engine(sqlalchemy_url(db_url))
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1 FROM permits_semaphore WHERE name = :n FOR UPDATE"), {"n": name})
            with _rolled_back_after(conn, for_seconds):
                yield
    finally:
        engine.dispose()


@contextlib.contextmanager
def _rolled_back_after(conn: Any, seconds: float) -> Iterator[None]:
    """``conn``'s transaction rolls back ``seconds`` from now, on a timer; the block ends after it has."""
    timer = threading.Timer(seconds, conn.rollback)
    timer.start()
    try:
        yield
    finally:
        timer.join()


def test_an_operation_in_flight_at_close_finishes_and_leaves_no_connection(
    make_client: Callable[..., Any], db_url: str, backend: str, ns: str
) -> None:
    client = make_client(owner=f"{ns}o")
    opened = _OpenConnections(_store(client))  # before the client's first connection
    client.create_semaphore(f"{ns}s", 2)
    with _semaphore_row_locked(db_url, backend, f"{ns}s", for_seconds=1.5):
        thread, outcome = in_thread(lambda: client.acquire({f"{ns}s": 1}, key="k", timeout=20))
        time.sleep(0.5)  # the grant waits for the row
        client.close()
        thread.join(30)
    assert "error" not in outcome, outcome
    assert outcome["value"].key == "k"  # the grant went through: close() does not cut work short
    assert opened.still_open == 0


def test_a_waiting_acquire_is_told_the_client_is_closed(make_client: Callable[..., Any], ns: str) -> None:
    holder = make_client(owner=f"{ns}holder")
    holder.create_semaphore(f"{ns}s", 1)
    holder.acquire({f"{ns}s": 1}, key="held")
    client = make_client(owner=f"{ns}o")
    opened = _OpenConnections(_store(client))  # before the client's first connection
    client.get_semaphore(f"{ns}s")  # opened, so that only its waiting is left to do
    started = time.monotonic()
    thread, outcome = in_thread(lambda: client.acquire({f"{ns}s": 1}, key="k", timeout=20))
    time.sleep(0.5)  # waiting now
    client.close()
    thread.join(30)
    assert isinstance(outcome.get("error"), permits.UsageError), outcome
    assert time.monotonic() - started < 10  # told at its next look, not at the end of its timeout
    assert opened.still_open == 0
