"""The SQL store: runs each flow of ``permits._core.flows`` in one transaction, with retries."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

from sqlalchemy import text
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

from permits import _schema
from permits._backoff import RETRY_BACKOFF
from permits._config import Settings
from permits._core import decide, flows
from permits._core.flows import DuplicateKey, Flow, Restart, Result, Retry, Stmt, Then
from permits._deadline import (
    CALLER_DEADLINE,
    give_up_at,
    past_giving_up,
    store_grace,
    store_least_reply,
    without_caller_deadline,
)
from permits._exceptions import (
    ConfigurationError,
    IdempotencyConflict,
    KeyInUse,
    LeaseLost,
    PermitsError,
    StorageConflict,
    StorageError,
    StorageReadOnly,
    StorageUnavailable,
    UsageError,
)
from permits._io import (
    async_lock,
    async_lock_within,
    async_loop,
    async_mutex,
    async_sleep,
    async_try_lock,
    async_unwatch_reply,
    async_watch_reply,
    check_given_up,
    forks,
    keep_inherited,
    monotonic,
)
from permits._models import (
    CapacityChange,
    Drift,
    EndReason,
    Holder,
    Lease,
    ReleaseOutcome,
    Semaphore,
    SweepResult,
    Waiter,
    Want,
)
from permits._pacing import LINE_BUSY_SECONDS, LINE_HEAD_WAIT_SECONDS, LINE_SEATS
from permits.dialects.base import Dialect, Fault, SettingFix, dialect_for_url
from permits.dialects.mysql import MULTI_PRIMARY_PROBE, is_multi_primary, mysql_family_dialect, without_line
from permits.dialects.pg_functions import (
    CREATED_MEANWHILE,
    DIRECT_FUNCTIONS,
    FUNCTION_NAME_PATTERN,
    MAY_NOT_CREATE,
    OLD_FUNCTIONS,
    POOLED_FUNCTIONS,
    PROBE,
    READ_ONLY,
    ServerFunction,
    function_gone,
    line_unsupported,
    server_functions,
)
from permits.stores._engine import (
    READONLY,
    async_alone_driver,
    async_check_out_alone,
    async_driver_connection,
    async_drop_link,
    async_live,
    async_run_sync,
    close_returned_connections_once,
    driver_error,
    engine_args,
    install_events,
    kept_cursor,
    let_go_of_closed_loop,
    pool_full,
    sync_engine,
    track_drivers,
    translate,
)
from permits.stores.direct import DirectTransactions
from permits.stores.host_lines import HostLines, semaphore_line

if TYPE_CHECKING:
    from permits._async.listener import AsyncRoomListener

T = TypeVar("T")
logger = logging.getLogger("permits.store")

IS_ASYNC = True
#: A flow may restart itself (for example, to answer a retry from the lease that exists); more than this
#: many restarts in one call means something is wrong.
MAX_RESTARTS = 10
#: How long a release or an extend keeps retrying conflicts (see ``_run``'s ``persist``).
PERSIST_SECONDS = 30.0
#: A lost connection that came this soon after its attempt began failed at once, not over a link that hangs:
#: the first such is retried even past the caller's point of giving up (``_backoff_or_raise``).
QUICK_FAILURE_SECONDS = 1.0
#: Callers whose points of giving up are this close share a failed opening (``_answers_this_caller``).
SAME_DEADLINE_SECONDS = 1.0
#: Set on an error raised because its caller's point of giving up had passed (``permits._deadline``).
CUT_BY_CALLER_DEADLINE = "_permits_cut_by_caller_deadline"
#: A conflict that came after its attempt ran this share of lock_wait_timeout made that attempt wait for a
#: lock: a try that does not wait is not retried after one (``_try_acquire``). Half, since MariaDB counts
#: its lock wait in whole seconds.
SLOW_CONFLICT_SHARE = 0.5
#: How long a waiter's place in a fair queue lasts unless it asks again. A waiting client asks at least
#: every second (the wait backoff's cap), so a live waiter never loses its place; a dead one frees it
#: within this many milliseconds.
PLACE_MS = 5000
#: At most this many queued requests are remembered for a later dequeue; older ones just expire.
MAX_REMEMBERED_PLACES = 100_000
#: At most this many semaphores whose line was busy are remembered; past that, the memory starts afresh.
REMEMBERED_BUSY_LINES = 1_000
#: At the head of a semaphore's line beside a SQLite database, a waiter reads the semaphore this often
#: while it waits for room (a read takes no lock), and asks when it sees some.
HOST_LINE_POLL_SECONDS = 0.0005
#: How long a connection stays out of the pool for the statements that run alone (``_Parked``) before it goes
#: back through the pool once: the pool's own checks (its recycling of old connections, MySQL's
#: ``pool_recycle``) then apply to it as to any other, within this many seconds.
PARK_SECONDS = 10.0
#: At most this many connections are parked at once: as many as a store's statements that run alone usually
#: overlap (one per thread of a sync client; a service's lines, a few at a time); more go back to the pool.
PARKED_AT_MOST = 4
#: SQLSTATE of a setting's value that the server refuses (``_server_takes``)
INVALID_PARAMETER_VALUE = "22023"
#: The warnings about server functions this process has given: each once, not at every open of a client.
_WARNED: set[tuple[Any, ...]] = set()


def _warn_once(message: str, *args: Any) -> None:
    if (message, *args) in _WARNED:
        logger.debug(message, *args)
        return
    _WARNED.add((message, *args))
    logger.warning(message, *args)


#: What a PostgreSQL client does without the server functions it cannot use.
_WITHOUT_FUNCTIONS = (
    "permits works on without them: it sends the statements they would run (planned anew at every call behind"
    " a transaction pooler), and without the queued grant its waiters wait for releases as on other databases"
)


class _CallGone(Exception):
    """A call of a server function cannot work any more (``pg_functions.function_gone``), or was given up
    since the operation's flow was made: the store stops calling that function and runs the operation
    again (``_run``)."""

    def __init__(self, statement: str, reason: str, error: DBAPIError | None = None) -> None:
        super().__init__(statement, reason)
        self.statement, self.reason, self.error = statement, reason, error


@dataclasses.dataclass(eq=False)
class _CutSession:
    """A server session whose link the reply deadline cut with a request in flight (``_note_cut``), until
    it is ended or given up (``_end_cut_sessions``)."""

    #: what SESSION_OF read when the connection was made: the session's id and its server's
    where: dict[str, Any]
    #: held by the caller that is ending the session
    ending: Any = dataclasses.field(default_factory=async_lock)
    #: ended, found gone, or given up: nothing more to do
    settled: bool = False
    #: the operation whose attempt was cut is over (it gave up, or its answer came after all) and no longer
    #: waits for the ending itself: a call again with its key, or any other, must (``_end_cut_sessions``)
    abandoned: bool = False
    #: not cut by the reply deadline: its caller was interrupted (cancelled, Ctrl-C) with the request sent
    interrupted: bool = False


@dataclasses.dataclass(slots=True)
class _Parked:
    """A connection kept out of the pool between the statements that run alone (a grant, a release), parked:
    the next such statement takes it rather than check one out, and on PostgreSQL finds it in autocommit
    still. In the sync store it is the pool's connection with no SQLAlchemy Connection around it, in the
    asyncio store a started AsyncConnection. Checking a connection out and back in for every statement
    cost about a sixth of a sync client's CPU per grant and release, setting up and closing an
    AsyncConnection more, and switching autocommit on and off a little more again (docs/benchmarks.md,
    "a connection kept for the statements that run alone"). It goes back to the pool when its link was
    lost, once it has been out PARK_SECONDS, when a transaction finds none idle in the pool (``_lend_parked``:
    so the pool is never short, nor grows, for it), at ``close()``, and instead of being parked while the
    pool has every connection it may open checked out (``_park``)."""

    conn: Any
    #: the driver's connection under ``conn``
    driver: Any
    #: when it left the pool (monotonic)
    since: float


class AsyncSQLStore:
    """Carries out operations on SQLite, MariaDB/MySQL or PostgreSQL."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._dialect = dialect_for_url(settings.database_url)
        url, options = engine_args(self._dialect, settings, asynchronous=IS_ASYNC)
        try:
            self._engine = create_async_engine(url, **options)
        # The dialect reads the URL here: its query (connect_timeout=abc), SQLite's form (sqlite://host/x.db).
        except (TypeError, ValueError, ArgumentError) as exc:
            what = "the form of the URL" if isinstance(exc, ArgumentError) else "a parameter of the URL"
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            password = str(settings.database_url.password or "")
            for shown in {password, quote(password, safe="")}:  # a driver's message may quote the URL it was given
                if len(shown) >= 4:  # a shorter one would match all over the message, and tell little
                    first_line = first_line.replace(shown, "***")
            raise ConfigurationError(
                f"the database driver refused {what} ({settings.shown_url}): {first_line}", field="url"
            ) from None
        #: the server session behind each driver connection (see ``_end_cut_sessions``)
        self._sessions: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
        install_events(sync_engine(self._engine), self._dialect, settings, self._sessions)
        # Through a weak reference: the engine's events would otherwise make a cycle with the store, which
        # only the garbage collector frees.
        this = weakref.ref(self)
        close_returned_connections_once(self._engine, lambda: (store := this()) is None or store._closed)
        #: the pool's entries (MariaDB and MySQL: those of a closed event loop are let go, ``_check_loop``)
        self._entries: weakref.WeakSet[Any] = weakref.WeakSet()
        if IS_ASYNC and self._dialect.name == "mysql":
            track_drivers(sync_engine(self._engine), self._entries)
        #: sessions whose link the reply deadline cut, to end before the next operation (``_end_cut_sessions``)
        self._cut: list[_CutSession] = []
        self._opened = False
        #: held by the one open() that checks the schema and sets the statements
        self._opening = async_lock()
        #: how many openings failed, and the last one's error: the answer of the callers that waited for it
        self._open_failures = 0
        self._open_failure: PermitsError | None = None
        #: when the last failed opening's caller gave up (``permits._deadline``; None: it had no deadline)
        self._open_failure_gave_up_at: float | None = None
        self._closed = False
        #: test hook: called with each statement's name after it ran (fault tests kill the process here)
        self.after_statement: Callable[[str], None] | None = None
        #: called with the fault's name each time a transaction is retried (the service counts them)
        self.on_retry: Callable[[str], None] | None = None
        #: called each time the reply deadline cuts a connection ("cut"), and with what became of its server
        #: session ("ended"; "gone": it had ended already; "other_server"; "refused"): the service counts them
        self.on_reply_cut: Callable[[str], None] | None = None
        #: statements compiled for the driver, by name, and the dialect they were compiled from: replaced as a
        #: whole when the dialect is, so that a thread that compiled from the old one never fills the new cache
        self._compiled: tuple[Dialect, dict[str, tuple[str, tuple[str, ...] | None]]] = (self._dialect, {})
        #: SQLite's transactions skip SQLAlchemy's Connection (stores/direct.py). The asyncio store runs SQLite
        #: through the sync one, on a worker thread (stores/threaded.py), so only the sync store needs this.
        self._direct = (
            DirectTransactions(sync_engine(self._engine), self._dialect, settings.lock_wait_timeout)
            if self._dialect.name == "sqlite" and not IS_ASYNC
            else None
        )
        #: requests this store put in a fair queue and that were not granted yet (insertion-ordered)
        #: each with its shortfall (see ``queue_short``), and whether its place records the wake channel
        self._queued: OrderedDict[tuple[str, str], tuple[int | None, bool]] = OrderedDict()
        # Server-side prepared statements on PostgreSQL's hot path, except behind a transaction pooler: the
        # next transaction may run on another server connection, which has never seen the statement.
        self._prepare = settings.pooler != "transaction"
        #: how long an operation's transaction waits for replies before its connection is taken as lost
        self._replies = settings.reply_timeout
        #: past a caller's deadline: how long it still waits and retries, and an attempt's least wait
        self._grace = store_grace(settings.lock_wait_timeout)
        self._least_reply = store_least_reply(settings.lock_wait_timeout)
        #: the dialect as it was before open() swapped in calls of server functions (PostgreSQL's queued grant,
        #: and behind a transaction pooler the grant and the release): what the functions are made from
        self._before_functions: Dialect | None = None
        #: the calls swapped in, by the statement each replaces
        self._function_calls: dict[str, str] = {}
        #: attempts of this store now waiting in a server line (see try_acquire), and its guard: the sync
        #: store's threads share the count, and a lost update would leave it off for good
        self._in_line_now = 0
        self._seats_mutex = async_mutex()
        #: semaphores whose line an attempt of this store found busy, and until when (monotonic) its first
        #: attempts go straight into the line rather than ask outside it first (see try_acquire)
        self._line_busy_until: dict[str, float] = {}
        # On PostgreSQL, waiters hear released permits (LISTEN/NOTIFY) instead of only polling. Not through
        # a transaction pooler, which hands the LISTENing server connection on to other clients.
        self._listener: AsyncRoomListener | None = None
        if self._dialect.name == "postgresql" and settings.pooler != "transaction":
            from permits._async.listener import AsyncRoomListener  # psycopg: the postgresql extra

            conninfo = settings.database_url.set(drivername="postgresql").render_as_string(hide_password=False)
            self._listener = AsyncRoomListener(conninfo, mark_sql=self._driver_sql("LISTENED_MARK")[0])
        #: connections kept out of the pool between statements that run alone (``_Parked``), and their guard,
        #: shared by the sync store's threads
        self._parked: list[_Parked] = []
        self._park_mutex = async_mutex()
        #: ``forks()`` when this store's connections were made (see ``_renew_if_forked``)
        self._forks = forks()
        #: the event loop of the first opening (asyncio; see ``_check_loop``)
        self._loop: Any = None

    def _renew_if_forked(self) -> None:
        """In a forked child: forget the parent's connections and the state that went with them, kept
        unclosed (``_io.forks``); this operation opens connections of its own."""
        if self._forks == forks():
            return
        self._forks = forks()
        engine = sync_engine(self._engine)
        keep_inherited(engine.pool)
        engine.dispose(close=False)
        self._cut = []
        self._sessions.clear()  # the parent's sessions; the engine's hook notes the child's own in it
        self._in_line_now = 0
        self._seats_mutex = async_mutex()
        self._parked, self._park_mutex = [], async_mutex()  # the parent's, in the pool kept above
        self._opening = async_lock()  # one held in the parent at the fork would stay held here
        self._entries.clear()  # the parent's, which a change of event loop here must not shut down
        self._loop = None  # the child's own loop is its first
        if self._listener is not None:
            listener = self._listener
            keep_inherited(listener)
            self._listener = type(listener)(listener.conninfo, mark_sql=listener.mark_sql)

    def _check_loop(self) -> None:
        """On MariaDB and MySQL the driver's connections belong to the event loop they were made in, and fail
        in another with a RuntimeError from deep inside the driver. A client used by one loop after another
        (``asyncio.run`` called again, a test framework's loop per test) finds the first one closed: its
        connections are let go, their sessions ended, and the pool starts afresh in this loop. Used by two
        loops at once, it cannot serve both, and says so. (psycopg's connections, and the SQLite store's
        threads, serve any loop.)"""
        loop = async_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop and self._dialect.name == "mysql":
            if not self._loop.is_closed():
                raise UsageError(
                    "this AsyncClient is in use in another event loop, which is still open, and on MariaDB and"
                    " MySQL the driver's connections cannot move between loops: make one client per loop (async"
                    " with permits.connect_async(...) inside the loop that uses it)"
                )
            let_go_of_closed_loop(sync_engine(self._engine), self._entries)
            # What the closed loop's tasks held goes with them: a line seat, the locks of an opening and of the
            # endings of cut sessions (a task the loop's end left behind may hold one for ever, and a lock
            # that was waited for in one loop cannot be waited for in another).
            self._parked = []
            self._in_line_now = 0
            self._opening = async_lock()
            for cut in self._cut:
                cut.ending = async_lock()
            self._loop = loop

    @property
    def url(self) -> str:
        return self._settings.shown_url

    @property
    def connections_in_use(self) -> int:
        """Connections checked out of the pool and at work now, not parked ones (the service exports it as a
        metric)."""
        return int(self._engine.pool.checkedout()) - len(self._parked)  # type: ignore[attr-defined]

    @property
    def dialect_name(self) -> str:
        return self._dialect.name

    async def open(self) -> None:
        """Check the schema (creating it where auto_upgrade is on). Called on first use."""
        if self._closed:
            raise UsageError("this client is closed")
        self._renew_if_forked()
        self._check_loop()
        if self._opened:
            return
        # One opening at a time. The threads (or tasks) of a first burst of calls would otherwise each probe
        # the server and set the statements from what each saw: one whose probe of a cluster met a passing
        # error would put a single server's statements over the cluster's that another had just set.
        failures_before = self._open_failures
        point = give_up_at(self._grace)
        # A caller with a deadline waits for another's opening no longer than its own point of giving up (an
        # opening without a deadline may spend every retry of a link that hangs: minutes).
        if not await async_lock_within(self._opening, None if point is None else point - monotonic()):
            failure = self._open_failure if self._open_failures != failures_before else None
            if failure is not None:
                raise type(failure)(failure.message, **failure.details) from failure
            raise StorageUnavailable(
                f"this client was still reaching {self.url} for another caller when this call's time was up",
                url=self.url,
            )
        try:
            if self._closed:  # while this caller waited
                raise UsageError("this client is closed")
            if not self._opened:  # by the caller this one waited for
                failure = self._open_failure
                if self._open_failures != failures_before and failure is not None and self._answers_this_caller():
                    # An opening failed while this caller waited for it: that is its answer too. Trying again
                    # in turn would have the last of a burst of callers wait for as many failed openings as
                    # there are callers ahead of it, each its retries long. A caller that comes later tries.
                    raise type(failure)(failure.message, **failure.details) from failure
                try:
                    await self._open()
                except PermitsError as exc:
                    self._open_failure = exc
                    self._open_failures += 1
                    # Where its caller's deadline cut it short, callers with more time try again themselves.
                    self._open_failure_gave_up_at = point if getattr(exc, CUT_BY_CALLER_DEADLINE, False) else None
                    raise
        finally:
            self._opening.release()

    def _answers_this_caller(self) -> bool:
        """Whether the last failed opening is this caller's answer too: it tried as long as this caller would
        have (its caller's deadline did not cut it short, or that deadline is no sooner than this caller's,
        ``permits._deadline``), or this caller is past the point of giving up anyway. One that its caller's
        deadline cut shorter than this caller's would be is not: a caller without a deadline gets its whole
        retries."""
        theirs = self._open_failure_gave_up_at
        if theirs is None:
            return True
        mine = give_up_at(self._grace)
        return mine is not None and (mine <= theirs + SAME_DEADLINE_SECONDS or monotonic() >= mine)

    async def _open(self) -> None:
        revision = await self._with_retries(self._schema_revision)
        if self._settings.pooler == "transaction":
            await self._with_retries(self._check_pooled_timeouts)
        if self._dialect.name == "mysql":
            # Which server the URL reached decides the statements: MySQL lacks INSERT ... RETURNING, and
            # a node of a multi-primary cluster must get one statement per request (dialects/mysql.py).
            try:
                variables = await self._with_retries(self._probe_replication)
            except (StorageUnavailable, StorageReadOnly):
                raise
            except StorageError as exc:  # an engine that speaks MySQL but does not answer this (Vitess, say)
                logger.warning("cannot tell whether %s is a multi-primary cluster node (%s)", self.url, exc)
                variables = []
            multi_primary = is_multi_primary(variables)
            engine_dialect = self._engine.dialect
            version = getattr(engine_dialect, "server_version_info", None)
            is_mariadb = getattr(engine_dialect, "is_mariadb", True)
            no_line = without_line(variables)
            self._use_dialect(mysql_family_dialect(is_mariadb, multi_primary, version, no_line=no_line))
        head = _schema.head()
        if revision != head:
            if _schema.newer_than_this_code(revision):
                raise _schema.newer_schema(self.url, revision)
            if not self._settings.auto_upgrade:
                raise _schema.outdated(self.url, revision)
            # DDL, which may wait on the tables' locks for as long as the server lets it: never cut short, nor
            # left unretried, for one caller's deadline (it is done once, for every caller).
            with without_caller_deadline():
                await self._with_retries(self._upgrade)
        if self._dialect.name == "postgresql":
            with without_caller_deadline():
                await self._with_retries(self._call_server_functions)
        self._opened = True

    async def close(self) -> None:
        # In a forked child, the parked connections and the pool are the parent's: closing them would end
        # the parent's sessions over the sockets both processes hold. They are left as they are.
        self._renew_if_forked()
        self._check_loop()  # a closed loop's connections cannot be closed in this one: they are let go
        with self._park_mutex:
            self._closed = True  # under the guard: no connection is parked after this (_park)
        await self._unpark_into_pool()
        if self._listener is not None:
            await self._listener.close()
        await self._engine.dispose()
        if self._direct is not None:
            self._direct.close()

    async def upgrade_schema(self) -> str:
        if self._closed:
            raise UsageError("this client is closed")
        self._renew_if_forked()
        self._check_loop()
        revision: str = await self._with_retries(self._upgrade)
        self._opened = False
        await self.open()
        return revision

    async def drop_old_functions(self, dry_run: bool) -> list[str]:
        """Drop the server functions of other versions of permits (dialects/pg_functions.py): every
        ``permits_<statement>_<hash>`` function in the schemas of the role's search_path, that it may drop,
        that this version does not make. Returns them, schema-qualified with their arguments; with
        ``dry_run``, only lists them. Nothing on databases without server functions."""
        if self._closed:
            raise UsageError("this client is closed")
        if self._dialect.name != "postgresql":
            return []
        await self.open()
        plain = self._before_functions or self._dialect
        current = [f.name for f in server_functions(plain, POOLED_FUNCTIONS)]
        # Every attempt's finds: when the reply to a COMMIT that dropped them is lost, the retry finds none left,
        # and the answer must still name them.
        found: dict[str, None] = {}
        await self._with_retries(functools.partial(self._drop_old_functions, current, dry_run, found))
        if found and not dry_run:
            logger.info("dropped %d server functions of other versions of permits at %s", len(found), self.url)
        return list(found)

    async def _drop_old_functions(self, current: list[str], dry_run: bool, found: dict[str, None]) -> None:
        # One transaction: all of them are dropped, or (a role's refusal, a lost connection) none.
        async with self._engine.connect() as conn, conn.begin():
            rows = await conn.execute(text(OLD_FUNCTIONS), {"pattern": FUNCTION_NAME_PATTERN, "current": current})
            old = [str(row[0]) for row in rows]
            found.update(dict.fromkeys(old))
            if not dry_run:
                driver = await async_driver_connection(conn)
                for function in old:  # a name as PostgreSQL quoted it, with argument types: no parameters
                    await driver.execute(f"DROP FUNCTION IF EXISTS {function}")

    @contextlib.asynccontextmanager
    async def _bounded(self, conn: AsyncConnection) -> AsyncIterator[None]:
        """The reply deadline over the statements sent on ``conn`` in the block, as over an operation's: for
        the statements a client sends when it opens, which a stalled link would otherwise hold for as long
        as TCP takes to give up. Not around migrations or the making of server functions, whose DDL may wait
        on the tables' locks for as long as the server lets it."""
        driver = await async_driver_connection(conn)
        watch = async_watch_reply(self._dialect.reply_socket(driver), self._reply_bound())
        try:
            yield
        finally:
            if async_unwatch_reply(watch):
                self._note_cut(driver, [])

    async def _schema_revision(self) -> str | None:
        async with self._engine.connect() as conn, self._bounded(conn):
            await conn.execution_options(**{READONLY: True})
            async with conn.begin():
                revision: str | None = await async_run_sync(conn, _schema.current)
                return revision

    async def _check_pooled_timeouts(self) -> None:
        """Behind a transaction pooler the session settings permits makes elsewhere must come from the
        server (``ALTER ROLE``): say so when they do not. Without the timeouts a transaction frozen while it
        holds a semaphore's row (a client stopped half-way through a multi-semaphore acquire) holds up every
        grant on that semaphore until the pooler or TCP ends it, instead of for 30 s at most. Without
        ``client_connection_check_interval`` (PostgreSQL 14+) a waiter killed in a semaphore's line is granted
        a permit for nobody, held until its TTL (dialects/pg_functions.py)."""
        async with self._engine.connect() as conn, self._bounded(conn):
            row = (await conn.execute(self._dialect.clause("SESSION_TIMEOUTS"))).one()
            fixes = []
            for fix in self._dialect.pooled_settings_fixes(tuple(row), self._settings.lock_wait_timeout):
                # Advise only what the server takes: a warning whose fix fails would never go away.
                if await self._server_takes(conn, fix):
                    fixes.append(fix.statement)
            await conn.rollback()  # and with it every value tried
        if fixes:
            logger.warning(
                "through a transaction pooler permits cannot make its session settings, and the server lacks"
                " some at %s: a transaction frozen while it holds a semaphore's row would hold up the semaphore"
                " until the pooler or TCP ends it, or a waiter killed in a semaphore's line would be granted a"
                " permit for nobody. Set them on the server: %s (docs/deployment.md, Poolers)",
                self.url,
                " ".join(fixes),
            )

    async def _server_takes(self, conn: AsyncConnection, fix: SettingFix) -> bool:
        """Whether the server accepts ``fix``'s value, tried in ``conn``'s transaction (``SETTING_TRY``)."""
        try:
            async with conn.begin_nested():
                await conn.execute(self._dialect.clause("SETTING_TRY"), {"name": fix.name, "value": fix.value})
        except DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", None) != INVALID_PARAMETER_VALUE:
                raise
            return False
        return True

    async def _call_server_functions(self) -> None:
        """Use permits' server functions on PostgreSQL (dialects/pg_functions.py), creating those that are
        missing: the queued grant, through which waiters queue in the server's lock queue; and behind a
        transaction pooler also the grant and the release, whose plans each server session keeps. Each one
        the role may not create or execute is left out, with a warning: the client sends the statement, or
        its waiters wait as elsewhere."""
        pooled = self._settings.pooler == "transaction"
        # Made from the statements themselves, also when a second open (a retry, another thread, the one
        # after an upgrade) finds calls swapped in already: a function must never wrap a call of another.
        plain = self._before_functions or self._dialect
        functions = server_functions(plain, POOLED_FUNCTIONS if pooled else DIRECT_FUNCTIONS)
        found = await self._probe_functions(functions)
        if any(state == "missing" for state, _ in found):
            for function, (state, _) in zip(functions, found, strict=True):
                if state == "missing" and not await self._create_function(function):
                    break  # the others would fail the same way
            found = await self._probe_functions(functions)  # as they are now, whoever made them
        states = [state for state, _ in found]
        unusable = [(f, state) for f, state in zip(functions, states, strict=True) if state != "callable"]
        if unusable:
            fixes = {
                "denied": "the role may not execute it: GRANT EXECUTE ON FUNCTION {} to it",
                "foreign": "a function of that name is not the one permits makes, or its owner is not trusted (the"
                " role itself, the tables' owner or a superuser): DROP FUNCTION {}, and permits will make its own",
                "missing": "it is missing",
            }
            _warn_once(
                "permits' server functions at %s cannot be used (%s): %s (docs/deployment.md, Server functions)",
                self.url,
                "; ".join(f"{f.name}: {fixes[state].format(f.signature)}" for f, state in unusable),
                _WITHOUT_FUNCTIONS,
            )
        # Each call names the schema of the function the probe checked.
        usable = {
            f.statement: f.call_in(schema)
            for f, (state, schema) in zip(functions, found, strict=True)
            if state == "callable" and schema is not None  # always, for a function found
        }
        self._before_functions = plain
        self._swap_in(usable)

    def _swap_in(self, calls: dict[str, str]) -> None:
        """Send ``calls`` (of server functions, by the statement each replaces) instead of the statements."""
        plain = self._before_functions or self._dialect
        self._function_calls = calls
        self._use_dialect(plain.with_statements(calls) if calls else plain)

    def _use_dialect(self, dialect: Dialect) -> None:
        self._dialect = dialect
        self._compiled = (dialect, {})

    def _lose_function(self, gone: _CallGone) -> None:
        """A call of a server function failed because the function is gone or refused at run time (dropped,
        by ``permits db drop-old-functions`` say, or its schema; its EXECUTE revoked; the queued grant on an
        engine without advisory locks). From now on this store sends the statement instead of that call, as
        where the function could not be made: behind a transaction pooler the grant or the release
        unprepared; for the queued grant, its waiters wait without the line. Calls sent before this one
        failed may fail the same way: each then finds it done already."""
        if gone.statement not in self._function_calls:
            return
        self._swap_in({k: v for k, v in self._function_calls.items() if k != gone.statement})
        _warn_once(
            "permits' server function for %s at %s failed (%s): the client sends the statement instead from now"
            " on (docs/deployment.md, Server functions)",
            gone.statement,
            self.url,
            gone.reason,
        )

    async def _probe_functions(self, functions: list[ServerFunction]) -> list[tuple[str, str | None]]:
        """What the database has of each of ``functions``, and in which schema: see ``pg_functions.PROBE``."""
        params = {
            "signatures": [f.signature for f in functions],
            "sources": [f.source for f in functions],
            "results": [f.result for f in functions],
        }
        async with self._engine.connect() as conn, self._bounded(conn):
            found = [(str(state), schema) for state, schema in (await conn.execute(text(PROBE), params))]
            await conn.rollback()
        return found

    async def _create_function(self, function: ServerFunction) -> bool:
        """Create ``function``; whether it may exist now. Another client may create it at the same moment:
        then this one's CREATE fails on the name, and the probe that follows says what the other made. Any
        other refusal leaves it out (with a warning): permits works without its functions, only slower."""
        async with self._engine.connect() as conn:
            try:
                async with conn.begin():
                    # On the driver's connection: the definition is sent as it is, with no parameters.
                    await (await async_driver_connection(conn)).execute(function.definition)
            except Exception as exc:
                error = driver_error(self._engine, exc)
                if error is None:
                    raise
                state = getattr(error.orig, "sqlstate", None)
                if state in CREATED_MEANWHILE:
                    return True
                if self._dialect.classify(error).retryable:  # a lost connection, a lock wait: open() retries
                    raise error from exc
                if state == READ_ONLY:
                    why = "the server takes no writes"
                elif state in MAY_NOT_CREATE:
                    why = (
                        "let the role create functions in its schema, or run `permits db upgrade` once (with the"
                        " same ?pooler=) as a role that may"
                    )
                else:
                    why = f"the server refused it (SQLSTATE {state})"
                _warn_once(
                    "cannot create permits' server functions at %s (%s): %s; %s (docs/deployment.md, Server functions)",
                    self.url,
                    str(error.orig).strip(),
                    _WITHOUT_FUNCTIONS,
                    why,
                )
                return False
        logger.info("created the server function %s at %s", function.name, self.url)
        return True

    async def _probe_replication(self) -> list[tuple[str, str]]:
        async with self._engine.connect() as conn, self._bounded(conn):
            result = await conn.exec_driver_sql(MULTI_PRIMARY_PROBE)
            found: list[Any] = list(result.fetchall())  # (Variable_name, Value)
            rows = [(_text(name), _text(value)) for name, value in found]
            await conn.rollback()
            return rows

    async def _upgrade(self) -> str:
        async with self._engine.connect() as conn, conn.begin():
            revision: str = await async_run_sync(conn, functools.partial(_schema.upgrade, where=self.url))
            return revision

    # ------------------------------------------------------------------------------------------ operations

    async def try_acquire(
        self,
        owner: str,
        key: str,
        wants: Sequence[Want],
        ttl_ms: int,
        wait: float = 0.0,
        recheck: bool = True,
        in_line: bool = False,
        new_only: bool = False,
        request_id: str | None = None,
    ) -> Lease | None:
        # This store never waits for room (the client's loop does); ``wait`` bounds how long it keeps
        # retrying lock conflicts, so a caller's timeout holds behind a frozen lock holder. An attempt
        # ``in_line`` waits for its turn in the server's lock queue first, where it can (queues_in_line).
        lines = self._host_lines()
        if in_line and wait > 0 and lines is not None:
            return await self._try_in_host_line(
                lines, owner, key, wants, ttl_ms, wait, recheck, new_only=new_only, request_id=request_id
            )
        return await self._try_acquire(
            owner, key, wants, ttl_ms, wait, recheck, in_line, new_only=new_only, request_id=request_id
        )

    async def _try_acquire(
        self,
        owner: str,
        key: str,
        wants: Sequence[Want],
        ttl_ms: int,
        wait: float,
        recheck: bool,
        in_line: bool = False,
        queue: bool = True,
        new_only: bool = False,
        request_id: str | None = None,
    ) -> Lease | None:
        """``try_acquire`` outside the lines beside a SQLite database. ``queue=False``: a refused request
        takes no place in a fair queue even though it waits (it waits in such a line, which orders it)."""
        deadline = monotonic() + wait if wait > 0 else None
        # A caller that waits keeps a place in the queue of each fair semaphore it asks for.
        queue_ms = PLACE_MS if wait > 0 and queue else 0
        tries = 0
        place = self._queued.get((owner, key))
        queued = place is not None
        # On PostgreSQL a place records this store's wake channel, to be called when its turn comes. One
        # recorded before the listener was up is recorded again, with the channel, by a full recheck.
        wake = None if self._listener is None else self._listener.wake_channel
        if place is not None and wake is not None and not place[1]:
            recheck = True

        full = recheck
        polls = place is not None and not place[1] and place[0] is not None and place[0] > 0
        if polls and not recheck and self._dialect.cheaper_readonly:
            # A queued waiter that polls (no release calls it) reads its place before it asks, where a read
            # takes no lock: while it is still short the attempt would be refused, and on SQLite every
            # attempt takes the database's one write lock from the grants and releases it waits for. Fair
            # mode at 64 clients: +20% on SQLite. On MariaDB it was measured slower and less fair, so
            # there the waiter asks as before (docs/benchmarks.md, "Polling a fair queue by reading").
            short = await self._read_place(owner, key, deadline)
            if short is not None and short > 0:
                self._queued[(owner, key)] = (short, False)
                return None
        # A waiter in the line holds a connection while it waits there: a few at a time per store, so that
        # its releases (and everything else) always find one. The others ask outside the line.
        in_line = in_line and self._take_line_seat()
        # A grant that would wait in the line asks outside it first, granted only while nobody is in it: an
        # uncontended grant then skips the queued grant's function (ACQUIRE_ONE_LINE_FREE). Where that was
        # refused lately, the line is usually busy, and asking outside it would cost a round trip more.
        line_free_first = in_line and self._line_free_first(wants)

        def attempt() -> Flow[Lease | flows.Queued | flows.AskInLine | None]:
            nonlocal tries, full
            tries += 1
            # After a lost connection the last attempt may have been granted with its reply lost: only
            # the full recheck finds that lease under the key.
            full = recheck or tries > 1
            # The whole attempt, its wait in the line included, within what is left of the caller's time (a
            # retry after a conflict or a lost connection gets less) and the lock wait bound. A retry asks
            # outside the line: a grant over several semaphores whose wait in the line timed out (a session
            # holds it up, or a statement_timeout bounds the wait) fails into a retry, and must then be able
            # to take room that is free. (The queued grant of one semaphore refuses instead, so it retries
            # only after other failures, and then outside the line too.)
            left = wait if deadline is None else max(0.0, deadline - monotonic())
            # With no time left (a zero timeout: one attempt) there is no waiting in a line either.
            lined = in_line and tries == 1 and left > 0
            line_wait_ms = round(min(left, self._settings.lock_wait_timeout) * 1000) if lined else None
            # A wait for a row lock within the caller's time too (a try, with none, waits the session's).
            lock_wait_ms = max(1, round(left * 1000)) if 0 < left < self._settings.lock_wait_timeout else None
            request = flows.Request(
                owner,
                key,
                wants,
                ttl_ms,
                queue_ms,
                queued,
                wake,
                line_wait_ms,
                round(LINE_HEAD_WAIT_SECONDS * 1000),
                line_free_first=lined and line_free_first,
                new_only=new_only,
                request_id=request_id,
                lock_wait_ms=lock_wait_ms,
            )
            return flows.try_acquire(self._dialect, request, recheck=full)

        faults: list[Fault] = []
        # A try that does not wait is not retried after a conflict that made its attempt wait (about a lock
        # wait: a row lock that a frozen or forgotten session holds): each retry would wait the whole lock wait
        # again, and try_acquire took 30 s to say StorageConflict. A quick conflict (a deadlock, a
        # serialization failure) is still retried.
        slow = None if deadline is not None else SLOW_CONFLICT_SHARE * self._settings.lock_wait_timeout
        with self._kept_if_interrupted(owner, key, queue_ms):
            try:
                result: Any = await self._run(
                    attempt, deadline=deadline, faults=faults, slow_conflict=slow, bounds_lock_wait=True
                )
                if isinstance(result, flows.AskInLine):
                    # Not granted outside the line, and nothing written: ask in it, as a first attempt.
                    self._note_line_busy(wants[0].name)
                    tries, line_free_first = 0, False
                    result = await self._run(
                        attempt, deadline=deadline, faults=faults, slow_conflict=slow, bounds_lock_wait=True
                    )
            except KeyInUse as exc:
                if request_id is not None or Fault.UNAVAILABLE not in faults:
                    raise
                # A try before lost its connection, perhaps with its grant committed and the reply lost: the lease
                # under the key may be this request's own, which a request for a new lease only cannot tell from
                # another's. Not another's for sure, so not KeyInUse: the outcome is unknown.
                raise StorageUnavailable(
                    f"the connection to the database was lost while a request for a new lease under key {key!r} ran;"
                    " whether it was granted is unknown (if it was, the lease runs out at its TTL)",
                    url=self.url,
                    key=key,
                    owner=owner,
                ) from exc
            except StorageConflict:
                # Lock conflicts outlasted the caller's time. A try before them (an attempt, or a step it went on
                # to, such as the grant after a reclaim) may have lost its connection with its grant committed
                # and the reply lost: then the answer is the lease under the key, not "no room", which would
                # leave that lease holding its permits, unknown to anyone, until its TTL.
                granted = await self._lease_under(owner, key, wants, new_only, request_id)
                if granted is None:
                    raise
                result = granted
            finally:
                if in_line:
                    self._leave_line_seat()
            if isinstance(result, flows.Queued):
                # Only a full attempt records (or refreshes) the place, and with it the wake channel. Remembered
                # before anything else is awaited: a waiter interrupted from here on gives it up.
                called = wake is not None if full else place is not None and place[1]
                self._remember_place(owner, key, result.short, called)
        if isinstance(result, flows.Queued):
            if self._listener is not None:
                # Listen for calls (from now on, if not yet), so that an attempt can record where to call
                # this waiter.
                self._listener.want_calls()
                if wake is None:
                    await self._listener.start()
            return None
        if result is not None:
            self._queued.pop((owner, key), None)
        elif queued and not recheck:
            self._queued.pop((owner, key), None)  # its place lapsed: the next full recheck takes another
        lease: Lease | None = result
        return lease

    def _host_lines(self) -> HostLines | None:
        """The lines beside a SQLite database (stores/host_lines.py), where there are some."""
        return None if self._direct is None else self._direct.lines

    async def _try_in_host_line(
        self,
        lines: HostLines,
        owner: str,
        key: str,
        wants: Sequence[Want],
        ttl_ms: int,
        wait: float,
        recheck: bool,
        **options: Any,
    ) -> Lease | None:
        """``try_acquire`` in the semaphore's line beside a SQLite database, as PostgreSQL's queued grant in
        the server's: the attempt waits for its turn (within ``wait`` and the lock wait bound), then asks;
        refused, it stays at the head, reading the semaphore until it sees room and asking again, then lets
        the next one have the turn. While nobody is in the line it asks at once (taking no place), and the
        turn is only taken when that is refused: asking outside a busy line would take the room the line is
        owed.

        In the line, the line orders the waiters, so on a fair semaphore they take no place in its fair
        queue: the room they see is what the live places leave (``flows.open_room``), and the gate lets them
        through exactly then. The head waits for room up to ``LINE_HEAD_WAIT_SECONDS``, and that wait starts
        again each time fewer places than it has seen are left (the queue ahead of it moves). When it runs
        out on a fair semaphore, the head asks once more taking a place, and leaves the line: the fair queue
        orders it from then on, and the client's loop waits by its place (``permits._pacing``). Requests
        that do not use the line (larger counts, several semaphores, asyncio clients, the service) wait in
        that queue all along."""
        line, name, count = semaphore_line(wants[0].name), wants[0].name, wants[0].count
        if not lines.usable():  # given up for a while after a failure: wait as without the lines
            return await self._try_acquire(owner, key, wants, ttl_ms, wait, recheck, **options)
        deadline = monotonic() + wait
        asked = not lines.busy(line)
        if asked:
            lease = await self._try_acquire(owner, key, wants, ttl_ms, wait, recheck, queue=False, **options)
            if lease is not None or self.holds_place(owner, key):
                return lease  # granted, or ordered by a fair queue already, which the client's loop waits in
            recheck = False
        patience = max(0.0, min(deadline - monotonic(), self._settings.lock_wait_timeout))
        with lines.turn(line, patience) as had:
            head_until = monotonic() + LINE_HEAD_WAIT_SECONDS
            fewest_places: int | None = None
            # A waiter whose turn did not come waits in the fair queue instead. (Only a full recheck takes a
            # place: the refusal of a quick attempt is a bare "no".)
            queue = not had
            recheck = recheck or queue
            # Refused a moment ago, outside the line: with the turn, read before asking again (a read takes
            # no write lock), as the head does.
            ask = queue or not asked
            while True:
                left = deadline - monotonic()
                if left <= 0:
                    return None
                if ask:
                    lease = await self._try_acquire(owner, key, wants, ttl_ms, left, recheck, queue=queue, **options)
                    recheck = False
                    if lease is not None or queue or self.holds_place(owner, key):
                        return lease
                ask = True
                # At the head: wait for room, reading, until the head's time is up.
                while True:
                    await async_sleep(HOST_LINE_POLL_SECONDS)
                    now = monotonic()
                    if now >= deadline:
                        return None
                    room = await self._run(lambda: flows.open_room(name), readonly=True, deadline=deadline)
                    if room.free >= count:
                        break
                    if fewest_places is None or room.places < fewest_places:
                        if fewest_places is not None:
                            head_until = now + LINE_HEAD_WAIT_SECONDS  # a place ahead was served (or left)
                        fewest_places = room.places
                    if now >= head_until:
                        if not room.fair:
                            return None
                        queue = recheck = True  # one more try, which takes a place in the fair queue if refused
                        break

    @contextlib.contextmanager
    def _kept_if_interrupted(self, owner: str, key: str, queue_ms: int) -> Iterator[None]:
        """Around an attempt that may take places in fair queues: if it is interrupted (cancelled, Ctrl-C),
        remember that it may hold them, so that ``dequeue`` gives them up. Its transaction may have committed
        with the reply still on the way, and a place nobody knows of holds up its queue until it lapses."""
        try:
            yield
        except BaseException as exc:
            if queue_ms and not isinstance(exc, Exception) and (owner, key) not in self._queued:
                self._remember_place(owner, key, None, False)
            raise

    def _remember_place(self, owner: str, key: str, short: int | None, called: bool) -> None:
        self._queued[(owner, key)] = (short, called)
        self._queued.move_to_end((owner, key))
        if len(self._queued) > MAX_REMEMBERED_PLACES:
            self._queued.popitem(last=False)

    @property
    def default_ttl_ms(self) -> int | None:
        return None  # the client's own

    @property
    def hands_over(self) -> bool:
        """Whether ``hand_over`` can release and grant together in one statement here (``HAND_OVER``)."""
        return self._dialect.has("HAND_OVER")

    async def hand_over(
        self,
        name: str,
        gone: Sequence[tuple[str, str]],
        requests: Sequence[tuple[str, str, int]],
        wait: float | None = None,
    ) -> flows.HandedOver:
        """Group commit: release the leases ``gone`` (owner, key), each over ``name`` alone, and grant
        ``requests`` (owner, key, ttl_ms) for one permit each of ``name``, in the order given, in one
        statement (``flows.hand_over``). ``wait`` bounds how long lock conflicts are retried, as in
        ``try_acquire``; ``None``, releases only: retried as a release's are."""
        asked = [flows.Request(owner, key, [Want(name, 1)], ttl_ms) for owner, key, ttl_ms in requests]
        deadline = None if wait is None else monotonic() + wait
        tries = 0

        def attempt() -> Flow[flows.HandedOver]:
            nonlocal tries
            tries += 1
            return flows.hand_over(name, gone, asked)

        try:
            handed: flows.HandedOver = await self._run(attempt, deadline=deadline, persist=wait is None)
        except StorageConflict:
            if tries < 2:
                raise
            # Sent again after a lost connection, then refused for a conflict: the turn before may have
            # committed, its grants and releases with it. Nothing can be said of any of them, so none is
            # answered with the conflict (a waiter past its deadline would take it for "no room" while its key
            # held a lease): the requests ask alone, and the releases are released alone, which says what
            # each one is.
            return flows.HandedOver(released=[False] * len(gone), leases=[None] * len(asked), ask_alone=True)
        if tries > 1 and not handed.ask_alone and not all(handed.leases):
            # After a lost connection the turn before may have granted a request, its reply lost, and taken
            # the room this one found missing: only a request asking alone, with its full recheck, finds that
            # lease under its key (as try_acquire's retry does).
            handed = dataclasses.replace(handed, ask_alone=True)
        return handed

    async def _lease_under(
        self, owner: str, key: str, wants: Sequence[Want], new_only: bool, request_id: str | None
    ) -> Lease | None:
        """The lease an earlier try of this acquire got, if one did and it is still held: one read, which no
        row lock holds up, and no retry past the caller's time (a read that fails is no answer). For a
        request for a new lease only, only a lease that records its ``request_id`` (another request's is
        ``KeyInUse``, an ``IdempotencyConflict``: its next attempt says)."""
        try:
            found = await self._attempt(flows.find_lease(owner, key), True, [])
            if found is None:
                return None
            existing, got_by = found
            return decide.replay(existing, wants, new_only, own=request_id is not None and got_by == request_id)
        except (LeaseLost, IdempotencyConflict, DBAPIError):
            return None

    async def _read_place(self, owner: str, key: str, deadline: float | None) -> int | None:
        """How many permits a queued request is short of fitting now, read without a lock; ``None`` when it
        holds no live place (it lapsed: the attempt then finds out, as it would have without the read).
        Within the caller's time, like the attempt it stands for (a locked database is not retried past it)."""
        place = await self._run(
            lambda: flows.queue_place(owner, key, alone=self._dialect.free_autocommit), readonly=True, deadline=deadline
        )
        return None if place is None else place.short

    def _line_free_first(self, wants: Sequence[Want]) -> bool:
        """Whether an attempt that waits in the line for ``wants`` asks outside it first (see try_acquire):
        one permit of one semaphore, not behind a transaction pooler (where the statement could not be
        prepared, and the line's own function would be the cheaper call), and no busy line seen lately."""
        if len(wants) != 1 or not self._prepare or not self._dialect.has("ACQUIRE_ONE_LINE_FREE"):
            return False
        return monotonic() >= self._line_busy_until.get(wants[0].name, 0.0)

    def _note_line_busy(self, name: str) -> None:
        if len(self._line_busy_until) >= REMEMBERED_BUSY_LINES:
            self._line_busy_until.clear()
        self._line_busy_until[name] = monotonic() + LINE_BUSY_SECONDS

    def _take_line_seat(self) -> bool:
        with self._seats_mutex:
            if self._in_line_now >= LINE_SEATS:
                return False
            self._in_line_now += 1
            return True

    def _leave_line_seat(self) -> None:
        with self._seats_mutex:
            # Never below none: a task that a closed event loop left behind may give its seat back after
            # the count was started afresh in the next loop (``_check_loop``).
            self._in_line_now = max(0, self._in_line_now - 1)

    def queues_in_line(self, wants: Sequence[Want]) -> bool:
        """Whether an attempt for ``wants`` can wait for its turn in the server's lock queue: PostgreSQL's
        queued grants, for one permit of one semaphore or for several semaphores (see
        ``dialects/pg_functions.py``; where the latter could not be made, ``LINES_ENTER`` and the grant in one
        transaction), while this store has a seat in the lines for it
        (``LINE_SEATS``; a waiter without one waits as elsewhere). Not one semaphore with a larger count: the
        queued grant waits at the head of the line, and would hold it while single permits came back behind
        it."""
        lines = self._host_lines()
        if len(wants) == 1 and wants[0].count == 1 and lines is not None:
            # the semaphore's line beside a SQLite database, where waiting holds no connection (while the lines
            # are used: not after a failure to keep them, see host_lines.RETRY_AFTER)
            return lines.usable()
        if len(wants) == 1:
            queues = wants[0].count == 1 and (self._dialect.has("ACQUIRE_ONE_QUEUED") or self._dialect.has("LINE_WAIT"))
        else:
            queues = self._dialect.has("LINES_ENTER")
        return queues and self._in_line_now < LINE_SEATS  # see try_acquire

    def queue_short(self, owner: str, key: str) -> int | None:
        """How many permits a waiting request was short of fitting at its last attempt, in its fair queues
        (see ``flows.Queued``); ``None`` when it holds no place this store knows of."""
        place = self._queued.get((owner, key))
        return None if place is None else place[0]

    def holds_place(self, owner: str, key: str) -> bool:
        """Whether this store put the request in a fair queue, and it was not granted since (its shortfall may
        be unknown: see ``queue_short``)."""
        return (owner, key) in self._queued

    def place_called(self, owner: str, key: str) -> bool:
        """Whether the request's places in fair queues record this store's wake channel: then a release
        calls it when its turn comes (see ``listener.py``), and it need not poll."""
        place = self._queued.get((owner, key))
        return place is not None and place[1]

    async def dequeue(self, owner: str, key: str) -> None:
        # Only a request this store put in a queue has a place to give up: a timeout on any other costs
        # nothing (behind a frozen lock holder, a write here would wait on that lock once more).
        if self._queued.pop((owner, key), False) is not False:
            # Within a lock wait: a place not given up lapses anyway (PLACE_MS), and a caller that stops waiting
            # (a timeout, Ctrl-C, a database that hangs) is not to wait through every retry for it.
            deadline = monotonic() + self._settings.lock_wait_timeout
            await self._run(lambda: flows.dequeue(owner, key), deadline=deadline)

    async def waiters(self, name: str) -> list[Waiter]:
        return await self._run(lambda: flows.waiters(name), readonly=True)

    def wake_calls(self, names: Sequence[str]) -> int | None:
        """How many calls about ``names`` this store's wake channel has had (PostgreSQL: see
        ``listener.py``), for ``wait_for_room``'s ``since``; ``None`` when it has no wake channel (yet)."""
        return None if self._listener is None else self._listener.called(names)

    async def wait_for_room(self, names: Sequence[str], seconds: float, since: int | None = None) -> bool:
        if self._listener is not None:
            return await self._listener.wait(names, seconds, since)
        await async_sleep(seconds)
        return False

    async def release(
        self, owner: str, key: str, one_semaphore: bool = False, request_id: str | None = None
    ) -> ReleaseOutcome:
        if request_id is not None:
            return await self._run(lambda: flows.release_own(self._dialect, owner, key, request_id), persist=True)
        return await self._run(lambda: flows.release(self._dialect, owner, key, one_semaphore), persist=True)

    async def extend(self, owner: str, key: str, ttl_ms: int | None) -> Lease:
        settings = self._settings  # its ttl: for a lease granted before leases kept their TTL
        return await self._run(
            lambda: flows.extend(owner, key, ttl_ms, settings.ttl_ms, settings.max_ttl_ms), persist=True
        )

    async def revoke(self, owner: str, key: str, note: str) -> Lease:
        return await self._run(lambda: flows.revoke(owner, key, note))

    async def get_lease(self, owner: str, key: str) -> Lease:
        return await self._run(lambda: flows.get_lease(owner, key), readonly=True)

    async def holders(self, name: str) -> list[Holder]:
        return await self._run(lambda: flows.holders(name), readonly=True)

    async def create_semaphore(
        self, name: str, capacity: int, by: str, exist_ok: bool, fair: bool = False
    ) -> Semaphore:
        return await self._run(lambda: flows.create_semaphore(name, capacity, by, exist_ok, fair))

    async def get_semaphore(self, name: str) -> Semaphore:
        return await self._run(lambda: flows.get_semaphore(name), readonly=True)

    async def list_semaphores(self, prefix: str) -> list[Semaphore]:
        return await self._run(lambda: flows.list_semaphores(prefix), readonly=True)

    async def set_capacity(self, name: str, capacity: int, by: str, reason: str) -> CapacityChange:
        return await self._run(lambda: flows.set_capacity(name, capacity, by, reason))

    async def capacity_history(self, name: str, limit: int) -> list[CapacityChange]:
        return await self._run(lambda: flows.capacity_history(name, limit), readonly=True)

    async def delete_semaphore(self, name: str, force: bool) -> int:
        return await self._run(lambda: flows.delete_semaphore(name, force))

    async def ping(self) -> None:
        revision = await self._run(flows.schema_probe, readonly=True)
        # A newer revision is a rolling upgrade under way: a running client keeps working on it
        # (docs/deployment.md), so it is no reason to stop sending it traffic.
        if revision != _schema.head() and (revision is None or not _schema.newer_than_this_code(revision)):
            # The tables are gone, or older than this client needs: the database was emptied, or replaced
            # by an older one. Every operation would fail.
            raise _schema.outdated(self.url, revision)

    async def count_held_leases(self, identity: str) -> int:
        """Held leases whose owner is ``identity`` or starts with ``identity/`` (the service's quota)."""
        return await self._run(lambda: flows.count_held(identity), readonly=True)

    async def sweep(self, batch_size: int, max_batches: int | None) -> SweepResult:
        # One short transaction per batch: a sweep never holds locks for long. The caller's deadline (the
        # client's timeout) ends it between batches, as max_batches does: the first batch always runs, and
        # what the batches ended is returned, marked incomplete. A batch over a link that hangs gives up
        # within the deadline's grace, as every call does.
        deadline = CALLER_DEADLINE.get()
        keys: list[tuple[str, str]] = []
        batches = 0
        complete = False
        while max_batches is None or batches < max_batches:
            found, ended = await self._run(lambda: flows.sweep_batch(batch_size))
            if found:
                batches += 1
                keys.extend(ended)
            if found < batch_size:
                complete = True
                break
            if deadline is not None and monotonic() >= deadline:
                break
        return SweepResult(leases=len(keys), batches=batches, keys=keys, complete=complete)

    # ---------------------------------------------------------------------- service maintenance (SQL only)

    async def leases_per_semaphore(self) -> dict[str, int]:
        return await self._run(flows.leases_per_semaphore, readonly=True)

    async def held_owners(self) -> list[str]:
        return await self._run(flows.held_owners, readonly=True)

    async def end_owner_leases(self, owner: str, reason: EndReason, note: str, batch_size: int) -> list[str]:
        keys: list[str] = []
        while True:
            ended = await self._run(lambda: flows.end_owner_leases(owner, reason, note, batch_size))
            keys.extend(ended)
            if len(ended) < batch_size:
                return keys

    async def end_stale(self, max_age_ms: int, note: str, batch_size: int) -> SweepResult:
        keys: list[tuple[str, str]] = []
        batches = 0
        while True:
            found, ended = await self._run(lambda: flows.end_stale_batch(max_age_ms, note, batch_size))
            batches += 1 if found else 0
            keys.extend(ended)
            if found < batch_size:
                return SweepResult(leases=len(keys), batches=batches, keys=keys)

    async def delete_ended_leases(self, older_than_ms: int, batch_size: int) -> int:
        # One short transaction per batch: cleanup never holds locks for long.
        total = 0
        while True:
            deleted = await self._run(lambda: flows.delete_ended_batch(older_than_ms, batch_size))
            total += deleted
            if deleted < batch_size:
                return total

    async def purge_waiters(self, age_ms: int) -> int:
        return await self._run(lambda: flows.purge_waiters(age_ms))

    async def delete_capacity_history(self, older_than_ms: int, batch_size: int) -> int:
        total = 0
        while True:
            deleted = await self._run(lambda: flows.delete_history_batch(older_than_ms, batch_size))
            total += deleted
            if deleted < batch_size:
                return total

    async def run_flow(self, make_flow: Callable[[], Flow[T]], readonly: bool = False) -> T:
        """Run a flow (``permits._core``) in a transaction of its own, with the usual retries: how the
        service runs what only it needs, such as the dashboard's reads and an admin action with its log."""
        return await self._run(make_flow, readonly)

    async def reconcile(self, repair: bool) -> list[Drift]:
        drift = await self._run(flows.find_drift, readonly=True)
        if not repair:
            return drift
        # Each drift is repaired in a transaction of its own. None starts after the caller's deadline (the
        # client's timeout): those left are reported as found, not repaired, as a check reports them.
        deadline = CALLER_DEADLINE.get()
        repaired: list[Drift] = []
        for at, found in enumerate(drift):
            if deadline is not None and monotonic() >= deadline:
                repaired.extend(drift[at:])
                break
            fixed = await self._run(
                lambda name=found.name, field=found.field: flows.repair_drift(name, field)  # type: ignore[misc]
            )
            if fixed is not None:
                repaired.append(fixed)
        return repaired

    # --------------------------------------------------------------------------------------------- driver

    async def _run(
        self,
        make_flow: Callable[[], Flow[T]],
        readonly: bool = False,
        deadline: float | None = None,
        persist: bool = False,
        faults: list[Fault] | None = None,
        slow_conflict: float | None = None,
        bounds_lock_wait: bool = False,
    ) -> T:
        """Run a flow in a transaction of its own.

        Conflicts and lost connections are retried with backoff and jitter, each time with a fresh flow.
        That is safe because every write is idempotent: an acquire is keyed, a release and an extend check
        the lease's state, so a commit whose reply was lost is answered by the retry from what is stored.
        ``faults`` collects the faults that were retried.
        With a ``deadline`` (``monotonic()`` time), conflicts are not retried past it; with ``slow_conflict``
        (seconds), a conflict that came after its attempt ran that long is not retried. With ``persist``,
        conflicts are retried past ``retries``, for up to PERSIST_SECONDS: giving permits back must not
        fail because others are busy with the same semaphore (at REPEATABLE READ or SERIALIZABLE, every
        concurrent write to its row is a serialization failure). With ``bounds_lock_wait`` (a grant), on SQLite
        the wait for the database's write lock lasts no longer than the ``deadline`` leaves, where that is
        less than the lock wait bound (on the servers, the grant's statements carry that bound themselves,
        ``flows.Request.lock_wait_ms``).
        """
        await self.open()
        if persist and deadline is None:
            deadline = monotonic() + PERSIST_SECONDS
        own_cuts: list[_CutSession] = []  # this operation's attempts that the reply deadline cut
        try:
            return await self._retrying(
                make_flow, readonly, deadline, persist, own_cuts, faults, slow_conflict, bounds_lock_wait
            )
        finally:
            for cut in own_cuts:
                cut.abandoned = True

    async def _retrying(
        self,
        make_flow: Callable[[], Flow[T]],
        readonly: bool,
        deadline: float | None,
        persist: bool,
        own_cuts: list[_CutSession],
        faults: list[Fault] | None = None,
        slow_conflict: float | None = None,
        bounds_lock_wait: bool = False,
    ) -> T:
        """``_run``'s loop; the attempts the reply deadline cuts are noted in ``own_cuts``."""
        restarts = failures = lost = 0  # lost: lost connections retried
        first_flow, first_readonly = make_flow, readonly
        while True:
            check_given_up()  # before each try: see GIVEN_UP
            attempt_started = monotonic()
            try:
                if self._cut:
                    await self._end_cut_sessions(own_cuts)
                done = await self._attempt(make_flow(), readonly, own_cuts, deadline if bounds_lock_wait else None)
                if not isinstance(done, Then):
                    return done
                restarts += 1  # committed; the operation goes on in a transaction of its own
                if restarts > MAX_RESTARTS:
                    raise StorageError("an operation kept restarting; giving up", url=self.url)
                make_flow, readonly = done.flow, False
            except Restart as restart:
                restarts += 1
                if restarts > MAX_RESTARTS:
                    raise StorageError("an operation kept restarting; giving up", url=self.url) from None
                make_flow, readonly = restart.flow, restart.readonly
            except _CallGone as gone:
                # The call had no effect: it failed before the function ran, or its transaction rolled back
                # (a server function runs alone, as one statement in autocommit). Run the same flow again,
                # made anew, so with the statement in place of the call.
                restarts += 1
                if restarts > MAX_RESTARTS:
                    raise StorageError("an operation kept restarting; giving up", url=self.url) from gone.error
                self._lose_function(gone)
            except (DuplicateKey, Retry):
                # A flow met a duplicate it does not expect, or found it had read a state that a concurrent
                # commit had already moved on from. On a multi-primary cluster (Galera) a node may not yet
                # have applied a grant the cluster has ordered, and hand out its fencing token again;
                # certification would abort the transaction at COMMIT, but the permit row's unique token
                # hits the duplicate first. Either way it is a conflict: roll back and run the operation
                # again from its start, with backoff, a bounded number of times.
                make_flow, readonly = first_flow, first_readonly
                failures += 1
                if failures > self._settings.retries:
                    raise StorageConflict(
                        "an operation kept meeting a concurrent change (a duplicate key); giving up", url=self.url
                    ) from None
                if self.on_retry is not None:
                    self.on_retry(Fault.CONFLICT.value)
                await async_sleep(RETRY_BACKOFF.delay(failures))
            except DBAPIError as exc:
                waited = slow_conflict is not None and monotonic() - attempt_started >= slow_conflict
                failures = await self._backoff_or_raise(
                    exc,
                    failures,
                    deadline,
                    persist,
                    final_conflict=waited,
                    attempt_started=attempt_started,
                    first_lost_connection=lost == 0,
                )
                lost += self._dialect.classify(exc) is Fault.UNAVAILABLE
                if faults is not None:
                    faults.append(self._dialect.classify(exc))
            except PoolTimeout as exc:
                raise self._pool_exhausted(exc) from exc

    async def _with_retries(self, attempt: Callable[[], Any]) -> Any:
        failures = lost = 0
        while True:
            attempt_started = monotonic()
            try:
                return await attempt()
            except DBAPIError as exc:
                failures = await self._backoff_or_raise(
                    exc, failures, attempt_started=attempt_started, first_lost_connection=lost == 0
                )
                lost += self._dialect.classify(exc) is Fault.UNAVAILABLE
            except PoolTimeout as exc:
                raise self._pool_exhausted(exc) from exc

    def _pool_exhausted(self, exc: PoolTimeout) -> StorageUnavailable:
        """What a caller gets when no connection of the pool came free in time: nothing was sent, and
        nothing written. Its wait (the pool's timeout, or less where the caller's deadline came first:
        stores/_engine.py) was the retry, so it is not retried again here."""
        waited = getattr(exc, "permits_waited", None)
        within = f" within {waited:.3g} s" if isinstance(waited, float) else ""
        return StorageUnavailable(
            f"no connection to {self.url} came free{within}: every connection this client's pool may open"
            " is in use (more threads or tasks at once than the pool holds, or the database is slow to answer)",
            url=self.url,
        )

    def _reply_bound(self) -> float:
        """How long an attempt sent now waits for its answer: the reply deadline, or less where the caller's
        deadline and its grace end sooner (``permits._deadline``)."""
        # permits._deadline.reply_within, inlined: it is on the path of every statement.
        deadline = CALLER_DEADLINE.get()
        if deadline is None:
            return self._replies
        left = deadline + self._grace - monotonic()
        return min(self._replies, self._least_reply if left < self._least_reply else left)

    async def _backoff_or_raise(
        self,
        exc: DBAPIError,
        failures: int,
        deadline: float | None = None,
        persist: bool = False,
        final_conflict: bool = False,
        attempt_started: float | None = None,
        first_lost_connection: bool = True,
    ) -> int:
        fault = self._dialect.classify(exc)
        delay = RETRY_BACKOFF.delay(failures)
        past_deadline = fault is Fault.CONFLICT and (
            final_conflict or (deadline is not None and monotonic() + delay >= deadline)
        )
        out_of_retries = failures >= self._settings.retries and not (persist and fault is Fault.CONFLICT)
        # Past the caller's deadline and its grace, a lost connection is not tried again: over a link that
        # hangs, each try would wait out the reply deadline again (``permits._deadline``). But a first one
        # that failed at once (a pooled connection the server dropped in a fail-over) is tried once more: a
        # new connection may well answer. A conflict is an answer, and keeps its own rules (a release's
        # clean-up must not lose its retries).
        at_once = attempt_started is not None and monotonic() - attempt_started < QUICK_FAILURE_SECONDS
        caller_gave_up = (
            fault is Fault.UNAVAILABLE
            and past_giving_up(self._grace, delay)
            and not (at_once and first_lost_connection)
        )
        if not fault.retryable or out_of_retries or past_deadline or caller_gave_up:
            error = translate(exc, fault, self._dialect, self._settings)
            if caller_gave_up and not out_of_retries:
                setattr(error, CUT_BY_CALLER_DEADLINE, True)  # for open(): see _answers_this_caller
            raise error from exc
        logger.debug("retrying after %s (%s)", fault.value, type(exc.orig).__name__)
        if self.on_retry is not None:
            self.on_retry(fault.value)
        await async_sleep(delay)
        return failures + 1

    async def _attempt(
        self, flow: Flow[T], readonly: bool, cuts: list[_CutSession], deadline: float | None = None
    ) -> T:
        """Run ``flow`` in one transaction. A link that the reply deadline cuts meanwhile is noted in ``cuts``
        (and ``_cut``). On SQLite, a ``deadline`` nearer than the lock wait bound bounds the wait for the
        database's write lock (see ``_run``'s ``bounds_lock_wait``)."""
        try:
            first = next(flow)
        except StopIteration as stop:  # pragma: no cover - every flow sends at least one statement
            done: T = stop.value
            return done
        if self._direct is not None:
            left = None if deadline is None else deadline - monotonic()
            lock_wait = left if left is not None and 0 < left < self._settings.lock_wait_timeout else None
            return self._direct.run(flow, first, readonly, self.after_statement, lock_wait)
        alone = first.alone and (self._dialect.free_autocommit or self._dialect.self_committing)
        if alone:
            return await self._drive_alone_parked(flow, first, cuts)
        await self._lend_parked()
        async with self._engine.connect() as conn:
            if readonly:
                await conn.execution_options(**{READONLY: True})
            # Up to the COMMIT's reply. A socket shut down by the deadline fails the statement waiting on it
            # as a lost connection, and SQLAlchemy then drops the connection (is_disconnect).
            driver = await async_driver_connection(conn)
            watch = async_watch_reply(self._dialect.reply_socket(driver), self._reply_bound())
            try:
                async with conn.begin():
                    return await self._drive(conn, flow, first)
            finally:
                if async_unwatch_reply(watch):
                    self._note_cut(driver, cuts)
                    # The answer may have come all the same, just as the deadline went off: the socket is
                    # shut down either way, and the connection must not go back to the pool.
                    await conn.invalidate()

    def _note_cut(self, driver: Any, cuts: list[_CutSession], interrupted: bool = False) -> None:
        """The reply deadline cut the link under ``driver`` with a request in flight, or (``interrupted``) its
        caller was cancelled or interrupted while it was. The link may still hold that request and deliver it
        once it recovers, or the server may be running it still (a grant that waits for a row lock), and the
        server session would then carry it out, up to its commit, after the caller had been answered from a
        retry, or had released what it might have got: a grant nobody knows of, say, held until its TTL runs
        out. So the session is listed for ending, and in ``cuts``, the operation's own list, for its retry
        (or, once the operation is over, the next operation) to wait on."""
        if self.on_reply_cut is not None and not interrupted:
            self.on_reply_cut("cut")
        where = self._sessions.get(driver)
        if where is None or not self._dialect.has("SESSION_END"):
            return
        cut = next((listed for listed in self._cut if listed.where == where), None)
        if cut is None:
            cut = _CutSession(where, interrupted=interrupted)
            self._cut.append(cut)
        cuts.append(cut)

    async def _end_cut_sessions(self, own: list[_CutSession]) -> None:
        """End the server sessions whose links the reply deadline cut (``_note_cut``), so that a retry is
        answered from a state the cut request can no longer change: what its link held then reaches a closed
        connection. An operation's retry waits for its own cut sessions (``own``), even while another caller
        ends them: each end takes a few round trips, and a session that is slow to go up to a lock wait. So
        does every operation for a session ``abandoned`` by its own, which may be the same call made again
        (the store cannot tell: an idempotency key is inside the flow). A session whose operation is still
        retrying is that operation's to wait for: another ends it only if nobody is ending it already, and
        never waits on another caller's ending. A lost connection leaves the session listed and goes to the
        caller's retry loop; a session that this connection's server does not have, or that the server will
        not end, is given up with a warning (a load balancer may send each connection to another node)."""
        for cut in list(self._cut):
            if cut in own or cut.abandoned:
                async with cut.ending:
                    if not cut.settled:
                        await self._end_session(cut)
            elif await async_try_lock(cut.ending):
                try:
                    if not cut.settled:
                        await self._end_session(cut)
                finally:
                    cut.ending.release()

    async def _end_session(self, cut: _CutSession) -> None:
        """End ``cut``'s session, or give it up; the caller holds ``cut.ending``."""
        find, end = self._dialect.clause("SESSION_FIND"), self._dialect.clause("SESSION_END")
        session = cut.where
        refused: DBAPIError | None = None
        ended = False
        try:
            async with self._engine.connect() as conn, self._bounded(conn):
                # A transaction per look: PostgreSQL reads pg_stat_activity once per transaction.
                found = (await conn.execute(find, session)).one()
                await conn.rollback()
                ends_by = monotonic() + max(1.0, self._settings.lock_wait_timeout)
                while found.same_server and found.alive and refused is None and monotonic() < ends_by:
                    ended = True
                    try:
                        await conn.execute(end, session)
                    except DBAPIError as exc:  # refused, or gone meanwhile (the look below tells which)
                        if self._dialect.classify(exc) is Fault.UNAVAILABLE:
                            raise
                        refused = exc
                    await conn.rollback()
                    if refused is None:
                        await async_sleep(0.05)
                    found = (await conn.execute(find, session)).one()
                    await conn.rollback()
        except DBAPIError as exc:
            if self._dialect.classify(exc) is Fault.UNAVAILABLE:
                raise
            found, refused = None, exc  # the server would not even look: never ask again
        outcome = (
            "other_server"
            if found is not None and not found.same_server
            else "refused"
            if found is None or found.alive
            else "ended"
            if ended
            else "gone"
        )
        cut.settled = True
        if cut in self._cut:
            self._cut.remove(cut)
        if self.on_reply_cut is not None and not cut.interrupted:
            self.on_reply_cut(outcome)
        what = "an interrupted request" if cut.interrupted else "a request cut off by the reply deadline"
        if outcome == "other_server":
            logger.warning(
                "%s may still run at %s: its server session is on a server this connection did not reach",
                what,
                self.url,
            )
        elif outcome == "refused":
            logger.warning(
                "%s may still run at %s: the server did not end its session (%s)",
                what,
                self.url,
                "no error" if refused is None else str(refused.orig).strip().splitlines()[0],
            )
        else:
            logger.info("ended the server session of %s at %s", what, self.url)

    async def _drive_alone_parked(self, flow: Flow[T], first: Stmt, cuts: list[_CutSession]) -> T:
        """Send a statement that runs alone on a parked connection (``_Parked``), or on one checked out of the
        pool if none is parked, and park the connection after it."""
        parked = await self._take_parked()
        if parked is None:
            try:
                conn = await async_check_out_alone(self._engine)
                try:
                    driver = await async_alone_driver(conn)
                except BaseException:
                    await conn.close()
                    raise
                parked = _Parked(conn, driver, monotonic())
            except Exception as exc:  # the sync pool's errors come unwrapped: wrapped here, so retried
                error = driver_error(self._engine, exc)
                if error is None:
                    raise
                raise error from exc
        try:
            return await self._drive_alone(parked.conn, parked.driver, flow, first, cuts)
        finally:
            await self._park(parked)

    async def _take_parked(self) -> _Parked | None:
        """The parked connection parked last, taken out of its place (None: none is parked). Those out of the
        pool PARK_SECONDS or more go back to it first, unused: one left idle that long may have been closed
        by the server (MySQL's ``wait_timeout``) or a proxy meanwhile, which the pool's own checks catch."""
        now = monotonic()
        with self._park_mutex:
            aged = [p for p in self._parked if now - p.since >= PARK_SECONDS]
            if aged:
                self._parked = [p for p in self._parked if now - p.since < PARK_SECONDS]
            parked = self._parked.pop() if self._parked else None
        for old in aged:
            await self._into_pool(old)
        return parked

    async def _park(self, parked: _Parked) -> None:
        """Keep a connection that ran a statement alone out of the pool for the next one; or give it back:
        where its link was lost (invalidated), it left the pool PARK_SECONDS ago or more, PARKED_AT_MOST are
        parked already, the store is closed, or the pool has every connection it may open checked out (a
        caller may be waiting for one: with a pool of two, two parked would keep it waiting)."""
        if async_live(parked.conn) and monotonic() - parked.since < PARK_SECONDS:
            with self._park_mutex:
                # under the guard, as in close()
                if len(self._parked) < PARKED_AT_MOST and not self._closed and not pool_full(self._engine.pool):
                    self._parked.append(parked)
                    return
        await self._into_pool(parked)

    async def _into_pool(self, parked: _Parked) -> None:
        """Give a parked connection back to the pool, as the pool's other users expect it: on PostgreSQL,
        with autocommit off. One that cannot be switched back is dropped."""
        try:
            if async_live(parked.conn) and self._dialect.free_autocommit:
                await parked.driver.set_autocommit(False)
        except BaseException as exc:  # its autocommit unknown: dropped, not given back
            await parked.conn.invalidate()
            if not isinstance(exc, Exception):  # cancelled, or interrupted: that goes on up
                await parked.conn.close()
                raise
        await parked.conn.close()

    async def _unpark_into_pool(self, at_most: int = PARKED_AT_MOST) -> None:
        """Give up to ``at_most`` parked connections back to the pool."""
        for _ in range(at_most):
            parked = await self._take_parked()
            if parked is None:
                return
            await self._into_pool(parked)

    async def _lend_parked(self) -> None:
        """A transaction is about to take a connection from the pool: where the pool has none idle, a parked
        one goes back into it first, for this checkout to take, rather than open another connection or, at
        the pool's limit, wait for one while a parked one sits idle."""
        if self._parked and self._engine.pool.checkedin() == 0:  # type: ignore[attr-defined]
            await self._unpark_into_pool(1)

    async def _drive_alone(self, conn: Any, driver: Any, flow: Flow[T], stmt: Stmt, cuts: list[_CutSession]) -> T:
        """``conn``: a parked connection (``_Parked``); ``driver``: the driver's connection under it. A statement
        that leaves a transaction open (MariaDB's line) is followed by the flow's next one, on this connection.
        However the flow stops (a refusal, an error, an interruption), a connection still in a transaction is
        dropped, which ends the transaction on the server, rather than parked with it open; one whose link
        the reply deadline cut in between cannot go on with it, and the operation starts over."""
        try:
            while True:
                try:
                    result = await self._send_alone(conn, driver, stmt, cuts)
                except DBAPIError as exc:
                    if self._dialect.classify(exc) is not Fault.DUPLICATE:
                        raise
                    flow.throw(DuplicateKey())
                    raise RuntimeError("a flow went on after a statement that runs alone") from None
                left_open = async_live(conn) and self._dialect.in_transaction(driver)
                try:
                    following = flow.send(result)
                except StopIteration as stop:
                    value: T = stop.value
                    return value
                if not (following.alone and self._dialect.in_transaction(driver)):
                    raise RuntimeError("a flow went on after a statement that runs alone")
                if not left_open:  # cut just as its reply came: the transaction went with the link
                    raise Retry()
                stmt = following
        finally:
            if async_live(conn) and self._dialect.in_transaction(driver):
                await conn.invalidate()

    async def _send_alone(self, conn: Any, driver: Any, stmt: Stmt, cuts: list[_CutSession]) -> Result:
        """Send a statement that is a whole transaction by itself (a grant, a release) as one request, on
        the driver's own connection. SQLAlchemy never opens a transaction on ``conn``, so it adds no COMMIT
        of its own (PyMySQL sends one even when there is nothing to commit) and none of its per-statement
        work, which was most of a PostgreSQL client's CPU time per operation."""
        calls, dialect = self._function_calls, self._dialect
        if not dialect.has(stmt.name):  # a call the flow was made for, given up by another operation since
            raise _CallGone(stmt.name, "given up meanwhile")
        sql, names = self._driver_sql(stmt.name, dialect)
        given = dict(stmt.params)  # type: ignore[arg-type]
        params = given if names is None else tuple(given[n] for n in names)
        cut = False
        try:
            watch = async_watch_reply(dialect.reply_socket(driver), self._reply_bound())
            try:
                if dialect.self_committing:
                    result = await _send_batch(driver, sql, params)
                else:
                    result = await _send_autocommit(driver, sql, params, self._prepare)
            finally:  # before the handling below, which may close the connection and free its socket's number
                if async_unwatch_reply(watch):
                    cut = True
                    self._note_cut(driver, cuts)
        except BaseException as exc:
            error = driver_error(self._engine, exc)
            if error is None:  # this call stopped half-way: the connection's state is unknown
                if not cut:
                    # Interrupted (cancelled, Ctrl-C) with the request perhaps sent, which is a whole
                    # transaction: the server may carry it out to its commit after the caller has moved on (a
                    # grant waiting for a row lock commits once it has it), where the caller's next step
                    # (releasing a lease under a key it made up) must see what it did. Its session is ended
                    # first, as for a link the reply deadline cut.
                    self._note_cut(driver, cuts, interrupted=True)
                await conn.invalidate()
            elif self._dialect.classify(error) is Fault.UNAVAILABLE:
                # The link was lost. The parked connections, and the pool's, likely lost theirs with it (the
                # server restarted, or ends idle sessions): none is tried again unchecked.
                await async_drop_link(self._engine, conn, error)
                await self._unpark_into_pool()
            elif self._dialect.self_committing:
                # The batch stopped at a statement's error, maybe with the ones before it done: undo them.
                # Galera answers the ROLLBACK of a transaction it aborted (lost certification) with that
                # error again: then the connection's state is unknown, and it is dropped.
                try:
                    await driver.rollback()
                except Exception:
                    await conn.invalidate()
            if error is None:
                raise
            if stmt.name in calls and function_gone(error.orig, calls[stmt.name]):
                raise _CallGone(stmt.name, str(error.orig).strip().splitlines()[0], error) from exc
            if stmt.name == "ACQUIRE_ONE_LINE_FREE" and line_unsupported(error.orig):
                # An engine that speaks PostgreSQL's protocol without its advisory locks: no line can work
                # there, so the store gives up the line's function, as where calling it fails this way, and
                # its waiters wait as on other databases. The statement wrote nothing.
                raise _CallGone("ACQUIRE_ONE_QUEUED", str(error.orig).strip().splitlines()[0], error) from exc
            raise error from exc
        if cut:  # answered just as the deadline went off: the socket is shut down all the same
            await conn.invalidate()
        if self.after_statement is not None:
            self.after_statement(stmt.name)
        return result

    async def _execute_on_driver(self, conn: AsyncConnection, stmt: Stmt) -> Result:
        """One statement of the transaction that SQLAlchemy began on ``conn``, sent on the driver's cursor.
        A server function's call that fails because the function is gone raises ``_CallGone``, as one sent
        alone does: the transaction then rolls back, so the call had no effect."""
        calls, dialect = self._function_calls, self._dialect
        if not dialect.has(stmt.name):  # a call the flow was made for, given up by another operation since
            raise _CallGone(stmt.name, "given up meanwhile")
        sql, names = self._driver_sql(stmt.name, dialect)
        cursor = (await async_driver_connection(conn)).cursor()
        try:
            if isinstance(stmt.params, Mapping):
                given = dict(stmt.params)
                await cursor.execute(sql, given if names is None else tuple(given[n] for n in names))
            elif not stmt.params:
                return Result([], 0)
            else:  # a list of params: once per item
                rows = [dict(p) for p in stmt.params]
                await cursor.executemany(sql, rows if names is None else [tuple(r[n] for n in names) for r in rows])
        except Exception as exc:
            error = driver_error(self._engine, exc)
            if error is None:
                raise
            if stmt.name in calls and function_gone(error.orig, calls[stmt.name]):
                raise _CallGone(stmt.name, str(error.orig).strip().splitlines()[0], error) from exc
            raise error from exc
        if cursor.description is not None:
            found = [tuple(r) for r in await cursor.fetchall()]
            result = Result(found, len(found))
        else:
            result = Result([], int(cursor.rowcount), cursor.lastrowid if self._dialect.name == "mysql" else None)
        if self.after_statement is not None:
            self.after_statement(stmt.name)
        return result

    def _driver_sql(self, name: str, dialect: Dialect | None = None) -> tuple[str, tuple[str, ...] | None]:
        """A statement of ``dialect`` (the store's, by default) compiled for the driver (its paramstyle and
        quoting), and the names of its positional parameters in order (None: the paramstyle names them)."""
        dialect = dialect or self._dialect
        compiled_from, cache = self._compiled
        cached = cache.get(name) if compiled_from is dialect else None
        if cached is None:
            compiled = dialect.clause(name).compile(dialect=sync_engine(self._engine).dialect)
            order = None if compiled.positiontup is None else tuple(compiled.positiontup)
            cached = (compiled.string, order)
            if compiled_from is dialect:
                cache[name] = cached
        return cached

    async def _drive(self, conn: AsyncConnection, flow: Flow[T], first: Stmt) -> T:
        stmt = first
        try:
            while True:
                try:
                    result = await self._execute(conn, stmt)
                except DBAPIError as exc:
                    if self._dialect.classify(exc) is not Fault.DUPLICATE:
                        raise
                    stmt = flow.throw(DuplicateKey())
                    continue
                stmt = flow.send(result)
        except StopIteration as stop:
            value: T = stop.value
            return value

    async def _execute(self, conn: AsyncConnection, stmt: Stmt) -> Result:
        if self._dialect.statements_on_driver and not self._dialect.expands(stmt.name):
            return await self._execute_on_driver(conn, stmt)
        clause = self._dialect.clause(stmt.name)
        if isinstance(stmt.params, Mapping):
            cursor = await conn.execute(clause, dict(stmt.params))
            if cursor.returns_rows:
                rows = [tuple(r) for r in cursor.fetchall()]
                result = Result(rows, len(rows))
            else:
                lastrowid = cursor.lastrowid if self._dialect.name == "mysql" else None
                result = Result([], cursor.rowcount, lastrowid)
        else:  # a list of params: once per item (executemany)
            if not stmt.params:
                return Result([], 0)
            many = await conn.execute(clause, [dict(p) for p in stmt.params])
            result = Result([], many.rowcount)
        if self.after_statement is not None:
            self.after_statement(stmt.name)
        return result


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)


async def _send_batch(driver: Any, sql: str, params: Any) -> Result:
    """A batch that ends in its own COMMIT (MariaDB), on a PyMySQL or aiomysql connection."""
    cursor = await driver.cursor()
    await cursor.execute(sql, params)
    result = await _batch_result(cursor)
    await cursor.close()
    return result


async def _send_autocommit(driver: Any, sql: str, params: Any, prepare: bool) -> Result:
    """One statement in autocommit (PostgreSQL), on a psycopg connection, which is left idle and in autocommit
    (it is parked: ``_Parked``). psycopg switches autocommit on the client side, at no round trip."""
    if not driver.autocommit:
        await driver.set_autocommit(True)
    cursor = kept_cursor(driver)
    await cursor.execute(sql, params, prepare=prepare)
    # Whether rows came back, from the result's column count: psycopg builds ``description`` anew, a Column
    # object per column, on every read of it.
    if cursor.pgresult is None or not cursor.pgresult.nfields:
        return Result([], int(cursor.rowcount))
    rows = [tuple(r) for r in await cursor.fetchall()]
    return Result(rows, len(rows))


async def _batch_result(cursor: Any) -> Result:
    """A batch's answer: its first result set that has columns, or else its first statement's row count.
    Every result is read, so the connection is ready for the next request."""
    rows: list[tuple[Any, ...]] | None = None
    rowcount: int | None = None
    while True:
        if cursor.description is not None and rows is None:
            rows = [tuple(r) for r in await cursor.fetchall()]
        if rowcount is None:
            rowcount = int(cursor.rowcount)
        if not await cursor.nextset():
            break
    if rows is not None:
        return Result(rows, len(rows))
    return Result([], rowcount or 0)
