"""permits through a real PgBouncer (Debian's, 1.18), in session and in transaction mode.

A pooler changes what a connection is: behind a transaction pooler, consecutive transactions of one client
connection run on different server connections, so nothing of a session survives from one to the next
(prepared statements, settings, LISTEN); and PgBouncer before 1.20 refuses the ``options`` startup
parameter that carries permits' session settings. The URL's ``pooler`` parameter tells permits which kind
stands in front (docs/deployment.md, "Poolers"). The transaction pools here have three server connections,
handed out in turn, so that consecutive transactions of one client run on different ones (tests/_pgbouncer.py).
"""

from __future__ import annotations

import contextlib
import logging
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, make_url, text

import permits
from permits.dialects import postgresql
from permits.dialects.pg_functions import DIRECT_FUNCTIONS, server_functions
from permits.dialects.postgresql import PostgreSQL
from tests._pgbouncer import PgBouncer, pgbouncer_version
from tests._service import running
from tests.concurrency.test_many_processes import run_and_check
from tests.conftest import (
    SERVER_URLS,
    AsyncFacade,
    _admin_url,
    called_functions,
    count_function_calls,
    own_database,
    sqlalchemy_url,
    temporary_role,
)

pytestmark = pytest.mark.usefixtures("servers")
SESSION_POOL = 10


@pytest.fixture(scope="module")
def pool_db() -> Iterator[str]:
    """A database of this module's own on the shared server (its settings are changed below), with the
    current schema, made directly."""
    name = f"permits_pool_{uuid.uuid4().hex[:8]}"
    admin = create_engine(_admin_url("postgresql"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    try:
        with permits.connect(direct_url(name), auto_upgrade=True) as client:
            client.list_semaphores()
        yield name
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


def direct_url(database: str) -> str:
    base = SERVER_URLS["postgresql"]
    return base[: base.rindex("/") + 1] + database


@pytest.fixture(params=["session", "transaction"])
def bouncer(request: pytest.FixtureRequest) -> Iterator[PgBouncer]:
    # A session pooler gives each client connection a server connection of its own for its life: a client
    # needs one for its pool, one more for each thread that works at once, and one for its LISTEN.
    mode = str(request.param)
    with PgBouncer(mode, pool_size=SESSION_POOL if mode == "session" else 3) as running_bouncer:
        yield running_bouncer


def _exercise(client: Any, ns: str) -> None:
    """What a user does, through the pooler: every kind of statement permits sends."""
    client.create_semaphore(f"{ns}plain", 2)
    client.create_semaphore(f"{ns}fair", 1, fair=True)
    first = client.try_acquire(f"{ns}plain", key=f"{ns}job-1")
    assert first is not None and first.tokens == {f"{ns}plain": 1}
    again = client.try_acquire(f"{ns}plain", key=f"{ns}job-1")  # a retry of a granted key: the same grant
    assert again is not None and (again.tokens, again.expires_at) == (first.tokens, first.expires_at)
    both = client.acquire({f"{ns}plain": 1, f"{ns}fair": 1}, key=f"{ns}job-2", timeout=5)
    assert client.try_acquire(f"{ns}plain") is None
    extended = client.extend(both, ttl=120)
    assert extended.expires_at > both.expires_at
    # A waiter behind a full semaphore gets the permit that another thread gives back (by polling: no
    # LISTEN behind a transaction pooler).
    threading.Timer(0.3, client.release, args=(first,)).start()
    started = time.monotonic()
    waited = client.acquire(f"{ns}plain", key=f"{ns}job-3", timeout=10)
    assert 0.2 < time.monotonic() - started < 10
    assert waited.tokens[f"{ns}plain"] == 3
    # A fair queue: the waiter gets the permit when it comes back.
    threading.Timer(0.3, client.release, args=(both,)).start()
    assert client.acquire(f"{ns}fair", key=f"{ns}job-4", timeout=10).tokens == {f"{ns}fair": 2}
    client.set_capacity(f"{ns}plain", 3, reason="through a pooler")
    semaphore = client.get_semaphore(f"{ns}plain")
    assert (semaphore.capacity, semaphore.used, semaphore.last_token) == (3, 1, 3)
    assert [h.key for h in client.holders(f"{ns}plain")] == [f"{ns}job-3"]
    assert {s.name for s in client.list_semaphores(prefix=ns)} == {f"{ns}plain", f"{ns}fair"}
    assert str(client.release(waited)) == "released"
    assert client.reconcile() == []


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_every_operation_works_through_a_pooler(bouncer: PgBouncer, pool_db: str, flavour: str, ns: str) -> None:
    url = bouncer.url_for(pool_db, pooler=bouncer.pool_mode)
    client: Any = permits.connect(url) if flavour == "sync" else AsyncFacade(permits.connect_async(url))
    try:
        # The URL shows the parameter as given; the driver never sees it (it would refuse an unknown option,
        # so the operations below would fail).
        assert f"pooler={bouncer.pool_mode}" in client.url
        _exercise(client, ns)
        # The waits above LISTENed in session mode; behind a transaction pooler nothing may (a LISTEN would
        # stay on a server connection that other clients get next).
        listening = _listening_backends(bouncer)
        assert listening > 0 if bouncer.pool_mode == "session" else listening == 0
    finally:
        client.shutdown() if isinstance(client, AsyncFacade) else client.close()


def _listening_backends(bouncer: PgBouncer) -> int:
    """The bouncer's server sessions whose last statement was a listener's (LISTEN, UNLISTEN, the mark)."""
    admin = create_engine(_admin_url("postgresql"))
    try:
        with admin.connect() as conn:
            found = conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = :app"
                    " AND (query ~ '^\\s*(UN)?LISTEN ' OR query ~ '^\\s*WITH stale AS')"
                ),
                {"app": bouncer.application_name},
            ).scalar_one()
    finally:
        admin.dispose()
    return int(found)


@pytest.mark.slow
def test_processes_through_a_transaction_pooler_keep_every_guarantee(pool_db: str, ns: str, tmp_path: Path) -> None:
    """Eight processes share three server connections: capacity holds at every instant, tokens follow grant
    order, every cycle completes (no "prepared statement does not exist"), and nothing drifts."""
    with PgBouncer("transaction") as bouncer:
        pooled = bouncer.url_for(pool_db, pooler="transaction")
        run_and_check(direct_url(pool_db), ns, tmp_path, processes=8, cycles=30, child_urls=[pooled])


def test_the_service_runs_through_a_transaction_pooler(pool_db: str, ns: str) -> None:
    with (
        PgBouncer("transaction") as bouncer,
        running(bouncer.url_for(pool_db, pooler="transaction")) as service,
        permits.connect(service.url) as client,
    ):
        client.create_semaphore(f"{ns}s", 1)
        lease = client.acquire(f"{ns}s", key=f"{ns}k", timeout=5)
        assert client.try_acquire(f"{ns}s") is None
        assert str(client.release(lease)) == "released"
        assert client.reconcile() == []


def test_without_the_parameter_pgbouncer_refuses_permits_session_settings(pool_db: str) -> None:
    """What a user sees who puts PgBouncer before 1.20 in front and does not say so: a clear refusal at
    the first operation, not a silent loss of the settings. A refusal, not an outage: raised at once (a
    ``StorageError``, not ``StorageUnavailable``), so that ``permits run`` does not wait through it."""
    if pgbouncer_version() >= (1, 20):
        pytest.skip("PgBouncer 1.20 and later look inside options, and refuse it with another message")
    with (
        PgBouncer("session", pool_size=SESSION_POOL) as bouncer,
        pytest.raises(permits.StorageError, match="unsupported startup parameter: options") as refused,
        permits.connect(bouncer.url_for(pool_db)) as client,
    ):
        client.list_semaphores()
    assert not isinstance(refused.value, permits.StorageUnavailable)


def _lock_wait_is_bounded(url: str, pool_db: str, ns: str) -> None:
    """A grant that must wait for a semaphore's row, locked by a transaction that does not end, fails after
    the lock timeout instead of waiting for ever: the session settings are in force through the pooler."""
    name = f"{ns}locked"
    with permits.connect(direct_url(pool_db)) as direct:
        direct.create_semaphore(name, 1)
    holder = create_engine(direct_url(pool_db).replace("postgresql://", "postgresql+psycopg://"))
    outcome: list[Any] = []
    with holder.connect() as conn:
        conn.execute(text("SELECT 1 FROM permits_semaphore WHERE name = :n FOR UPDATE"), {"n": name})

        def attempt() -> None:
            with permits.connect(url, lock_wait_timeout=0.3, retries=0) as client:
                try:
                    outcome.append(client.try_acquire(name))
                except permits.PermitsError as exc:
                    outcome.append(exc)

        worker = threading.Thread(target=attempt, daemon=True)
        worker.start()
        worker.join(15)
        waited_for_ever = worker.is_alive()
        conn.rollback()  # lets a waiting grant through, so the thread ends either way
    worker.join(15)
    holder.dispose()
    assert not waited_for_ever, "the grant waited on the locked row past 15 s: no lock timeout in force"
    assert len(outcome) == 1 and isinstance(outcome[0], permits.StorageConflict), outcome


def test_a_session_pooler_gets_permits_session_settings(pool_db: str, ns: str) -> None:
    with PgBouncer("session", pool_size=SESSION_POOL) as bouncer:
        _lock_wait_is_bounded(bouncer.url_for(pool_db, pooler="session"), pool_db, ns)


def test_behind_a_session_pooler_no_server_session_is_taken_for_the_clients(
    pool_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Once a client's link is cut, PgBouncer may hand the server session it used to another client: the
    store must not end it (docs/deployment.md, "Errors that are retried"). PgBouncer answers the handshake
    with a backend id of its own, which the store checks against the session's, and it then notes none."""
    with (
        PgBouncer("session", pool_size=SESSION_POOL) as bouncer,
        caplog.at_level(logging.WARNING, logger="permits"),
        permits.connect(bouncer.url_for(pool_db, pooler="session")) as client,
    ):
        client.list_semaphores()
        assert len(client._store._sessions) == 0
    assert "a pooler or a proxy stands between the client and the server" in caplog.text
    with permits.connect(direct_url(pool_db)) as direct:  # and directly, each connection notes its session
        direct.list_semaphores()
        assert len(direct._store._sessions) >= 1


def test_a_transaction_pooler_warns_until_the_server_sets_the_timeouts(
    pool_db: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """permits cannot make session settings behind a transaction pooler: it says which are missing and the
    statement that sets them; once the server sets them, it is quiet and they are in force."""
    warned = _pooler_warning(pool_db, caplog)
    assert "ALTER ROLE postgres SET idle_in_transaction_session_timeout = '30000ms';" in warned[0]
    assert "ALTER ROLE postgres SET client_connection_check_interval = '1000ms';" in warned[0]  # PostgreSQL 14+

    admin = create_engine(_admin_url("postgresql"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:  # the database's own settings, for every session that opens on it
            conn.execute(text(f"ALTER DATABASE {pool_db} SET lock_timeout = '300ms'"))
            conn.execute(text(f"ALTER DATABASE {pool_db} SET idle_in_transaction_session_timeout = '30s'"))
            conn.execute(text(f"ALTER DATABASE {pool_db} SET client_connection_check_interval = '1s'"))
        caplog.clear()
        with PgBouncer("transaction") as bouncer, caplog.at_level(logging.WARNING, logger="permits"):
            url = bouncer.url_for(pool_db, pooler="transaction")
            with permits.connect(url) as client:
                client.list_semaphores()
            assert not [r for r in caplog.records if "transaction pooler" in r.getMessage()]
            _lock_wait_is_bounded(url, pool_db, ns)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"ALTER DATABASE {pool_db} RESET ALL"))
        admin.dispose()


def test_a_setting_the_server_refuses_is_not_advised(
    pool_db: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server whose platform cannot watch for closed sockets (Windows) refuses any
    client_connection_check_interval but 0: advising it would give a warning that no one can make go away.
    The client tries each value first; here a value out of range stands in for a refused one."""
    monkeypatch.setattr(postgresql, "CLIENT_CHECK_MS", -5)
    warned = _pooler_warning(pool_db, caplog)
    assert "client_connection_check_interval" not in warned[0]


def _pooler_warning(pool_db: str, caplog: pytest.LogCaptureFixture) -> list[str]:
    """What a client opened behind a transaction-mode PgBouncer warns: one message, which names the missing
    lock_timeout and the statement that sets it."""
    with (
        PgBouncer("transaction") as bouncer,
        caplog.at_level(logging.WARNING, logger="permits"),
        permits.connect(bouncer.url_for(pool_db, pooler="transaction")) as client,
    ):
        client.list_semaphores()
    warned = [r.getMessage() for r in caplog.records if "transaction pooler" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "ALTER ROLE postgres SET lock_timeout = '5000ms';" in warned[0]
    return warned


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u@h/db?pooler=statement",
        "postgresql://u@h/db?pooler=session&pooler=transaction",
        "mysql://u@h/db?pooler=transaction",
        "sqlite:///permits.db?pooler=session",
        "http://127.0.0.1:1/?pooler=transaction",
    ],
)
def test_a_pooler_parameter_that_cannot_apply_is_refused_by_name(url: str) -> None:
    with pytest.raises(permits.ConfigurationError) as raised:
        permits.connect(url)
    assert raised.value.details["field"] == "pooler"
    if "statement" in url:
        assert "transactions of several statements" in str(raised.value)


def test_messages_show_the_pooler_parameter_and_hide_the_password() -> None:
    """permits takes ``pooler`` off the URL before the driver sees it, but what it shows the user (the
    client's ``url``, the messages of its errors) is the URL as given, without its password."""
    from tests._private_db import free_port  # a port nothing listens on

    url = f"postgresql://permits:s3cret@127.0.0.1:{free_port()}/test?pooler=transaction"
    client = permits.connect(url, retries=0)
    shown = url.replace("s3cret", "***")
    assert client.url == shown
    with pytest.raises(permits.StorageUnavailable) as raised:
        client.get_semaphore("anything")
    assert f"database unavailable at {shown}:" in str(raised.value)
    assert raised.value.details["url"] == shown
    client.close()


def test_a_password_given_as_a_query_parameter_is_masked_too() -> None:
    url = "postgresql://permits@127.0.0.1:1/test?password=s3cret&sslpassword=k3y&pooler=session"
    client = permits.connect(url)
    assert "s3cret" not in client.url and "k3y" not in client.url
    assert "password=***" in client.url and "sslpassword=***" in client.url and "pooler=session" in client.url
    client.close()


# ---- the grant and the release as server functions (dialects/pg_functions.py)


def _created(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("created the server function")]


def test_behind_a_transaction_pooler_grants_and_releases_are_function_calls(
    ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Through PgBouncer in transaction mode, the grants and the release are calls of functions made from
    the very statements a direct client sends (unprepared, those are planned anew at every call). The first
    client creates them; the next finds them."""
    with own_database("postgresql", "permits_fn") as url:
        count_function_calls(url)
        with permits.connect(url, auto_upgrade=True) as direct:  # the schema, made directly
            direct.list_semaphores()
        with PgBouncer("transaction") as bouncer, caplog.at_level(logging.INFO, logger="permits"):
            pooled = bouncer.url_for(make_url(url).database or "", pooler="transaction")
            with permits.connect(pooled) as client:
                _exercise(client, ns)
            assert len(_created(caplog)) == 4, _created(caplog)
            caplog.clear()
            with permits.connect(pooled) as client:
                client.release(client.acquire(f"{ns}plain", timeout=5))
            assert _created(caplog) == []
        # Counted once the bouncer's server sessions have ended: a session reports its counts as it exits.
        assert called_functions(url, at_least=3) == {
            "acquire_one",
            "acquire_many_queued",
            "acquire_one_queued",
            "release",
            "release_one",
        }
        engine = create_engine(sqlalchemy_url(url))
        with engine.connect() as conn:
            sources = dict(
                conn.execute(text("SELECT proname, prosrc FROM pg_proc WHERE proname LIKE 'permits_%'")).all()
            )
        engine.dispose()
        functions = server_functions(PostgreSQL())
        assert set(sources) == {f.name for f in functions}
        for function in functions:  # each is its statement, with the parameters renamed
            statement = re.sub(r"(?<![:\w]):(\w+)", r"arg_\1", PostgreSQL().sql(function.made_from))
            assert f"RETURN QUERY {statement};" in sources[function.name]


@contextlib.contextmanager
def _role_that_may_not_create(url: str) -> Iterator[str]:
    """A role that may read and write permits' tables in the database of ``url`` (with its schema made)
    but not create anything there: its URL, with ``?pooler=transaction``."""
    grants = [
        "REVOKE CREATE ON SCHEMA public FROM PUBLIC, {role}",
        "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}",
        "GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role}",
    ]
    with temporary_role(url, "permits_dml", grants) as role_url:
        yield role_url + "?pooler=transaction"


def test_a_role_that_may_not_create_functions_sends_the_statements(ns: str, caplog: pytest.LogCaptureFixture) -> None:
    """A role without CREATE in the schema says why it cannot make the functions, and works on with the
    statements themselves; once a role that may has made them, it calls them."""
    with own_database("postgresql", "permits_fn") as url:
        count_function_calls(url)
        with permits.connect(url, auto_upgrade=True) as owner:
            owner.create_semaphore(f"{ns}s", 1)
        with _role_that_may_not_create(url) as limited:
            with caplog.at_level(logging.INFO, logger="permits"), permits.connect(limited) as client:
                lease = client.acquire(f"{ns}s", timeout=5)
                assert client.try_acquire(f"{ns}s") is None
                assert str(client.release(lease)) == "released"
            # Only the queued grant, which the owner's direct client made: the role could make none of its own.
            assert _permits_functions(url) == {f.name for f in server_functions(PostgreSQL(), DIRECT_FUNCTIONS)}
            refused = [
                r.getMessage() for r in caplog.records if "cannot create permits' server functions" in r.getMessage()
            ]
            assert len(refused) == 1 and "permission denied for schema public" in refused[0], refused
            assert _created(caplog) == []
            # The owner makes them, with the command docs/deployment.md gives for it.
            upgrade = [sys.executable, "-m", "permits", "db", "upgrade", "--db", url + "?pooler=transaction"]
            done = subprocess.run(upgrade, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="permits"), permits.connect(limited) as client:
                client.release(client.acquire(f"{ns}s", timeout=5))
            assert not [r for r in caplog.records if "server function" in r.getMessage()]
            assert called_functions(url) == {"acquire_one_queued", "release_one"}  # a waiting acquire asks in line
            # Functions it may not execute (an operator revoked PUBLIC's default EXECUTE): statements again.
            engine = create_engine(sqlalchemy_url(url), isolation_level="AUTOCOMMIT")
            with engine.connect() as conn:
                conn.execute(
                    text(f"REVOKE EXECUTE ON FUNCTION {server_functions(PostgreSQL())[0].signature} FROM PUBLIC")
                )
            engine.dispose()
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="permits"), permits.connect(limited) as client:
                client.release(client.acquire(f"{ns}s", timeout=5))
            denied = [r.getMessage() for r in caplog.records if "cannot be used" in r.getMessage()]
            assert len(denied) == 1 and "GRANT EXECUTE ON FUNCTION permits_acquire_one_" in denied[0], denied


def test_a_client_that_loses_the_race_to_create_a_function_calls_the_winners(
    ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two clients that open at once both find a function missing, and both create it: the one whose CREATE
    waited for the other's commit fails on the name, and calls the function the other made."""
    with own_database("postgresql", "permits_fn") as url, caplog.at_level(logging.INFO, logger="permits"):
        count_function_calls(url)
        with permits.connect(url, auto_upgrade=True) as direct:
            direct.create_semaphore(f"{ns}s", 1)
        first = server_functions(PostgreSQL())[0]
        other = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"))
        try:
            other.execute(first.definition)  # created, not committed: the client's CREATE waits for it
            outcome: list[Any] = []

            def open_and_use() -> None:
                with permits.connect(url + "?pooler=transaction") as client:
                    outcome.append(client.try_acquire(f"{ns}s"))  # the plain grant: a waiting one asks in line
                    client.release(outcome[-1])

            worker = threading.Thread(target=open_and_use, daemon=True)
            worker.start()
            deadline = time.monotonic() + 10
            while not _waits_for_a_lock(url) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert worker.is_alive() and not outcome, "the client did not wait for the other CREATE"
            other.commit()
            worker.join(15)
            assert len(outcome) == 1 and outcome[0].tokens == {f"{ns}s": 1}
        finally:
            other.close()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "server function" in r.getMessage()]
        assert called_functions(url) == {"acquire_one", "release_one"}  # the other's, and the one it made itself


def test_a_function_of_permits_name_that_permits_did_not_make_is_not_called(
    ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The functions' names are no secret: a function that somebody else created under one, with another
    body, is never called. The client says so and sends the statements."""
    with own_database("postgresql", "permits_fn") as url:
        with permits.connect(url, auto_upgrade=True) as direct:
            direct.create_semaphore(f"{ns}s", 1)
        release = server_functions(PostgreSQL())[1]
        planted = release.definition.replace("RETURN QUERY WITH", "RAISE NOTICE 'planted'; RETURN QUERY WITH", 1)
        assert planted != release.definition
        engine = create_engine(sqlalchemy_url(url), isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            conn.exec_driver_sql(planted)
        engine.dispose()
        with caplog.at_level(logging.INFO, logger="permits"), permits.connect(url + "?pooler=transaction") as client:
            lease = client.acquire(f"{ns}s", timeout=5)
            assert str(client.release(lease)) == "released"
        warned = [r.getMessage() for r in caplog.records if "cannot be used" in r.getMessage()]
        assert len(warned) == 1, warned
        assert f"{release.name}: a function of that name is not the one permits makes" in warned[0]
        assert f"DROP FUNCTION {release.signature}" in warned[0]


def _permits_functions(url: str) -> set[str]:
    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.connect() as conn:
            return set(conn.execute(text("SELECT proname FROM pg_proc WHERE proname LIKE 'permits_%'")).scalars())
    finally:
        engine.dispose()


def _waits_for_a_lock(url: str) -> bool:
    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.connect() as conn:
            return bool(
                conn.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND wait_event_type = 'Lock' AND query LIKE 'CREATE FUNCTION permits_%'"
                    )
                ).scalar_one()
            )
    finally:
        engine.dispose()
