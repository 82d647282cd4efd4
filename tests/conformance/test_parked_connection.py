"""The sync store keeps one connection out of the pool between the statements that run alone (a grant, a
release: ``_drive_alone_pooled``), and on PostgreSQL leaves it in autocommit. What the pool did for those
statements must still hold: a connection whose link was lost is never used again and the operation is not
lost with it, transactions are not kept waiting for a connection while the parked one sits idle, the pool's
own checks still reach it, a connection goes back to the pool as the pool's other users expect it, and
threads that share a client never share a connection."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import event

import permits
import permits._sync.store as sync_store

pytestmark = pytest.mark.usefixtures("servers")


@pytest.fixture(params=["mysql", "postgresql"])
def backend(request: pytest.FixtureRequest) -> str:
    """Overrides the conftest fixture: SQLite's transactions run on its own connection (stores/direct.py)."""
    return str(request.param)


class _PoolTraffic:
    """Counts what a store's pool does: connections made, checkouts."""

    def __init__(self, store: Any) -> None:
        self.connects = self.checkouts = 0
        event.listen(store._engine, "connect", self._connected)
        event.listen(store._engine, "checkout", self._checked_out)

    def _connected(self, *_: Any) -> None:
        self.connects += 1

    def _checked_out(self, *_: Any) -> None:
        self.checkouts += 1


@pytest.fixture
def client(db_url: str, ns: str) -> Iterator[permits.Client]:
    """A client on its own pool, with a semaphore ``<ns>s`` of capacity 2."""
    with permits.connect(db_url, owner=f"{ns}o") as client:
        client.create_semaphore(f"{ns}s", 2)
        yield client


def _cycle(client: permits.Client, name: str) -> int:
    lease = client.acquire(name, ttl=30, timeout=10)
    assert client.release(lease) is permits.ReleaseOutcome.RELEASED
    return lease.token


def _server_session(store: Any, pooled: Any) -> Any:
    return store._sessions[pooled.driver_connection]["id"]


def _end_server_session(db_url: str, backend: str, session_id: Any) -> None:
    """End a server session from outside, as a restarted proxy or an administrator's kill would."""
    engine = sqlalchemy.create_engine(_driver_url(db_url, backend))
    try:
        with engine.begin() as conn:
            if backend == "postgresql":
                conn.exec_driver_sql(f"SELECT pg_terminate_backend({int(session_id)})")
            else:
                conn.exec_driver_sql(f"KILL {int(session_id)}")
    finally:
        engine.dispose()


def _driver_url(db_url: str, backend: str) -> str:
    driver = "postgresql+psycopg" if backend == "postgresql" else "mysql+pymysql"
    return sqlalchemy.engine.make_url(db_url).set(drivername=driver).render_as_string(hide_password=False)


def test_grants_and_releases_reuse_one_connection_kept_out_of_the_pool(client: permits.Client, ns: str) -> None:
    store = client._store
    _cycle(client, f"{ns}s")
    traffic = _PoolTraffic(store)
    tokens = [_cycle(client, f"{ns}s") for _ in range(20)]
    assert tokens == sorted(set(tokens))
    assert (traffic.connects, traffic.checkouts) == (0, 0)
    assert store.connections_in_use == 1  # the parked one


def test_a_transaction_takes_the_parked_connection_when_the_pool_has_none_idle(client: permits.Client, ns: str) -> None:
    store = client._store
    store._engine.dispose()  # a pool with no connection yet
    traffic = _PoolTraffic(store)
    _cycle(client, f"{ns}s")
    assert store._parked is not None
    client.create_semaphore(f"{ns}t", 1)  # a transaction: not a statement that runs alone
    assert traffic.connects == 1, "the transaction opened a connection while one sat parked"
    assert store._parked is None
    _cycle(client, f"{ns}t")
    assert traffic.connects == 1


def test_a_parked_connection_goes_back_to_the_pool_as_the_pool_found_it(
    client: permits.Client, ns: str, backend: str
) -> None:
    store = client._store
    _cycle(client, f"{ns}s")
    parked, _ = store._parked
    driver = parked.driver_connection
    store._unpark_into_pool()
    assert store.connections_in_use == 0
    pooled = store._engine.raw_connection()
    try:
        assert pooled.driver_connection is driver
        if backend == "postgresql":
            assert driver.autocommit is False
            assert driver.info.transaction_status == driver.info.transaction_status.IDLE
    finally:
        pooled.close()
    client.create_semaphore(f"{ns}t", 1)  # a transaction on it commits as before
    assert client.get_semaphore(f"{ns}t").capacity == 1


def test_a_parked_connection_whose_server_session_ended_loses_no_operation(
    client: permits.Client, ns: str, db_url: str, backend: str
) -> None:
    store = client._store
    name = f"{ns}s"
    _cycle(client, name)
    parked, _ = store._parked
    _end_server_session(db_url, backend, _server_session(store, parked))
    lease = client.acquire(name, ttl=30, timeout=10)  # meets the dead link, and is retried on a new one
    assert store._parked is not None and store._parked[0] is not parked
    assert client.get_semaphore(name).used == 1
    assert client.release(lease) is permits.ReleaseOutcome.RELEASED
    assert client.get_semaphore(name).used == 0
    assert [d for d in client.reconcile() if d.name == name] == []


def test_a_connection_goes_back_through_the_pool_once_it_has_been_out_long_enough(
    client: permits.Client, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = client._store
    _cycle(client, f"{ns}s")
    monkeypatch.setattr(sync_store, "PARK_SECONDS", 0.0)
    store._unpark_into_pool()  # the one parked before
    traffic = _PoolTraffic(store)
    for _ in range(3):
        _cycle(client, f"{ns}s")
        assert store._parked is None
        assert store.connections_in_use == 0
    assert traffic.checkouts == 6  # every statement through the pool, where its checks apply


def test_close_gives_the_parked_connection_back(db_url: str, ns: str) -> None:
    client = permits.connect(db_url, owner=f"{ns}o")
    client.create_semaphore(f"{ns}s", 1)
    _cycle(client, f"{ns}s")
    store = client._store
    assert store._parked is not None
    client.close()
    assert store._parked is None
    assert store.connections_in_use == 0


def test_threads_sharing_a_client_never_share_a_connection(client: permits.Client, ns: str) -> None:
    store = client._store
    name = f"{ns}s"
    in_flight: set[int] = set()
    shared: list[int] = []
    guard = threading.Lock()
    attribute = "_send_autocommit" if store._dialect.free_autocommit else "_send_batch"
    send = getattr(sync_store, attribute)

    def watched(driver: Any, *args: Any, **kwargs: Any) -> Any:
        with guard:
            if id(driver) in in_flight:
                shared.append(id(driver))
            in_flight.add(id(driver))
        try:
            return send(driver, *args, **kwargs)
        finally:
            with guard:
                in_flight.discard(id(driver))

    tokens: list[int] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(15):
                token = _cycle(client, name)
                with guard:
                    tokens.append(token)
        except BaseException as exc:  # reported below
            errors.append(exc)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sync_store, attribute, watched)
        threads = [threading.Thread(target=work) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert errors == []
    assert shared == [], "two threads sent statements on one connection at once"
    assert len(tokens) == len(set(tokens)) == 90
    assert client.get_semaphore(name).used == 0
    assert store.connections_in_use <= 1
