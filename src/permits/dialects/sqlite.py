"""SQLite, the embedded default, through the standard library's sqlite3 (the asyncio client too: it runs
the sync store on a worker thread, see ``stores/threaded.py``).

SQLite has no row locks: a writing transaction starts with BEGIN IMMEDIATE, which takes the database's
write lock up front. Then a transaction never has to upgrade a read lock to a write lock half-way, which
is where SQLite would answer SQLITE_BUSY with no wait. WAL mode lets readers go on beside the writer, and
several processes can share one file.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote, unquote

from sqlalchemy.engine import URL

from permits._exceptions import ConfigurationError
from permits.dialects.base import Dialect, Fault

_CONFLICT = {sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED}
_UNAVAILABLE = {sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_IOERR}
_READ_ONLY = {sqlite3.SQLITE_READONLY}


#: what the sqlite3 driver takes from a URL's query; SQLite's own parameters need a file: URI (uri=true)
_DRIVER_PARAMETERS = {"uri", "timeout", "isolation_level", "detect_types", "check_same_thread", "cached_statements"}
#: SQLite URI parameters that drop its locking: a second process would read and write the file unguarded
_UNLOCKED = {"immutable", "nolock"}
#: SQLite VFSes that take no locks, for the same reason (``vfs=unix-none``)
_UNLOCKED_VFS = {"unix-none", "win32-none"}

_NOW_SQL = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)"


class SQLite(Dialect):
    name = "sqlite"
    # SQLAlchemy's work per statement was most of a SQLite client's CPU per cycle: see docs/design.md. The
    # store's direct transactions (stores/direct.py) always send statements on the driver; this covers a
    # transaction begun through SQLAlchemy's Connection.
    statements_on_driver = True
    # julianday('now') is fixed for the whole statement, like NOW() on the servers.
    now_sql = _NOW_SQL
    for_update = ""
    held_index = " INDEXED BY ix_permits_lease_held"
    # A CROSS JOIN's left side is SQLite's outer loop: the held leases first, then their permits by lease.
    held_join = "CROSS JOIN"
    # A read-only transaction starts with BEGIN, which takes no write lock (stores/direct.py).
    cheaper_readonly = True
    sync_driver = "pysqlite"
    # Only so that a URL naming it (sqlite+aiosqlite://) is accepted: the asyncio client runs pysqlite on
    # a worker thread, and aiosqlite need not be installed.
    async_driver = "aiosqlite"

    def engine_url(self, url: URL, asynchronous: bool) -> URL:
        # SQLite reads mode=ro, cache=, immutable= ... only from a file: URI (uri=true). In a plain URL
        # SQLAlchemy drops them with a warning nobody sees, so ?mode=ro would open the file read-write.
        uri = _is_uri(url)
        parameters = _sqlite_query(url, uri)
        unlocked = sorted(_UNLOCKED & {name for name, _ in parameters})
        unlocked += [f"vfs={value}" for name, value in parameters if name == "vfs" and value in _UNLOCKED_VFS]
        if unlocked:
            raise ConfigurationError(
                f"SQLite's {', '.join(unlocked)} turn off the file locking that keeps several processes' grants"
                " apart: permits refuses them (to look without writing, open it with mode=ro)",
                field="url",
            )
        ignored = sorted(set(url.query) - _DRIVER_PARAMETERS)
        if ignored and uri and not (url.database or "").startswith("file:"):
            # The driver then opens the path with the query glued to it: a file named "x.db?mode=ro", made
            # writable, beside the one that was meant.
            raise ConfigurationError(
                f"SQLite reads {', '.join(ignored)} only from a file: URI, and {url.database or ''!r} is a path:"
                f" write it sqlite:///file:{url.database or ''}?...&uri=true",
                field="url",
            )
        if ignored and not uri:
            query = "&".join(f"{name}={url.query[name]}" for name in sorted(url.query) if name != "uri")
            # Quoted twice: SQLAlchemy unquotes the URL's path once, and SQLite the file: URI's once more
            # (a "#" or "?" left bare would end the file's name there, and drop mode=ro with the rest).
            path = quote(quote(url.database or "", safe="/"), safe="/")
            as_uri = f"sqlite:///file:{path}?{query}&uri=true"
            raise ConfigurationError(
                f"SQLite reads {', '.join(ignored)} only from a file: URI, so the URL's would be ignored"
                f" (a read-only mode would open the file read-write): write it {as_uri}",
                field="url",
            )
        return super().engine_url(url, asynchronous)

    def engine_options(self, lock_wait_timeout: float, pooler: str | None = None) -> dict[str, Any]:
        # The driver's own transaction handling is turned off (isolation_level=None) so that the store
        # can issue BEGIN IMMEDIATE itself; see stores/direct.py.
        return {"connect_args": {"timeout": lock_wait_timeout, "isolation_level": None}}

    def prepare_connection(self, dbapi_connection: sqlite3.Connection) -> None:
        """Called on each new connection, after the PRAGMAs (only the test clock has something to do)."""

    def _classify(self, orig: BaseException | None) -> Fault:
        code = getattr(orig, "sqlite_errorcode", None)
        if code is None:
            message = str(orig)
            if "no such table" in message:
                return Fault.SCHEMA
            if "locked" in message:
                return Fault.CONFLICT
            return Fault.OTHER
        primary = code & 0xFF  # extended result codes keep the primary code in the low byte
        if isinstance(orig, sqlite3.IntegrityError) and primary == sqlite3.SQLITE_CONSTRAINT:
            return Fault.DUPLICATE if "UNIQUE" in str(orig) else Fault.OTHER
        if primary in _CONFLICT:
            return Fault.CONFLICT
        if primary in _UNAVAILABLE:
            return Fault.UNAVAILABLE
        if primary in _READ_ONLY:
            return Fault.READ_ONLY
        if primary == sqlite3.SQLITE_ERROR and "no such table" in str(orig):
            return Fault.SCHEMA
        return Fault.OTHER


# ------------------------------------------------------------------------------------- testing only
#
# Leases are timed on the database's clock, so a test of expiry either sleeps or moves that clock. The
# stores opened inside ``offset_clock()`` read the clock as julianday('now') plus an offset that the test
# advances, through a SQL function registered on each of their connections. Stores opened anywhere else
# (every store, outside the tests) use the statements above unchanged: nothing in production reads the
# offset, and no setting, URL or environment variable can turn it on.

#: The SQL function that returns a test clock's offset in milliseconds.
CLOCK_OFFSET_FUNCTION = "permits_test_clock_offset_ms"


class OffsetClock:
    """Testing only: how far ahead of real time the stores opened inside ``offset_clock()`` run.

    Move it only between operations: a statement reads the offset each time it reads the clock, so a move
    while a statement runs could give that statement two different times (``julianday('now')`` alone is
    fixed for the whole statement, and with the offset still is as long as the offset stands still).
    """

    def __init__(self) -> None:
        self.offset_ms = 0

    def advance(self, seconds: float) -> None:
        """Move the clock forward (it never goes back: neither does a database's, as far as permits knows)."""
        if not seconds >= 0:
            raise ValueError(f"the clock only moves forward, not by {seconds}")
        self.offset_ms += round(seconds * 1000)

    def __call__(self) -> int:
        return self.offset_ms


_installed: OffsetClock | None = None


@contextmanager
def offset_clock() -> Iterator[OffsetClock]:
    """Testing only: ``with offset_clock() as clock:`` every SQLite store opened in the block (by
    ``permits.connect`` or the service's app) runs on ``clock``, for its whole life."""
    global _installed
    if _installed is not None:
        raise RuntimeError("an offset clock is installed already")
    _installed = clock = OffsetClock()
    try:
        yield clock
    finally:
        _installed = None


class _OffsetSQLite(SQLite):
    now_sql = f"({_NOW_SQL} + {CLOCK_OFFSET_FUNCTION}())"

    def __init__(self, clock: OffsetClock) -> None:
        self.clock = clock
        super().__init__()

    def prepare_connection(self, dbapi_connection: sqlite3.Connection) -> None:
        dbapi_connection.create_function(CLOCK_OFFSET_FUNCTION, 0, self.clock)


def sqlite_dialect() -> SQLite:
    """The SQLite dialect: on the database's own clock, unless a test installed ``offset_clock()``."""
    return SQLite() if _installed is None else _OffsetSQLite(_installed)


def _is_uri(url: URL) -> bool:
    """Whether the driver opens the URL's database as a file: URI (``uri=true``, as SQLAlchemy reads it)."""
    return str(url.query.get("uri", "")).lower() in ("true", "yes", "on", "y", "t", "1")


def database_file(url: URL) -> str | None:
    """The file that a SQLite URL's writers write, named as SQLite finds it: the path, or in a file: URI
    the URI's path, percent-decoded (``file:/x.db``, ``file:///x.db`` and ``file://localhost/x.db`` are all
    ``/x.db``), so that every client of one file finds the same lines beside it (stores/host_lines.py).
    ``None`` for an in-memory database, and for one opened read-only (``mode=ro``), which never writes."""
    database = url.database or ""
    if not (database.startswith("file:") and _is_uri(url)):
        return None if database in ("", ":memory:") else database  # without uri=true, a name like any other
    path = database.removeprefix("file:").partition("#")[0].partition("?")[0]
    if path.startswith("//"):  # an authority: empty or localhost, the only ones SQLite opens
        authority, slash, rest = path[2:].partition("/")
        if authority.lower() not in ("", "localhost"):
            return None
        path = slash + rest
    parameters = _sqlite_query(url, uri=True)
    path = unquote(path)
    if path in ("", ":memory:") or ("mode", "ro") in parameters or ("mode", "memory") in parameters:
        return None
    if ("vfs", "memdb") in parameters:  # a database in memory, named for sharing within the process
        return None
    return path


def _sqlite_query(url: URL, uri: bool) -> list[tuple[str, str]]:
    """The parameters SQLite will read, as it reads them: percent-decoded (``no%6Cock`` is ``nolock``), from
    the URL's query and, in a file: URI, from a query inside the path too (an encoded ``%3F`` there, which
    SQLAlchemy decodes, starts one)."""
    pairs = []
    for name, given in url.query.items():
        for value in given if isinstance(given, tuple) else (given,):
            pairs.append((unquote(name), unquote(value)))
    database = url.database or ""
    if uri and database.startswith("file:"):
        inner = database.partition("?")[2].partition("#")[0]  # a "#" ends a URI's query
        for pair in inner.split("&"):
            if pair:
                name, _, value = pair.partition("=")
                pairs.append((unquote(name), unquote(value)))
    return pairs
