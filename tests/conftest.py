"""Real databases for every test: SQLite files, and a fresh database per test session on the MariaDB and
PostgreSQL servers (dropped at the end), so runs never see each other's rows.

Server URLs: $PERMITS_TEST_MYSQL_URL (default mysql://root@127.0.0.1:3306/test) and
$PERMITS_TEST_POSTGRESQL_URL (default postgresql://postgres@127.0.0.1:5432/test); only their server part
is used. An unreachable server fails the run when CI=true, and skips its tests otherwise (scripts/test
starts or installs the servers first).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

import pymysql
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, make_url

import permits

SERVER_URLS = {
    "mysql": os.environ.get("PERMITS_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test"),
    "postgresql": os.environ.get("PERMITS_TEST_POSTGRESQL_URL", "postgresql://postgres@127.0.0.1:5432/test"),
}
BACKENDS = ["sqlite", "mysql", "postgresql"]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
#: PERMITS_THOROUGH=1: the few tests that sample a space of faults (every byte at which a connection can be
#: cut, rounds of a stall) sample it densely, as before a release; by default they take a sparser sample,
#: to keep the whole run short.
THOROUGH = os.environ.get("PERMITS_THOROUGH", "").lower() in ("1", "true", "yes")
_SESSION_DB = f"permits_t_{os.getpid()}_{uuid.uuid4().hex[:6]}"
# A test run started in the background by a shell without job control (``./.ci/run &``, a CI runner's
# script) inherits SIGINT ignored, and passes that on to every process it starts; ``permits run``, as
# Python itself and as nohup's commands do, leaves an ignored signal ignored. The tests that stop a
# ``permits run`` by a signal model one started from a terminal or by a supervisor: the signals it is
# sent are not ignored there, so not here either (a handler is reset to the default action at exec).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
for _stop in (signal.SIGTERM, signal.SIGHUP):
    if signal.getsignal(_stop) is signal.SIG_IGN:
        signal.signal(_stop, signal.SIG_DFL)

#: Test directories whose tests need the machine to themselves: they start many processes and time them,
#: kill servers, measure throughput, or change a shared server's global settings (the isolation level).
#: They are marked ``alone``; scripts/test runs the other tests in parallel workers first, then these. A
#: test elsewhere that needs the same is marked ``@pytest.mark.alone`` itself; one in these directories
#: that does not (its faults are its own, and its bounds wide) is marked ``beside_others``.
ALONE = frozenset({"bench", "concurrency", "faults", "poolers", "scaleout"})


def sqlalchemy_url(db_url: str) -> str:
    """A permits database URL with the sync drivers named, for a test's own SQLAlchemy engine (to look at or
    damage the tables behind permits' back). A URL that names its driver already is returned as it is."""
    for plain, named in (("mysql://", "mysql+pymysql://"), ("postgresql://", "postgresql+psycopg://")):
        if db_url.startswith(plain):
            return named + db_url.removeprefix(plain)
    return db_url


def mariadb_session(db_url: str, **options: Any) -> pymysql.Connection[Any]:
    """A PyMySQL session of a test's own on the MariaDB database behind ``db_url`` (with or without the driver
    named), to hold locks or look at the server behind permits' back; ``options`` go to ``pymysql.connect``."""
    url = make_url(db_url)
    return pymysql.connect(
        host=url.host,
        port=url.port or 3306,
        user=url.username,
        password=url.password or "",
        database=url.database,
        **options,
    )


def _admin_url(backend: str) -> URL:
    url = make_url(SERVER_URLS[backend])
    driver = "pymysql" if backend == "mysql" else "psycopg"
    return url.set(drivername=f"{backend}+{driver}")


@contextlib.contextmanager
def own_database(backend: str, prefix: str) -> Iterator[str]:
    """A URL (with its password, if any) to an empty database of the caller's own on a server, dropped
    afterwards: for tests that create their own schema, or must not share their rows with other tests."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(_admin_url(backend), isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5})
    try:
        with admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE {name}"))
    except Exception as exc:  # any failure to reach the server
        admin.dispose()
        if IN_CI:
            pytest.fail(f"{backend} unreachable: {exc}", pytrace=False)
        pytest.skip(f"{backend} unreachable: {exc}")
    try:
        yield _admin_url(backend).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            force = " WITH (FORCE)" if backend == "postgresql" else ""
            conn.execute(text(f"DROP DATABASE IF EXISTS {name}{force}"))
        admin.dispose()


@contextlib.contextmanager
def temporary_role(url: str, prefix: str, grants: Sequence[str]) -> Iterator[str]:
    """A login role on the PostgreSQL server of ``url``, given ``grants`` (statements with ``{role}``) in its
    database, dropped with everything it owns at the end: the URL of ``url``'s database as that role."""
    role = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = create_engine(_admin_url("postgresql"), isolation_level="AUTOCOMMIT")
    inside = create_engine(sqlalchemy_url(url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE ROLE {role} LOGIN"))
    try:
        with inside.connect() as conn:
            for grant in grants:
                conn.execute(text(grant.format(role=role)))
        # Not kept in the pool: a test that waits for the database's other sessions to end (function_calls)
        # would wait for this one.
        inside.dispose()
        yield make_url(url).set(username=role).render_as_string(hide_password=False)
    finally:
        with inside.connect() as conn:
            conn.execute(text(f"DROP OWNED BY {role}"))
        inside.dispose()
        with admin.connect() as conn:
            conn.execute(text(f"DROP ROLE {role}"))
        admin.dispose()


def count_function_calls(url: str) -> None:
    """Have PostgreSQL count calls of PL/pgSQL functions in the database of ``url`` (``track_functions``,
    for sessions that start from now on); see ``called_functions``."""
    database = make_url(url).database
    admin = create_engine(_admin_url("postgresql"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"ALTER DATABASE {database} SET track_functions = 'pl'"))
    admin.dispose()


def called_functions(url: str, within: float = 15.0, at_least: int = 2) -> set[str]:
    """Which of permits' server functions (dialects/pg_functions.py) sessions counted by
    ``count_function_calls`` have called, by their statement (``acquire_one``, ``release``,
    ``acquire_one_queued``). A session reports its counts at most once a second, or after 10 s idle: this
    waits until ``at_least`` were called, or ``within`` seconds."""
    engine = create_engine(sqlalchemy_url(url.split("?")[0]))
    deadline = time.monotonic() + within
    try:
        while True:
            with engine.connect() as conn:
                names = conn.execute(
                    text("SELECT funcname FROM pg_stat_user_functions WHERE calls > 0 AND funcname LIKE 'permits_%'")
                ).scalars()
                called = {name.removeprefix("permits_").rsplit("_", 1)[0] for name in names}
            if len(called) >= at_least or time.monotonic() > deadline:
                return called
            time.sleep(0.5)
    finally:
        engine.dispose()


def function_calls(url: str, within: float = 15.0) -> dict[str, int]:
    """How many times sessions counted by ``count_function_calls`` called each of permits' server functions,
    by their statement (``acquire_one_queued``, say). A session reports its counts as it exits, which may be
    a little after its client closed: this waits (up to ``within``) until no other session is connected."""
    engine = create_engine(sqlalchemy_url(url.split("?")[0]))
    deadline = time.monotonic() + within
    try:
        with engine.connect() as conn:
            while time.monotonic() < deadline:
                others = conn.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                ).scalar_one()
                conn.rollback()
                if others == 0:
                    break
                time.sleep(0.2)
            conn.execute(text("SELECT pg_stat_clear_snapshot()"))
            rows = conn.execute(
                text("SELECT funcname, calls FROM pg_stat_user_functions WHERE funcname LIKE 'permits_%'")
            ).all()
    finally:
        engine.dispose()
    counts: dict[str, int] = {}
    for name, calls in rows:
        statement = name.removeprefix("permits_").rsplit("_", 1)[0]
        counts[statement] = counts.get(statement, 0) + int(calls)
    return counts


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    alone = pytest.mark.alone
    tests_dir = config.rootpath / "tests"
    for item in items:
        parts = item.path.relative_to(tests_dir).parts if item.path.is_relative_to(tests_dir) else ()
        if parts and parts[0] in ALONE and item.get_closest_marker("beside_others") is None:
            item.add_marker(alone)
    # In the parallel workers (scripts/test), the long tests first, in their files' order otherwise: the
    # workers are handed tests in this order, so the longest start early and the last to run are short. In
    # files' order, a 70 s model run or a 40 s outage test begun near the end kept the other workers idle
    # for minutes. Only there: run one at a time, a file's tests stay together, as its fixtures expect.
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


class _Servers:
    """Creates one database per server on first use, and drops them all at the end of the session."""

    def __init__(self) -> None:
        self.created: dict[str, URL] = {}
        self.failed: dict[str, str] = {}

    def url_for(self, backend: str) -> URL:
        if backend in self.created:
            return self.created[backend]
        if backend in self.failed:
            self._unreachable(backend, self.failed[backend])
        admin = _admin_url(backend)
        try:
            engine = create_engine(admin, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5})
            with engine.connect() as conn:
                conn.execute(text(f"CREATE DATABASE {_SESSION_DB}"))
            engine.dispose()
        except Exception as exc:  # any failure to reach or use the server
            self.failed[backend] = str(exc).splitlines()[0]
            self._unreachable(backend, self.failed[backend])
        url = make_url(SERVER_URLS[backend]).set(database=_SESSION_DB)
        with permits.connect(url, auto_upgrade=True) as client:
            client.list_semaphores()  # creates the schema
        self.created[backend] = url
        return url

    def _unreachable(self, backend: str, why: str) -> None:
        message = f"{backend} server unreachable at {_admin_url(backend).render_as_string()}: {why}"
        if IN_CI:
            pytest.fail(message + " (CI=true: a missing database is a failure)", pytrace=False)
        pytest.skip(message + " (run scripts/ensure-databases)")

    def drop_all(self) -> None:
        for backend in self.created:
            engine = create_engine(_admin_url(backend), isolation_level="AUTOCOMMIT")
            with engine.connect() as conn:
                if backend == "postgresql":
                    conn.execute(text(f"DROP DATABASE IF EXISTS {_SESSION_DB} WITH (FORCE)"))
                else:
                    conn.execute(text(f"DROP DATABASE IF EXISTS {_SESSION_DB}"))
            engine.dispose()


@pytest.fixture(scope="session")
def servers() -> Iterator[_Servers]:
    holder = _Servers()
    yield holder
    holder.drop_all()


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'permits.db'}"


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def db_url(backend: str, servers: _Servers, sqlite_url: str) -> str:
    """A URL (with its password, if any) to a database with the current schema."""
    if backend == "sqlite":
        return sqlite_url
    return servers.url_for(backend).render_as_string(hide_password=False)


@pytest.fixture
def ns() -> str:
    """A prefix that keeps one test's semaphores apart from every other test's on a shared database."""
    return f"t{uuid.uuid4().hex[:10]}-"


@pytest.fixture
def slow_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiters that poll only every 10-20 s (a fair queue's: every 20 s), once refused. A test that a
    waiter hears of room (a release, a call when its turn comes) can then bound how soon it is granted
    loosely, a second or more, and still tell hearing from polling: with the default one-second cap a
    tight bound would race the scheduler, and lose now and then under CI's parallel tests."""
    from permits import _pacing
    from permits._async import client as async_client
    from permits._async import store as async_store
    from permits._backoff import Backoff
    from permits._sync import client as sync_client
    from permits._sync import store as sync_store

    monkeypatch.setattr(_pacing, "WAIT_BACKOFF", Backoff(base=20.0, cap=20.0))
    monkeypatch.setattr(_pacing, "QUEUE_MAX_SLEEP", 20.0)
    for client_module, store_module in ((sync_client, sync_store), (async_client, async_store)):
        monkeypatch.setattr(client_module, "CALLED_MAX_SLEEP", 20.0)
        # A place in a fair queue lapses unless an attempt renews it: it must outlive the slower polls.
        monkeypatch.setattr(store_module, "PLACE_MS", 60_000)


def in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Start ``work`` on a thread of its own; the dict gets its ``value``, or the ``error`` it raised."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # the test reads it
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


class AsyncFacade:
    """Drives an AsyncClient from synchronous test code, so one test body checks both clients.

    The coroutines run on an event loop in a thread of their own; ``lease``/``mutex`` return context
    managers that enter and exit the async ones on that loop.
    """

    def __init__(self, client: permits.AsyncClient) -> None:
        self._client = client
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name in ("lease", "mutex"):
            return lambda *a, **kw: _AsyncCM(self, attr(*a, **kw))
        if asyncio.iscoroutinefunction(attr):
            return lambda *a, **kw: self._call(attr(*a, **kw))
        return attr

    def close(self) -> None:
        self._call(self._client.aclose())

    def shutdown(self) -> None:
        self.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


class _AsyncCM:
    def __init__(self, facade: AsyncFacade, cm: permits.AsyncHeld) -> None:
        self._facade = facade
        self._cm = cm

    def __enter__(self) -> permits.Lease:
        lease: permits.Lease = self._facade._call(self._cm.__aenter__())
        return lease

    def __exit__(self, *exc: Any) -> None:
        self._facade._call(self._cm.__aexit__(*exc))


@pytest.fixture(params=["sync", "async"])
def flavour(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_client(db_url: str, flavour: str) -> Iterator[Callable[..., Any]]:
    """Open clients of the current flavour (sync or async) on the current backend; closed at the end."""
    opened: list[Any] = []

    def make(**options: Any) -> Any:
        client: Any
        if flavour == "sync":
            client = permits.connect(db_url, **options)
        else:
            client = AsyncFacade(permits.connect_async(db_url, **options))
        opened.append(client)
        return client

    yield make
    for client in opened:
        client.shutdown() if isinstance(client, AsyncFacade) else client.close()


@pytest.fixture
def client(make_client: Callable[..., Any]) -> Any:
    return make_client()
