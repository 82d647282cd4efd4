"""A client closed while another thread (or task) is still at work in it: that work finishes as it would
have, a waiting acquire is told the client is closed, and once they are done the client holds no
connection to the database. SQLAlchemy's ``dispose()`` alone would leave each connection that was checked
out at close in a pool nobody disposes (closed only when the garbage collector finds it), and would open
new ones for an operation that goes on after it."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
from sqlalchemy import create_engine, event, make_url, text

import permits
from permits.stores._engine import sync_engine
from tests._proxy import CuttingProxy
from tests._tls import TLSFront
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
def _semaphore_row_locked(db_url: str, backend: str, name: str) -> Iterator[Callable[[], None]]:
    """Another transaction holds the semaphore's row (SQLite: the database's write lock) until the block
    calls what it is given, or ends."""
    if backend == "sqlite":
        path = make_url(db_url).database or ""
        with contextlib.closing(sqlite3.connect(path, isolation_level=None, check_same_thread=False)) as raw:
            raw.execute("BEGIN IMMEDIATE")
            yield raw.rollback
        return
    engine = create_engine(sqlalchemy_url(db_url))
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1 FROM permits_semaphore WHERE name = :n FOR UPDATE"), {"n": name})
            yield conn.rollback
    finally:
        engine.dispose()


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def _on_wait_for_room(client: Any) -> threading.Event:
    """Set when the client's acquire, refused, begins to wait for room (its store's ``wait_for_room``)."""
    store = client._client._store if isinstance(client, AsyncFacade) else client._store
    waiting = threading.Event()
    wait = store.wait_for_room
    if asyncio.iscoroutinefunction(wait):

        async def noted_async(*args: Any) -> Any:
            waiting.set()
            return await wait(*args)

        store.wait_for_room = noted_async
    else:

        def noted(*args: Any) -> Any:
            waiting.set()
            return wait(*args)

        store.wait_for_room = noted
    return waiting


def test_an_operation_in_flight_at_close_finishes_and_leaves_no_connection(
    make_client: Callable[..., Any], db_url: str, backend: str, ns: str
) -> None:
    client = make_client(owner=f"{ns}o")
    store = _store(client)
    opened = _OpenConnections(store)  # before the client's first connection
    client.create_semaphore(f"{ns}s", 2)
    with _semaphore_row_locked(db_url, backend, f"{ns}s") as let_go:
        thread, outcome = in_thread(lambda: client.acquire({f"{ns}s": 1}, key="k", timeout=20))
        _wait_until(lambda: store.connections_in_use >= 1, "the grant has a connection, and waits for the row")
        client.close()
        let_go()
        thread.join(30)
    assert not thread.is_alive()
    assert "error" not in outcome, outcome
    assert outcome["value"].key == "k"  # the grant went through: close() does not cut work short
    assert opened.still_open == 0


def test_a_waiting_acquire_is_told_the_client_is_closed(make_client: Callable[..., Any], ns: str) -> None:
    holder = make_client(owner=f"{ns}holder")
    holder.create_semaphore(f"{ns}s", 1)
    holder.acquire({f"{ns}s": 1}, key="held")
    client = make_client(owner=f"{ns}o")
    opened = _OpenConnections(_store(client))  # before the client's first connection
    waiting = _on_wait_for_room(client)
    thread, outcome = in_thread(lambda: client.acquire({f"{ns}s": 1}, key="k", timeout=20))
    assert waiting.wait(20)
    closed_at = time.monotonic()
    client.close()
    thread.join(30)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), permits.UsageError), outcome
    assert time.monotonic() - closed_at < 10  # told at its next look, not at the end of its timeout
    assert opened.still_open == 0


def _http_store(client: Any) -> Any:
    return client._client._store if isinstance(client, AsyncFacade) else client._store


@pytest.mark.parametrize("via", ["service"])
def test_a_long_poll_through_the_service_ends_at_close(make_client: Callable[..., Any], ns: str) -> None:
    """Through a service, a waiting acquire is a long poll: close() ends it at once (UsageError), and the
    service, seeing its client go, stops waiting and gives up its place in the queue. Before, the poll ran
    to the end of its wait (20 s here), and then its resend failed with httpx's RuntimeError."""
    name = f"{ns}s"
    holder = make_client(owner=f"{ns}holder")
    client = make_client(owner=f"{ns}o")
    store = _http_store(client)
    _close_while_an_acquire_waits(holder, client, name)
    holder.release("held")
    assert holder.get_semaphore(name).used == 0  # nothing was granted to the closed client
    assert store._long_polls.http.is_closed and store._requests.http.is_closed


def _close_while_an_acquire_waits(holder: Any, client: Any, name: str) -> None:
    """``client`` closed while its acquire waits in the service's queue for a fair semaphore that
    ``holder`` fills: the acquire gets UsageError at once, and the service stops waiting for it."""
    holder.create_semaphore(name, 1, fair=True)
    holder.acquire({name: 1}, key="held")
    thread, outcome = in_thread(lambda: client.acquire({name: 1}, key="k", timeout=20))
    _wait_until(lambda: len(holder.waiters(name)) == 1, "the acquire waits in the service's queue")
    closed_at = time.monotonic()
    client.close()
    thread.join(30)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), permits.UsageError), outcome
    assert time.monotonic() - closed_at < 5  # at once, not at the end of the long poll
    _wait_until(lambda: holder.waiters(name) == [], "the service stops waiting for a client that went")


@pytest.mark.parametrize("via", ["service"])
@pytest.mark.parametrize("resent", [False, True], ids=["answered", "resent"])
def test_a_request_under_way_through_the_service_at_close_finishes(
    client_url: str, db_url: str, backend: str, ns: str, flavour: str, resent: bool
) -> None:
    """A request that does not wait for room, under way at close(), gets its answer (a release here, held
    up by a locked row on the service's side), and may still send again: ``resent``, its connection drops
    after close() (cut by a proxy in front of the service), and it is sent again and answered. The client's
    connections close once it is done."""
    name = f"{ns}s"
    service = make_url(client_url)
    assert service.host is not None and service.port is not None
    with CuttingProxy((service.host, service.port)) as proxy:
        client = _open(flavour, f"http://127.0.0.1:{proxy.port}", f"{ns}o")
        try:
            store = _http_store(client)
            client.create_semaphore(name, 1)
            client.acquire({name: 1}, key="k")
            with _semaphore_row_locked(db_url, backend, name) as let_go:
                thread, outcome = in_thread(lambda: client.release("k"))
                _wait_until(lambda: store._requests._under_way == 1, "the release is under way")
                client.close()
                assert not store._requests.http.is_closed  # not while the release is under way
                with pytest.raises(permits.UsageError):
                    client.get_semaphore(name)  # a new request is refused, though
                if resent:
                    proxy.cut_all()  # its reply will never come: the release is sent again, after close()
                    time.sleep(0.5)  # the resend reaches the service, and waits for the row as the first does
                let_go()
                thread.join(30)
            assert not thread.is_alive()
            released, already = permits.ReleaseOutcome.RELEASED, permits.ReleaseOutcome.ALREADY_RELEASED
            # resent: the first send may have released it before the resend came
            assert outcome.get("value") in ({released, already} if resent else {released}), outcome
            assert store._requests.http.is_closed
        finally:
            _shut(client)


def _open(flavour: str, url: str, owner: str) -> Any:
    """A client of ``url`` of its own (the fixture's clients are of the service itself)."""
    if flavour == "sync":
        return permits.connect(url, owner=owner)
    return AsyncFacade(permits.connect_async(url, owner=owner))


def _shut(client: Any) -> None:
    if isinstance(client, AsyncFacade):
        client.shutdown()
    else:
        client.close()


@pytest.mark.parametrize("via", ["service"])
@pytest.mark.parametrize("backend", ["sqlite"])  # the client's TLS is the point, not the database
def test_a_long_poll_over_tls_ends_at_close(
    client_url: str, flavour: str, ns: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same cut on a TLS connection: the socket is shut down under the TLS layer, which the thread
    reading through it still holds (shutting the TLS socket itself down would drop that state under it)."""
    service = make_url(client_url)
    assert service.host is not None and service.port is not None
    ca = trustme.CA()
    front = TLSFront((service.host, service.port), ca.issue_cert("127.0.0.1"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))  # read as the client is made: trusts the front
    url = f"https://127.0.0.1:{front.port}"
    name = f"{ns}s"
    holder = _open(flavour, url, f"{ns}holder")
    client = _open(flavour, url, f"{ns}o")
    try:
        _close_while_an_acquire_waits(holder, client, name)
    finally:
        _shut(client)
        _shut(holder)
        front.close()


def test_keepalive_on_a_closed_client_is_refused_at_once(make_client: Callable[..., Any], ns: str) -> None:
    """Not a watchdog whose first extend, a ttl/3 later, finds the client closed and reports a lease lost
    that is still held."""
    client = make_client(owner=f"{ns}o")
    client.create_semaphore(f"{ns}s", 1)
    lease = client.acquire(f"{ns}s", ttl=30)
    client.close()
    with pytest.raises(permits.UsageError, match="closed"):
        client.keepalive(lease)
    other = make_client(owner=f"{ns}o")
    assert other.release(lease) is permits.ReleaseOutcome.RELEASED
