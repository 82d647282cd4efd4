"""SQLite's transactions, run on the driver's own connection with no SQLAlchemy Connection around them.

SQLite runs inside the client's process and lets one writer in at a time. Every bit of Python around a
statement is then part of the transaction, and other processes wait for the write lock through all of
it. SQLAlchemy's Connection, its Transaction object and the begin event cost about a third of an acquire
and release cycle's CPU, measured with the database on tmpfs so that disk writes do not count
(docs/design.md). The pool still hands out the connections and sets each one up when it opens
(stores/_engine.py); only the wrapping of each transaction is gone.

The sync SQL store runs every flow on SQLite through here. The asyncio store runs SQLite through the sync
one, on a worker thread (stores/threaded.py), so it needs no twin of this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.compiler import Compiled

from permits._core.flows import DuplicateKey, Flow, Result, Stmt
from permits.dialects.base import Dialect, Fault
from permits.dialects.sqlite import database_file
from permits.stores._engine import driver_error, sqlite_busy_ms
from permits.stores.host_lines import WRITE_LINE, HostLines, supported

#: How long a write transaction waits for its turn in the write line at most (stores/host_lines.py), and
#: never longer than SQLite's own busy timeout. Past it, the writer asks for SQLite's lock unordered.
WRITE_PATIENCE = 0.5

T = TypeVar("T")


class DirectTransactions:
    """Runs a flow in one SQLite transaction: BEGIN (IMMEDIATE unless read-only), its statements on the
    sqlite3 cursor, COMMIT; on any error, ROLLBACK. Driver errors come out wrapped as SQLAlchemy wraps
    them, so the store's retry loop classifies them as it does every other engine's."""

    def __init__(self, engine: Engine, dialect: Dialect, lock_wait_timeout: float) -> None:
        self._engine = engine
        self._dialect = dialect
        self._statements: dict[str, tuple[str, tuple[str, ...], Compiled | None]] = {}
        written = database_file(engine.url)
        #: the lines beside the database (stores/host_lines.py); None where there are none
        self.lines = HostLines(written) if written is not None and supported() else None
        self._write_patience = min(WRITE_PATIENCE, lock_wait_timeout)
        self._busy_ms = sqlite_busy_ms(lock_wait_timeout)

    def close(self) -> None:
        if self.lines is not None:
            self.lines.close()

    def run(
        self,
        flow: Flow[T],
        first: Stmt,
        readonly: bool,
        after_statement: Callable[[str], None] | None,
        lock_wait: float | None = None,
    ) -> T:
        """``lock_wait``: how long the transaction may wait for the write lock at most, where that is less than
        the busy timeout (an operation with less time left, such as a grant with a short timeout)."""
        # Opening a connection can fail too (the file cannot be opened, or is locked while the new
        # connection sets WAL mode): wrapped like any other driver error, so that it is retried. It is taken
        # from the pool, and given back, outside the write line's turn: the pool's own work need not hold up
        # the writers behind.
        pooled = self._call(self._engine.raw_connection)
        # The connection's busy timeout is lowered for this transaction, and set back after it.
        bounded = None if lock_wait is None else sqlite_busy_ms(lock_wait)
        try:
            if bounded is not None:
                self._call(pooled.driver_connection.execute, f"PRAGMA busy_timeout={bounded}")
            if readonly or self.lines is None:
                return self._run(pooled, flow, first, readonly, after_statement)
            # Writers take the database's write lock in turn (stores/host_lines.py).
            patience = self._write_patience if bounded is None else min(self._write_patience, bounded / 1000)
            with self.lines.turn(WRITE_LINE, patience):
                return self._run(pooled, flow, first, readonly, after_statement)
        finally:
            if bounded is not None and pooled.is_valid:
                try:
                    pooled.driver_connection.execute(f"PRAGMA busy_timeout={self._busy_ms}")
                except Exception:
                    pooled.invalidate()  # not to be used again with the lower bound
            # A connection left in a transaction would hold SQLite's write lock while it sits in the pool
            # (nothing resets it on return): if the rollback could not end it, it is dropped instead.
            if pooled.is_valid and _left_open(pooled.driver_connection):
                pooled.invalidate()
            pooled.close()

    def _run(
        self, pooled: Any, flow: Flow[T], first: Stmt, readonly: bool, after_statement: Callable[[str], None] | None
    ) -> T:
        driver: Any = pooled.driver_connection
        cursor = driver.cursor()
        try:
            # Read-only: a deferred BEGIN takes no write lock, so readers never queue behind writers.
            self._call(cursor.execute, "BEGIN" if readonly else "BEGIN IMMEDIATE")
            value = self._drive(cursor, flow, first, after_statement)
            self._call(driver.commit)
        except BaseException as exc:
            self._abandon(pooled, driver, cursor, exc)
            raise
        cursor.close()
        return value

    def _abandon(self, pooled: Any, driver: Any, cursor: Any, exc: BaseException) -> None:
        """After a failure: roll back, or drop the connection if its state is unknown (the rollback failed,
        or the database was unavailable) so that a retry starts on a fresh one."""
        with contextlib.suppress(Exception):
            cursor.close()
        unavailable = isinstance(exc, DBAPIError) and self._dialect.classify(exc) is Fault.UNAVAILABLE
        if not unavailable and driver.in_transaction:
            try:
                driver.rollback()
            except Exception:
                unavailable = True
        if unavailable:
            pooled.invalidate()

    def _drive(self, cursor: Any, flow: Flow[T], first: Stmt, after_statement: Callable[[str], None] | None) -> T:
        stmt = first
        try:
            while True:
                try:
                    result = self._send(cursor, stmt)
                except DBAPIError as exc:
                    if self._dialect.classify(exc) is not Fault.DUPLICATE:
                        raise
                    stmt = flow.throw(DuplicateKey())
                    continue
                if after_statement is not None:
                    after_statement(stmt.name)
                stmt = flow.send(result)
        except StopIteration as stop:
            value: T = stop.value
            return value

    def _send(self, cursor: Any, stmt: Stmt) -> Result:
        result: Result = self._call(self._execute, cursor, stmt)
        return result

    def _execute(self, cursor: Any, stmt: Stmt) -> Result:
        sql, order, compiled = self._statement(stmt.name)
        if isinstance(stmt.params, Mapping):
            if compiled is not None:
                # A list parameter (``IN :names``) becomes one placeholder per item, as SQLAlchemy does.
                expanded = compiled.construct_expanded_state(dict(stmt.params))  # type: ignore[attr-defined]
                cursor.execute(expanded.statement, expanded.positional_parameters)
            else:
                given = stmt.params
                cursor.execute(sql, tuple([given[name] for name in order]))
        elif stmt.params:  # a list of params: once per item
            cursor.executemany(sql, [tuple([p[name] for name in order]) for p in stmt.params])
        else:
            return Result([], 0)
        if cursor.description is not None:
            found = cursor.fetchall()
            return Result(found, len(found))
        return Result([], int(cursor.rowcount))

    def _statement(self, name: str) -> tuple[str, tuple[str, ...], Compiled | None]:
        """A statement compiled for sqlite3: its SQL, its parameters' names in placeholder order, and, for
        one with a list parameter, the compiled form that expands it per call."""
        cached = self._statements.get(name)
        if cached is None:
            compiled = self._dialect.clause(name).compile(dialect=self._engine.dialect)
            order = tuple(compiled.positiontup or ())
            cached = (compiled.string, order, compiled if self._dialect.expands(name) else None)
            self._statements[name] = cached
        return cached

    def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        try:
            return method(*args)
        except Exception as exc:
            wrapped = driver_error(self._engine, exc)
            if wrapped is None:
                raise
            raise wrapped from exc


def _left_open(driver: Any) -> bool:
    """Whether a connection is still in a transaction; a connection that cannot even say is unusable."""
    try:
        return bool(driver.in_transaction)
    except Exception:
        return True
