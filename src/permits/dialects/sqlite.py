"""SQLite, the embedded default, through the standard library's sqlite3 and aiosqlite.

SQLite has no row locks: a writing transaction starts with BEGIN IMMEDIATE, which takes the database's
write lock up front. Then a transaction never has to upgrade a read lock to a write lock half-way, which
is where SQLite would answer SQLITE_BUSY with no wait. WAL mode lets readers go on beside the writer, and
several processes can share one file.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from permits.dialects.base import Dialect, Fault

_CONFLICT = {sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED}
_UNAVAILABLE = {sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_IOERR}
_READ_ONLY = {sqlite3.SQLITE_READONLY}


class SQLite(Dialect):
    name = "sqlite"
    # julianday('now') is fixed for the whole statement, like NOW() on the servers.
    now_sql = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)"
    for_update = ""
    sync_driver = "pysqlite"
    async_driver = "aiosqlite"

    def engine_options(self, lock_wait_timeout: float) -> dict[str, Any]:
        # The driver's own transaction handling is turned off (isolation_level=None) so that the store
        # can issue BEGIN IMMEDIATE itself; see stores/_events.py.
        return {"connect_args": {"timeout": lock_wait_timeout, "isolation_level": None}}

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
