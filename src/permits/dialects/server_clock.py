"""Testing only: a clock that a test moves, for the MariaDB/MySQL and PostgreSQL stores opened in a block.

Leases are timed on the database's clock (docs/guarantees.md), so a test of expiry either sleeps or moves
that clock. SQLite's stores add an offset that a SQL function returns (``permits.dialects.sqlite``'s
``offset_clock``). A server's clock cannot be moved, and a function would have to be created on the server;
so the server dialects built inside ``server_offset_clock()`` read their clock as the server's own plus the
offset kept in a one-row table, ``permits_test_clock``, which the test advances between operations. The
statements are otherwise those of production, which is the point: the expiry paths of each dialect's own
SQL (sweeps, reclaims, extends of expired leases) run against a model with time in it.

The table is not part of permits' schema: the context manager creates it and drops it. Outside the block,
nothing reads it, and no setting, URL or environment variable can turn it on. A service under test follows
the test's clock through ``following_clock()``, which only a launcher in the tests calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

TABLE = "permits_test_clock"
#: What a server dialect built inside the block adds to its clock, in milliseconds.
OFFSET_SQL = f"(SELECT offset_ms FROM {TABLE})"
#: The time it reads instead of its clock while the test holds the clock still (``freeze``), or NULL.
FROZEN_SQL = f"(SELECT frozen_ms FROM {TABLE})"

#: the clock this process moves, or ``FOLLOWED`` when another process moves it (``following_clock``)
_installed: ServerOffsetClock | str | None = None
FOLLOWED = "moved by another process"


def offset_sql() -> str | None:
    """The SQL of the installed clock's offset, or ``None`` (always, outside the tests)."""
    return None if _installed is None else OFFSET_SQL


def clock_sql(now: str) -> str:
    """``now``, a server dialect's clock, as the installed clock reads it: the time the test froze it at,
    else the server's clock plus the offset."""
    return f"COALESCE({FROZEN_SQL}, {now} + {OFFSET_SQL})"


class ServerOffsetClock:
    """How far ahead of its real clock the server's stores opened inside ``server_offset_clock()`` run.

    Move it only between operations: a statement reads the offset when it reads the clock, so a move while a
    statement runs could give it two different times. The clock only moves forward, as a server's does as
    far as permits knows.
    """

    def __init__(self, url: Any) -> None:
        from sqlalchemy import create_engine, text
        from sqlalchemy.engine import make_url

        from permits.dialects.base import dialect_for_url

        parsed = make_url(url)
        self._text = text
        self._engine = create_engine(dialect_for_url(parsed).engine_url(parsed, asynchronous=False))
        self.offset_ms = 0
        with self._engine.begin() as conn:
            conn.execute(text(f"DROP TABLE IF EXISTS {TABLE}"))
            conn.execute(text(f"CREATE TABLE {TABLE} (offset_ms BIGINT NOT NULL, frozen_ms BIGINT)"))
            conn.execute(text(f"INSERT INTO {TABLE} (offset_ms, frozen_ms) VALUES (0, NULL)"))

    def advance(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"the clock only moves forward, not by {seconds}")
        step = round(seconds * 1000)
        with self._engine.begin() as conn:
            conn.execute(self._text(f"UPDATE {TABLE} SET offset_ms = offset_ms + :step"), {"step": step})
        self.offset_ms += step

    def freeze(self, at_ms: int) -> None:
        """Hold the clock still at ``at_ms`` (milliseconds since the epoch): every statement reads exactly
        that, however long it runs, until ``freeze`` moves it. For a test of the millisecond a lease expires
        at, which a running clock would blur. Only forward, like ``advance`` (which moves nothing while the
        clock is frozen); it cannot be undone."""
        with self._engine.begin() as conn:
            frozen = conn.execute(self._text(f"SELECT frozen_ms FROM {TABLE}")).scalar_one()
            if frozen is not None and at_ms < frozen:
                raise ValueError(f"the clock only moves forward, not from {frozen} back to {at_ms}")
            conn.execute(self._text(f"UPDATE {TABLE} SET frozen_ms = :at"), {"at": at_ms})

    def drop(self) -> None:
        with self._engine.begin() as conn:
            conn.execute(self._text(f"DROP TABLE IF EXISTS {TABLE}"))
        self._engine.dispose()


@contextmanager
def server_offset_clock(url: Any) -> Iterator[ServerOffsetClock]:
    """Testing only: ``with server_offset_clock(url) as clock:`` every MariaDB/MySQL or PostgreSQL store
    opened in the block (by ``permits.connect``) on the database of ``url`` runs on ``clock``. Use and close
    them inside the block: the table goes with it. A store on another database would fail, as would one
    opened on SQLite (``offset_clock`` is SQLite's)."""
    global _installed
    if _installed is not None:
        raise RuntimeError("a server offset clock is installed already")
    clock = ServerOffsetClock(url)
    _installed = clock
    try:
        yield clock
    finally:
        _installed = None
        clock.drop()


@contextmanager
def following_clock() -> Iterator[None]:
    """Testing only: the stores opened in the block run on the clock that ``server_offset_clock()`` moves in
    another process, on the same database: a ``permits serve`` that a test started (tests/_clocked.py), so
    that the model runs with time through the service too. The other process creates and drops the table."""
    global _installed
    if _installed is not None:
        raise RuntimeError("a server offset clock is installed already")
    _installed = FOLLOWED
    try:
        yield
    finally:
        _installed = None
