"""Engine set-up shared by the sync and async SQL stores: drivers, pools, per-connection settings, and the
translation of driver errors into permits errors (the one choke point)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import weakref
from collections.abc import Callable, MutableMapping
from time import monotonic
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.pool import AsyncAdaptedQueuePool, QueuePool

from permits._config import Settings
from permits._deadline import give_up_at, reply_within, store_grace, store_least_reply
from permits._exceptions import (
    ConfigurationError,
    PermitsError,
    SchemaMismatch,
    StorageConflict,
    StorageError,
    StorageReadOnly,
    StorageUnavailable,
)
from permits._io import forks, shut_down, sync_unwatch_reply, sync_watch_reply
from permits.dialects.base import Dialect, Fault

logger = logging.getLogger("permits")

#: execution option that marks a transaction as read-only (SQLite then skips the write lock)
READONLY = "permits_readonly"


def engine_args(dialect: Dialect, settings: Settings, asynchronous: bool) -> tuple[URL, dict[str, Any]]:
    dialect.check_driver(asynchronous)
    options = dialect.engine_options(settings.lock_wait_timeout, settings.pooler)
    # The store ends every transaction itself (commit, or rollback on error), so the pool's ROLLBACK on
    # every return would only add a round trip per operation (PyMySQL always sends it).
    options.setdefault("pool_reset_on_return", None)
    bounded = dialect.reply_timeout_args(settings.reply_timeout, asynchronous)
    if bounded:
        options["connect_args"] = {**options.get("connect_args", {}), **bounded}
    if settings.pool_size is not None:
        options["pool_size"] = options["max_overflow"] = settings.pool_size
    url = dialect.engine_url(settings.database_url, asynchronous)
    if "poolclass" not in options:
        # The pool SQLAlchemy would choose: each dialect class has it (DefaultDialect.get_pool_class).
        chosen = getattr(url.get_dialect(_is_async=asynchronous), "get_pool_class")(url)  # noqa: B009
        if chosen in (QueuePool, AsyncAdaptedQueuePool):  # not an in-memory SQLite's single connection
            options["poolclass"] = _caller_bound(chosen, store_grace(settings.lock_wait_timeout))
    return url, options


#: Set while this thread's (or task's) checkout waits for a pooled connection: only then is the pool's
#: timeout the caller's (``_CallerBoundWait``).
_CHECKING_OUT: contextvars.ContextVar[bool] = contextvars.ContextVar("permits_checking_out", default=False)


class _CallerBoundWait:
    """A queue pool whose checkout waits for a connection to come back no longer than the caller's deadline
    and the store's grace leave (``permits._deadline``), as an attempt waits for its answer: where more
    threads or tasks than the pool holds are busy on a slow database, ``acquire(timeout=2)`` gives up within
    the bounds of a late attempt, not after the pool's own timeout (30 s). A caller without a deadline, and
    the pool's ``timeout()`` and ``recreate()``, keep the pool's own."""

    #: seconds past the caller's deadline that a checkout may still wait (``store_grace``): set on the class
    #: made for each lock wait (``_caller_bound``)
    grace: float = 0.0
    _pool_timeout: float

    @property
    def _timeout(self) -> float:
        if not _CHECKING_OUT.get():
            return self._pool_timeout
        end = give_up_at(self.grace)
        return self._pool_timeout if end is None else max(0.0, min(self._pool_timeout, end - monotonic()))

    @_timeout.setter
    def _timeout(self, seconds: float) -> None:  # QueuePool.__init__ sets it
        self._pool_timeout = float(seconds)

    def _do_get(self) -> Any:
        outer = _CHECKING_OUT.set(True)
        try:
            waits = self._timeout
            return super()._do_get()  # type: ignore[misc]
        except PoolTimeout as exc:
            if not hasattr(exc, "permits_waited"):  # QueuePool's _do_get may call itself: the wait that ran out
                exc.permits_waited = waits  # type: ignore[attr-defined]
            raise
        finally:
            _CHECKING_OUT.reset(outer)


@functools.cache
def _caller_bound(pool: type[QueuePool], grace: float) -> type[QueuePool]:
    # SQLAlchemy names a pool's logger after its class: its messages stay under sqlalchemy.pool.
    namespace = f"sqlalchemy.pool.impl.{pool.__name__}"
    return type(
        f"CallerBound{pool.__name__}", (_CallerBoundWait, pool), {"grace": grace, "_sqla_logger_namespace": namespace}
    )


def _reply_within(settings: Settings) -> float:
    """The store's reply deadline, or less where its caller's deadline is near (``permits._deadline``)."""
    wait = settings.lock_wait_timeout
    return reply_within(settings.reply_timeout, store_grace(wait), store_least_reply(wait))


def install_events(
    engine: Engine, dialect: Dialect, settings: Settings, sessions: MutableMapping[Any, dict[str, Any]] | None = None
) -> None:
    """Per-connection settings that cannot go through connect_args. With ``sessions``, each new connection's
    server session is noted there (``SESSION_OF``'s row, by the driver's connection), where the dialect can
    say it: the store ends a session whose link its reply deadline cut (``_end_cut_sessions``). Not behind a
    transaction pooler, whose server connections change hands between transactions."""
    from permits.dialects.sqlite import SQLite

    #: a connection was made with these parameters once: they are not what a later failure is about
    parameters_taken = False

    @event.listens_for(engine, "do_connect")
    def _connect_or_refuse(engine_dialect: Any, _record: Any, cargs: Any, cparams: Any) -> Any:
        # The URL's query goes to the driver as keyword arguments: one it does not know, or a value it
        # cannot read, is a TypeError or a ValueError there, which would reach the caller as a traceback.
        try:
            bound = _reply_within(settings)
            if bound < settings.reply_timeout:  # a caller's deadline is near: the connect holds to it too
                cparams = dialect.connect_within(cparams, bound)
            return engine_dialect.connect(*cargs, **cparams)
        except (TypeError, ValueError) as exc:
            if parameters_taken:  # the same parameters worked before: the driver's failure, not the URL's
                raise StorageUnavailable(
                    f"the database driver failed to connect to {settings.shown_url}: {type(exc).__name__}: {exc}",
                    url=settings.shown_url,
                ) from exc
            raise ConfigurationError(
                f"the database driver refused a parameter of the URL ({settings.shown_url}): {exc}", field="url"
            ) from None

    @event.listens_for(engine, "connect")
    def _connected(dbapi_connection: Any, _record: Any) -> None:
        nonlocal parameters_taken
        parameters_taken = True
        dialect.connected(dbapi_connection)

    on_connect = dialect.on_connect_sql(settings.lock_wait_timeout, settings.pooler)
    identify = sessions is not None and dialect.has("SESSION_OF") and settings.pooler != "transaction"
    session_sql = dialect.sql("SESSION_OF") if identify else ""
    if on_connect is not None or identify:

        def note_session(dbapi_connection: Any) -> None:
            nonlocal identify
            driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
            if not dialect.tells_sessions_apart(driver):
                identify = False
                return
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute(session_sql)
                row = cursor.fetchone()
                names = [column[0] for column in cursor.description]
            except Exception as exc:
                wrapped = driver_error(engine, exc)
                fault = None if wrapped is None else dialect.classify(wrapped)
                if fault is None or fault is Fault.UNAVAILABLE:
                    raise
                dbapi_connection.rollback()
                if not fault.retryable:  # a server that cannot answer it (another engine speaking its protocol)
                    identify = False
                    _cannot_end_cut_sessions(settings, _first_line(exc))
                return  # else a passing conflict: this connection's session goes unnoted, the next one's not
            finally:
                cursor.close()
            if row is None or sessions is None:
                return
            session = dict(zip(names, row, strict=True))
            told = dialect.handshake_session(driver)
            if told is not None and told != session["id"]:
                # A pooler or a proxy answered the handshake: it may hand the session behind it to another
                # client once this one's link is cut, and ending it would end that client's.
                identify = False
                _cannot_end_cut_sessions(settings, "a pooler or a proxy stands between the client and the server")
                return
            sessions[driver] = session

        @event.listens_for(engine, "connect")
        def _set_session(dbapi_connection: Any, _record: Any) -> None:
            # Under the reply deadline, as an operation's statements are: a link that stalls right after the
            # handshake fails the connect, which the store retries, rather than hang it.
            driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
            watch = sync_watch_reply(dialect.reply_socket(driver), _reply_within(settings))
            try:
                if identify:
                    note_session(dbapi_connection)
                if on_connect is not None:
                    cursor = dbapi_connection.cursor()
                    cursor.execute(on_connect)
                    cursor.close()
                dbapi_connection.commit()
            finally:
                sync_unwatch_reply(watch)

    if not isinstance(dialect, SQLite):
        return
    busy_ms = sqlite_busy_ms(settings.lock_wait_timeout)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        # WAL: readers do not block the writer, and several processes share the file. synchronous=FULL
        # syncs the WAL at every commit, so an acknowledged grant survives a power cut, not only a crash.
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
        cursor.close()
        dialect.prepare_connection(dbapi_connection)

    # Operations run their transactions on the driver (stores/direct.py); this begins the few that go
    # through SQLAlchemy's Connection (the schema's check and migrations).
    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        readonly = connection.get_execution_options().get(READONLY, False)
        # On the DB-API cursor: through exec_driver_sql, SQLAlchemy's statement machinery cost about as
        # much CPU as the BEGIN itself, twice per cycle. Its error wrapping is kept: a busy database must
        # reach the retry loop as a DBAPIError, like an error of any other statement.
        cursor = connection.connection.dbapi_connection.cursor()
        try:
            cursor.execute("BEGIN" if readonly else "BEGIN IMMEDIATE")
        except Exception as exc:
            wrapped = driver_error(engine, exc)
            if wrapped is None:
                raise
            raise wrapped from exc
        finally:
            cursor.close()


def sqlite_busy_ms(lock_wait_timeout: float) -> int:
    """SQLite's busy timeout for a lock wait bound: how long a connection waits for the database's write
    lock, in whole milliseconds (at least one: zero would not wait at all)."""
    return max(1, round(lock_wait_timeout * 1000))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _cannot_end_cut_sessions(settings: Settings, why: str) -> None:
    logger.warning(
        "permits cannot tell the server sessions at %s apart (%s): a request held on a link that the reply"
        " deadline cut may still run when the link comes back (docs/deployment.md, Errors that are retried)",
        settings.shown_url,
        why,
    )


def translate(exc: DBAPIError, fault: Fault, dialect: Dialect, settings: Settings) -> PermitsError:
    """A permits error for a driver error: the URL without its password and the driver's own first line,
    never the SQL or the parameters."""
    where = settings.shown_url
    first_line = str(exc.orig).strip().splitlines()[0] if exc.orig is not None and str(exc.orig).strip() else ""
    detail = f": {first_line}" if first_line else ""
    if fault is Fault.UNAVAILABLE:
        return StorageUnavailable(f"database unavailable at {where}{detail}", url=where)
    if fault is Fault.CONFLICT:
        return StorageConflict(f"database kept reporting conflicts at {where}{detail}", url=where)
    if fault is Fault.READ_ONLY and dialect.name == "sqlite":
        return StorageReadOnly(
            f"the SQLite database at {where} refused a write: it was opened read-only (mode=ro), or its file"
            f" or directory may not be written by this user{detail}",
            url=where,
        )
    if fault is Fault.READ_ONLY:
        return StorageReadOnly(
            f"the database at {where} is a read-only replica; point permits at the primary", url=where
        )
    if fault is Fault.SCHEMA:
        return SchemaMismatch(f"the permits tables are missing at {where}: run `permits db upgrade`", url=where)
    return StorageError(f"database error at {where}{detail}", url=where)


async def async_run_sync(connection: Any, fn: Any) -> Any:
    """Run a function written for a sync Connection (Alembic) on an AsyncConnection."""
    return await connection.run_sync(fn)


def sync_run_sync(connection: Any, fn: Any) -> Any:
    return fn(connection)


async def async_driver_connection(connection: Any) -> Any:
    """The driver's own connection under a checked-out AsyncConnection (aiomysql's, say)."""
    return (await connection.get_raw_connection()).driver_connection


def sync_driver_connection(connection: Any) -> Any:
    return connection.connection.driver_connection


async def async_check_out_alone(engine: Any) -> Any:
    """A connection for the statements that run alone (the store's ``_Parked``): a started AsyncConnection,
    inside which the asyncio pool takes the connection back when it is closed."""
    conn = engine.connect()
    await conn.start()
    return conn


def sync_check_out_alone(engine: Any) -> Any:
    """The pool's connection itself, with no SQLAlchemy Connection around it: setting one up and closing it
    cost about a fifth of a PostgreSQL client's CPU per grant (docs/benchmarks.md)."""
    return engine.raw_connection()


async def async_alone_driver(conn: Any) -> Any:
    """The driver's connection under one from ``async_check_out_alone``."""
    return await async_driver_connection(conn)


def sync_alone_driver(conn: Any) -> Any:
    return conn.driver_connection


def async_live(conn: Any) -> bool:
    """Whether a connection from ``async_check_out_alone`` can still be used: not closed, nor invalidated
    (its link lost, or its state unknown)."""
    return not conn.closed and not conn.invalidated


def sync_live(conn: Any) -> bool:
    return bool(conn.is_valid)


async def async_drop_link(engine: Any, conn: Any, exc: BaseException) -> None:
    """A connection from ``async_check_out_alone`` lost its link: it is dropped, and the pool's connections
    made before it are replaced at their next checkout, as SQLAlchemy does when a Connection of its own
    meets a lost link (a server restart, or an idle timeout, most often took them all). SQLAlchemy keeps that
    step as ``Pool._invalidate``."""
    engine.pool._invalidate(await conn.get_raw_connection(), exc, _checkin=False)
    await conn.invalidate(exc)


def sync_drop_link(engine: Any, conn: Any, exc: BaseException) -> None:
    engine.pool._invalidate(conn, exc, _checkin=False)
    conn.invalidate(exc)


def track_drivers(engine: Engine, found: weakref.WeakSet[Any]) -> None:
    """Put each pool entry ``engine`` opens in ``found`` (weakly: one the pool lets go is gone from it), so
    that the connections of an event loop that has closed can be let go (``let_go_of_closed_loop``)."""

    @event.listens_for(engine, "connect")
    def _opened(_dbapi_connection: Any, record: Any) -> None:
        found.add(record)


def let_go_of_closed_loop(engine: Engine, entries: weakref.WeakSet[Any]) -> None:
    """aiomysql's connections belong to the event loop that made them, and cannot be used, or even closed,
    once it has: closing one schedules a callback on its loop ("Event loop is closed"). Each is let go
    without it. One checked out of the pool (parked, or held by a task the loop's end left behind) is
    detached from it first: collected while checked out, the pool would warn that it was never given back.
    Its link is shut down, so that its server session ends now rather than at the server's idle timeout,
    and the driver's connection is marked closed (aiomysql's own mark: no stream), so that when it is
    collected it does not try its loop. The pool then starts afresh, in whatever loop uses it next. The
    socket itself is closed when its transport is collected."""
    for entry in list(entries):
        # Read first: detaching a checked-out connection takes it off its entry.
        driver = getattr(entry.dbapi_connection, "driver_connection", entry.dbapi_connection)
        checked_out = entry.fairy_ref() if entry.fairy_ref is not None else None
        if checked_out is not None:
            # Detaching may wake a task of the closed loop that waits for a connection (RuntimeError): the
            # entry is out of the pool's hands before that, which is all that is wanted here.
            with contextlib.suppress(RuntimeError):
                checked_out.detach()
        writer = getattr(driver, "_writer", None)
        if writer is None:
            continue
        sock = writer.get_extra_info("socket")
        if sock is not None:
            shut_down(sock.fileno())
        driver._writer = driver._reader = None
    entries.clear()
    engine.dispose(close=False)


def pool_full(pool: Any) -> bool:
    """Whether every connection ``pool`` may open is checked out, so that a checkout now waits for one to
    come back. A QueuePool's limit is its size plus its overflow (an overflow of -1: no limit); SQLAlchemy
    keeps the overflow only as ``_max_overflow``. A pool of another kind is never full."""
    overflow = getattr(pool, "_max_overflow", None)
    if not isinstance(overflow, int) or overflow < 0 or not hasattr(pool, "size"):
        return False
    return bool(pool.checkedout() >= pool.size() + overflow)


#: The key of a pool entry's ``info`` that says in which process (``forks()``) its connection was made.
_MADE_IN = "permits_forks"


def close_returned_connections_once(engine: Any, closed: Callable[[], bool]) -> None:
    """Once ``closed()`` is true, a connection given back to ``engine``'s pool is closed rather than kept.

    Why: a store's ``close()`` disposes of the pool, but a thread (or task) still at work in the store
    then holds a connection that ``dispose()`` does not touch: it would go back into the old pool, which
    nobody disposes any more, and stay open until the garbage collector found it; and an operation that
    goes on after ``close()`` checks out of the new pool SQLAlchemy puts in its place. Pool events set on
    the engine carry over to that new pool, so this covers both, and work in flight still finishes.

    Not a connection a forked child inherited: closing it would end its parent's session over the socket
    both hold (``_io.keep_inherited``). Left open: a connection given back in the instant between a
    check of ``closed()`` and ``close()`` disposing of the pool, and one whose closing a cancellation
    interrupts (SQLAlchemy then loses the pool's entry; the pool is being closed anyway)."""

    def on_connect(_dbapi_connection: Any, entry: Any) -> None:
        entry.info[_MADE_IN] = forks()

    def on_checkin(dbapi_connection: Any, entry: Any) -> None:
        if dbapi_connection is not None and entry.info.get(_MADE_IN) == forks() and closed():
            entry.close()  # the pool keeps the entry, with no connection: nothing is open for it any more

    sync = sync_engine(engine)
    event.listen(sync, "connect", on_connect)
    event.listen(sync, "checkin", on_checkin)


#: The attribute of a psycopg connection that keeps its cursor for the statements that run alone.
_KEPT_CURSOR = "_permits_cursor"


def kept_cursor(driver: Any) -> Any:
    """The cursor kept on a psycopg connection for the statements that run alone, made at its first one.
    ``driver.execute`` makes a cursor, with an adapters map of its own, for every statement: about 8% of a
    PostgreSQL client's CPU per acquire+release cycle (docs/benchmarks.md, "one cursor per PostgreSQL
    connection"). A cursor stays usable after a statement fails, and prepared statements belong to the
    connection, not to the cursor."""
    cursor = getattr(driver, _KEPT_CURSOR, None)
    if cursor is None or cursor.closed:
        cursor = driver.cursor()
        setattr(driver, _KEPT_CURSOR, cursor)
    return cursor


def driver_error(engine: Any, exc: BaseException) -> DBAPIError | None:
    """A driver exception raised outside SQLAlchemy, wrapped as SQLAlchemy would have (None: not one)."""
    base = sync_engine(engine).dialect.loaded_dbapi.Error
    if not isinstance(exc, base):
        return None
    wrapped = DBAPIError.instance(None, None, exc, base)
    return wrapped if isinstance(wrapped, DBAPIError) else None


def sync_engine(engine: Any) -> Engine:
    """The sync Engine behind an AsyncEngine (or the Engine itself), where events are installed."""
    return getattr(engine, "sync_engine", engine)  # type: ignore[no-any-return]
