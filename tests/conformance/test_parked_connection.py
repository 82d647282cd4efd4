"""Both stores keep connections out of the pool between the statements that run alone (a grant, a release:
the store's ``_Parked``), and on PostgreSQL leave them in autocommit. What the pool did for those
statements must still hold: a connection whose link was lost is never used again and the operation is not
lost with it, transactions are not kept waiting for a connection while a parked one sits idle, the pool's
own checks still reach it, a connection goes back to the pool as the pool's other users expect it, and
threads or tasks that share a client never share a connection."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import event

import permits
import permits._async.store as async_store
import permits._sync.store as sync_store
from permits._io import monotonic
from permits.stores._engine import (
    async_alone_driver,
    async_check_out_alone,
    sync_alone_driver,
    sync_check_out_alone,
    sync_engine,
)
from tests.conftest import AsyncFacade, sqlalchemy_url

pytestmark = pytest.mark.usefixtures("servers")


@pytest.fixture(params=["mysql", "postgresql"])
def backend(request: pytest.FixtureRequest) -> str:
    """Overrides the conftest fixture: SQLite's transactions run on its own connection (stores/direct.py)."""
    return str(request.param)


@pytest.fixture
def via() -> str:
    """Overrides the conformance fixture: the stores themselves, not the service."""
    return "db"


def _store(client: Any) -> Any:
    return client._client._store if isinstance(client, AsyncFacade) else client._store


def _call(client: Any, method: Callable[..., Any], *args: Any) -> Any:
    """Call a store's method, on the client's event loop where it is the asyncio store's."""
    result = method(*args)
    return client._call(result) if asyncio.iscoroutine(result) else result


def _sender_name(store: Any) -> str:
    """The store module's function that sends a statement that runs alone, on this store's database."""
    return "_send_autocommit" if store._dialect.free_autocommit else "_send_batch"


class _PoolTraffic:
    """Counts what a store's pool does: connections made, checkouts."""

    def __init__(self, store: Any) -> None:
        self.connects = self.checkouts = 0
        event.listen(sync_engine(store._engine), "connect", self._connected)
        event.listen(sync_engine(store._engine), "checkout", self._checked_out)

    def _connected(self, *_: Any) -> None:
        self.connects += 1

    def _checked_out(self, *_: Any) -> None:
        self.checkouts += 1


def _opened(make_client: Callable[..., Any], ns: str) -> Any:
    """A client on a pool of its own, with a semaphore ``<ns>s`` of capacity 2."""
    client = make_client(owner=f"{ns}o")
    client.create_semaphore(f"{ns}s", 2)
    return client


def _cycle(client: Any, name: str) -> int:
    lease = client.acquire(name, ttl=30, timeout=10)
    assert client.release(lease) is permits.ReleaseOutcome.RELEASED
    return int(lease.token)


def _end_server_session(db_url: str, backend: str, session_id: Any) -> None:
    """End a server session from outside, as a restarted proxy or an administrator's kill would."""
    engine = sqlalchemy.create_engine(sqlalchemy_url(db_url))
    try:
        with engine.begin() as conn:
            if backend == "postgresql":
                conn.exec_driver_sql(f"SELECT pg_terminate_backend({int(session_id)})")
            else:
                conn.exec_driver_sql(f"KILL {int(session_id)}")
    finally:
        engine.dispose()


def test_grants_and_releases_reuse_a_connection_kept_out_of_the_pool(make_client: Callable[..., Any], ns: str) -> None:
    client = _opened(make_client, ns)
    store = _store(client)
    _cycle(client, f"{ns}s")
    traffic = _PoolTraffic(store)
    tokens = [_cycle(client, f"{ns}s") for _ in range(20)]
    assert tokens == sorted(set(tokens))
    assert (traffic.connects, traffic.checkouts) == (0, 0)
    assert len(store._parked) == 1
    assert store.connections_in_use == 0  # a parked connection is not at work


def test_a_transaction_takes_a_parked_connection_when_the_pool_has_none_idle(
    make_client: Callable[..., Any], ns: str
) -> None:
    client = _opened(make_client, ns)
    store = _store(client)
    _call(client, store._engine.dispose)  # a pool with no connection yet
    traffic = _PoolTraffic(store)
    _cycle(client, f"{ns}s")
    assert len(store._parked) == 1
    client.create_semaphore(f"{ns}t", 1)  # a transaction: not a statement that runs alone
    assert traffic.connects == 1, "the transaction opened a connection while one sat parked"
    assert store._parked == []
    _cycle(client, f"{ns}t")
    assert traffic.connects == 1


def test_a_parked_connection_goes_back_to_the_pool_as_the_pool_found_it(
    make_client: Callable[..., Any], ns: str, backend: str
) -> None:
    client = _opened(make_client, ns)
    store = _store(client)
    _cycle(client, f"{ns}s")
    (parked,) = store._parked
    _call(client, store._unpark_into_pool)
    assert store._parked == []
    assert _call(client, store._engine.pool.checkedout) == 0
    if backend == "postgresql":
        assert parked.driver.autocommit is False
        assert parked.driver.info.transaction_status == parked.driver.info.transaction_status.IDLE
    client.create_semaphore(f"{ns}t", 1)  # a transaction on it commits as before
    assert client.get_semaphore(f"{ns}t").capacity == 1


def test_a_parked_connection_whose_server_session_ended_loses_no_operation(
    make_client: Callable[..., Any], ns: str, db_url: str, backend: str
) -> None:
    client = _opened(make_client, ns)
    store = _store(client)
    name = f"{ns}s"
    _cycle(client, name)
    (parked,) = store._parked
    _end_server_session(db_url, backend, store._sessions[parked.driver]["id"])
    lease = client.acquire(name, ttl=30, timeout=10)  # meets the dead link, and is retried on a new one
    assert [p.driver for p in store._parked] != [parked.driver]
    assert client.get_semaphore(name).used == 1
    assert client.release(lease) is permits.ReleaseOutcome.RELEASED
    assert client.get_semaphore(name).used == 0
    assert [d for d in client.reconcile() if d.name == name] == []


def _park_fresh(client: Any, store: Any, count: int) -> None:
    """Park ``count`` more connections, checked out of the pool as a statement that runs alone takes one."""
    if isinstance(client, AsyncFacade):

        async def park() -> None:
            conn = await async_check_out_alone(store._engine)
            await store._park(async_store._Parked(conn, await async_alone_driver(conn), monotonic()))

        for _ in range(count):
            client._call(park())
    else:
        for _ in range(count):
            conn = sync_check_out_alone(store._engine)
            store._park(sync_store._Parked(conn, sync_alone_driver(conn), monotonic()))


def test_parked_connections_that_all_lost_their_sessions_cost_one_retry(
    make_client: Callable[..., Any], ns: str, db_url: str, backend: str
) -> None:
    """The server ended every idle session (a restart, an idle timeout): the first statement meets a dead
    link, and the retry gets a new connection, not the next dead one, parked or in the pool."""
    client = make_client(owner=f"{ns}o", retries=1)
    client.create_semaphore(f"{ns}s", 2)
    store = _store(client)
    _cycle(client, f"{ns}s")
    _park_fresh(client, store, sync_store.PARKED_AT_MOST - 1)
    assert len(store._parked) == sync_store.PARKED_AT_MOST
    for parked in list(store._parked):
        _end_server_session(db_url, backend, store._sessions[parked.driver]["id"])
    faults: list[str] = []
    store.on_retry = faults.append
    _cycle(client, f"{ns}s")
    assert faults == ["unavailable"]
    assert len(store._parked) == 1
    assert client.get_semaphore(f"{ns}s").used == 0


def test_a_connection_parked_long_ago_goes_back_to_the_pool_unused(
    make_client: Callable[..., Any], ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One left idle past PARK_SECONDS goes through the pool's checks before it is used again."""
    client = _opened(make_client, ns)
    store = _store(client)
    _cycle(client, f"{ns}s")
    (parked,) = store._parked
    parked.since -= sync_store.PARK_SECONDS
    traffic = _PoolTraffic(store)
    module = async_store if isinstance(client, AsyncFacade) else sync_store
    attribute = _sender_name(store)
    send = getattr(module, attribute)
    checked_out_before: list[int] = []  # at each statement, how many checkouts the pool had seen

    if isinstance(client, AsyncFacade):

        async def counted_async(*args: Any, **kwargs: Any) -> Any:
            checked_out_before.append(traffic.checkouts)
            return await send(*args, **kwargs)

        monkeypatch.setattr(module, attribute, counted_async)
    else:

        def counted(*args: Any, **kwargs: Any) -> Any:
            checked_out_before.append(traffic.checkouts)
            return send(*args, **kwargs)

        monkeypatch.setattr(module, attribute, counted)
    _cycle(client, f"{ns}s")
    assert checked_out_before == [1, 1]  # through the pool before the grant, then parked for the release
    assert len(store._parked) == 1


def _small_pool(monkeypatch: pytest.MonkeyPatch, **pool: Any) -> None:
    """The sync store's next pools get these options (``pool_size``, ``max_overflow``, ``pool_timeout``)."""
    real_args = sync_store.engine_args

    def sized(*args: Any, **kwargs: Any) -> Any:
        url, options = real_args(*args, **kwargs)
        return url, {**options, **pool}

    monkeypatch.setattr(sync_store, "engine_args", sized)


def _slow_in_threads_named(
    monkeypatch: pytest.MonkeyPatch, store: Any, prefix: str, seconds: float
) -> threading.Semaphore:
    """The sync store's statements that run alone take ``seconds`` longer in threads named ``prefix...``,
    holding their connection. Each such statement releases the semaphore returned as it starts to wait."""
    attribute = _sender_name(store)
    send = getattr(sync_store, attribute)
    started = threading.Semaphore(0)

    def slow_for_some(driver: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name.startswith(prefix):
            started.release()
            time.sleep(seconds)
        return send(driver, *args, **kwargs)

    monkeypatch.setattr(sync_store, attribute, slow_for_some)
    return started


@pytest.mark.parametrize("flavour", ["sync"])
def test_no_connection_free_in_time_is_a_typed_error_that_wrote_nothing(
    make_client: Callable[..., Any], ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every connection the pool may open is busy past its timeout: StorageUnavailable (a code that crosses
    HTTP), not SQLAlchemy's own TimeoutError, and the request was never sent."""
    _small_pool(monkeypatch, pool_size=1, max_overflow=0, pool_timeout=0.3)
    client = _opened(make_client, ns)
    client.create_semaphore(f"{ns}t", 1)
    store = _store(client)
    _call(client, store._unpark_into_pool)
    started = _slow_in_threads_named(monkeypatch, store, "slow", 1.5)
    holder = threading.Thread(target=_cycle, args=(client, f"{ns}s"), name="slow")
    holder.start()
    assert started.acquire(timeout=30)  # the slow grant holds the pool's one connection
    # try_acquire: a waiting acquire would wait for a connection, as for room, within its timeout.
    with pytest.raises(permits.StorageUnavailable, match=r"came free within 0\.3 s") as caught:
        client.try_acquire(f"{ns}t", key="k", ttl=30)
    holder.join(timeout=30)
    assert caught.value.code == "storage_unavailable"
    assert client.get_semaphore(f"{ns}t").used == 0
    assert client.holders(f"{ns}t") == []


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_a_full_pool_holds_an_acquire_no_longer_than_its_deadline_and_grace(
    make_client: Callable[..., Any], ns: str
) -> None:
    """Every connection of the client's pool (its default size) checked out elsewhere and kept: on both
    clients, ``acquire(timeout=0.5)`` gives up within its deadline and the store's grace, where it waited
    the pool's 30 s before; and the pool takes its connections back as before."""
    client = make_client(owner=f"{ns}o", lock_wait_timeout=0.5)
    client.create_semaphore(f"{ns}t", 1)
    store = _store(client)
    _call(client, store._unpark_into_pool)
    engine = store._engine
    free = engine.pool.size() + engine.pool._max_overflow - engine.pool.checkedout()

    async def check_out_async() -> list[Any]:
        return [await engine.connect().start() for _ in range(free)]

    async def give_back_async(held: list[Any]) -> None:
        for conn in held:
            await conn.close()

    flavour_is_async = hasattr(engine, "sync_engine")
    held = client._call(check_out_async()) if flavour_is_async else [engine.connect() for _ in range(free)]
    try:
        began = time.monotonic()
        with pytest.raises(permits.StorageUnavailable) as caught:
            client.acquire(f"{ns}t", key="k", ttl=30, timeout=0.5)
        took = time.monotonic() - began
        assert 5.5 <= took < 8.5, took  # deadline 0.5 s, then the grace: a lock wait (0.5 s) and 5 s
        said = re.search(r"came free within ([\d.]+) s", str(caught.value))
        assert said is not None and 5.0 <= float(said.group(1)) <= 6.0, caught.value  # the wait, not 30 s
    finally:
        if flavour_is_async:
            client._call(give_back_async(held))
        else:
            for conn in held:
                conn.close()
    assert client.get_semaphore(f"{ns}t").used == 0  # nothing was sent
    lease = client.acquire(f"{ns}t", key="k", ttl=30, timeout=5)  # the connections back, the pool serves again
    assert client.release(lease) is permits.ReleaseOutcome.RELEASED


@pytest.mark.parametrize("flavour", ["sync"])  # threads, on the sync store (the tasks' twin is below)
def test_a_small_pool_is_not_kept_waiting_by_parked_connections(
    make_client: Callable[..., Any], ns: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool that may open two connections (a service's db_pool_size=1): while two slow grants hold both,
    a third waits in the pool; when they end, their connections go back to the pool for it rather than
    into their parking places."""
    _small_pool(monkeypatch, pool_size=1, max_overflow=1, pool_timeout=5)
    client = _opened(make_client, ns)
    client.create_semaphore(f"{ns}t", 2)
    store = _store(client)
    _call(client, store._unpark_into_pool)
    started = _slow_in_threads_named(monkeypatch, store, "slow", 1.0)
    outcomes: dict[str, Any] = {}

    def grant(name: str) -> None:
        began = time.monotonic()
        try:
            client.acquire(name, ttl=30, timeout=20)
            outcomes[threading.current_thread().name] = time.monotonic() - began
        except BaseException as exc:  # reported below
            outcomes[threading.current_thread().name] = exc

    slow = [threading.Thread(target=grant, args=(f"{ns}s",), name=f"slow{i}") for i in range(2)]
    for thread in slow:
        thread.start()
    assert started.acquire(timeout=30) and started.acquire(timeout=30)  # both slow grants hold a connection
    third = threading.Thread(target=grant, args=(f"{ns}t",), name="third")
    third.start()
    for thread in [*slow, third]:
        thread.join(timeout=60)
    assert all(isinstance(outcome, float) for outcome in outcomes.values()), outcomes
    assert outcomes["third"] < 4, outcomes  # it waited for a slow grant to end, not for the pool's timeout
    assert len(store._parked) <= 1  # never the whole pool


@pytest.mark.parametrize("flavour", ["sync"])
def test_close_in_a_forked_child_leaves_the_parents_connections_alone(make_client: Callable[..., Any], ns: str) -> None:
    """A child that closes the client it inherited (a with block, an atexit hook) must not end the
    parent's sessions, parked or pooled, over the sockets both hold."""
    client = _opened(make_client, ns)
    store = _store(client)
    _cycle(client, f"{ns}s")
    (parked,) = store._parked
    faults: list[str] = []
    store.on_retry = faults.append
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        try:
            client.close()
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    _cycle(client, f"{ns}s")
    assert faults == []
    assert [p.driver for p in store._parked] == [parked.driver]


def test_a_connection_goes_back_through_the_pool_once_it_has_been_out_long_enough(
    make_client: Callable[..., Any], ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = _opened(make_client, ns)
    store = _store(client)
    _cycle(client, f"{ns}s")
    monkeypatch.setattr(sync_store, "PARK_SECONDS", 0.0)
    monkeypatch.setattr(async_store, "PARK_SECONDS", 0.0)
    _call(client, store._unpark_into_pool)  # the one parked before
    traffic = _PoolTraffic(store)
    for _ in range(3):
        _cycle(client, f"{ns}s")
        assert store._parked == []
    assert traffic.checkouts == 6  # every statement through the pool, where its checks apply


def test_close_gives_the_parked_connections_back(make_client: Callable[..., Any], ns: str) -> None:
    client = _opened(make_client, ns)
    store = _store(client)
    _cycle(client, f"{ns}s")
    assert store._parked != []
    client.close()
    assert store._parked == []


def test_threads_sharing_a_client_never_share_a_connection(db_url: str, ns: str) -> None:
    with permits.connect(db_url, owner=f"{ns}o") as client:
        client.create_semaphore(f"{ns}s", 2)
        store = client._store
        overlaps = _SendWatch(store, sync_store)
        tokens: list[int] = []
        errors: list[BaseException] = []
        guard = threading.Lock()

        def work() -> None:
            try:
                for _ in range(15):
                    token = _cycle(client, f"{ns}s")
                    with guard:
                        tokens.append(token)
            except BaseException as exc:  # reported below
                errors.append(exc)

        try:
            threads = [threading.Thread(target=work) for _ in range(6)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
        finally:
            overlaps.undo()
        assert errors == []
        assert overlaps.shared == [], "two threads sent statements on one connection at once"
        assert len(tokens) == len(set(tokens)) == 90
        assert client.get_semaphore(f"{ns}s").used == 0
        assert 1 <= len(store._parked) <= sync_store.PARKED_AT_MOST


def test_tasks_sharing_a_client_never_share_a_connection(db_url: str, ns: str) -> None:
    async def main() -> tuple[list[int], Any]:
        async with permits.connect_async(db_url, owner=f"{ns}o") as client:
            await client.create_semaphore(f"{ns}s", 2)
            store = client._store
            overlaps = _SendWatch(store, async_store)

            async def work() -> list[int]:
                tokens = []
                for _ in range(15):
                    lease = await client.acquire(f"{ns}s", ttl=30, timeout=20)
                    tokens.append(lease.token)
                    await client.release(lease)
                return tokens

            try:
                done = await asyncio.gather(*(work() for _ in range(6)))
            finally:
                overlaps.undo()
            assert (await client.get_semaphore(f"{ns}s")).used == 0
            assert 1 <= len(store._parked) <= async_store.PARKED_AT_MOST
            return [token for tokens in done for token in tokens], overlaps

    tokens, overlaps = asyncio.run(main())
    assert overlaps.shared == [], "two tasks sent statements on one connection at once"
    assert len(tokens) == len(set(tokens)) == 90


class _SendWatch:
    """Replace a store module's senders of statements that run alone with ones that note a driver connection
    that two senders use at once."""

    def __init__(self, store: Any, module: Any) -> None:
        self.shared: list[int] = []
        self._module = module
        self._attribute = _sender_name(store)
        self._send = send = getattr(module, self._attribute)
        in_flight: set[int] = set()

        def note(driver: Any) -> None:
            if id(driver) in in_flight:
                self.shared.append(id(driver))
            in_flight.add(id(driver))

        if asyncio.iscoroutinefunction(send):

            async def watched_async(driver: Any, *args: Any, **kwargs: Any) -> Any:
                note(driver)
                try:
                    return await send(driver, *args, **kwargs)
                finally:
                    in_flight.discard(id(driver))

            setattr(module, self._attribute, watched_async)
        else:
            guard = threading.Lock()

            def watched(driver: Any, *args: Any, **kwargs: Any) -> Any:
                with guard:
                    note(driver)
                try:
                    return send(driver, *args, **kwargs)
                finally:
                    with guard:
                        in_flight.discard(id(driver))

            setattr(module, self._attribute, watched)

    def undo(self) -> None:
        setattr(self._module, self._attribute, self._send)
