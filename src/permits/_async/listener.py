"""Wake-ups on PostgreSQL: LISTEN for the permits that come back, instead of only polling.

Every statement that gives permits back on PostgreSQL (a release, the return of an ended lease's
permits, a capacity change) ends with ``pg_notify(<the semaphore's channel>, <its name>)``, a release and
a return only while the semaphore is marked as listened to (below); notifications are sent at commit.
Each semaphore has a channel of its own (``channel_for``), so a process hears only of the semaphores its
waiters wait for, not of every release on the server. One listener connection per store subscribes to
those channels and wakes the waiters of a semaphore at once.

A waiter in a fair queue hears no such broadcast. Its listener also LISTENs on a channel of its own (the
store's ``wake_channel``), which the waiter's place in the queue records; every statement that gives
permits back notifies, besides the semaphore's channel, the wake channel of each queued waiter that fits
now (see ``dialects/postgresql.py``). At a release, then, the head of the queue wakes, in whichever process
it is, and the rest of the queue sleeps: each notification costs one process, not every process that
waits on the semaphore. Counting those calls per semaphore (``called``) lets a waiter read the count before
its attempt, so that a call that arrives while the attempt runs still counts.

A release notifies a semaphore's channel only while some listener has marked the semaphore as listened to
(``listened_until_ms``, on the database's clock): a NOTIFY nobody hears still makes its commit wait for
every other notifying commit on the server (see ``LISTENED_MARK`` in ``dialects/postgresql.py``). The
listener marks each semaphore right after it LISTENs to its channel, so any release that commits after the
mark is heard, and renews the mark for as long as it stays subscribed.

Waiters still poll as well, so a lost notification, a missed mark or a broken listener costs latency,
never a grant: the database decides every grant either way.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg

from permits._io import (
    async_event,
    async_join,
    async_mutex,
    async_spawn,
    async_wait,
    monotonic,
)

logger = logging.getLogger("permits.listener")
CHANNEL_PREFIX = "permits_room_"
WAKE_CHANNEL_PREFIX = "permits_wake_"
#: After a failed connection, wait this long before trying to listen again (meanwhile: polling only).
RETRY_AFTER = 5.0
#: Stay subscribed this long after the last waiter that listened: a hot semaphore's waiters come and go
#: many times a second, and each LISTEN or UNLISTEN is a round trip.
LINGER = 2.0
#: How often the listener looks at which channels its waiters want, when no notification arrives.
SUBSCRIBE_EVERY = 0.1
#: A mark says "somebody listens" for this long. The listener asks to renew it once a quarter of it has
#: passed since its last mark, and the SQL writes the row only once less than half is left. A mark that
#: outlives its listener costs the semaphore's releases their NOTIFY until it runs out.
MARK_SECONDS = 10.0
#: After a mark failed other than on a locked row (a timeout the server imposes, say), wait this long
#: before marking again: meanwhile releases may go unheard, and waiters poll.
MARK_RETRY_SECONDS = 1.0


def channel_for(name: str) -> str:
    """A semaphore's channel: the md5 of its name in hex, as the SQL computes it with ``md5(name)``. An
    identifier of 45 characters, within PostgreSQL's 63, whatever the name."""
    return CHANNEL_PREFIX + hashlib.md5(name.encode("utf-8"), usedforsecurity=False).hexdigest()


class _Waiter:
    """One wait: for any release on ``names`` (``since`` None), or for a call on this store's wake
    channel about one of them, counted from ``since``."""

    __slots__ = ("event", "names", "since")

    def __init__(self, event: Any, names: Sequence[str], since: int | None) -> None:
        self.event, self.names, self.since = event, tuple(names), since


class AsyncRoomListener:
    """``mark_sql``: the dialect's ``LISTENED_MARK``, compiled for psycopg (parameters ``names`` and
    ``mark_ms``); without it, semaphores are not marked (their releases then notify only if marked by
    another process)."""

    def __init__(self, conninfo: str, mark_sql: str | None = None) -> None:
        self._conninfo = conninfo
        self._mark_sql = mark_sql
        #: what it was made with (a forked child makes its own listener from them)
        self.conninfo, self.mark_sql = conninfo, mark_sql
        #: when each subscribed semaphore was last marked as listened to
        self._marked_at: dict[str, float] = {}
        self._mark_failed_at = -MARK_RETRY_SECONDS
        self._waiting: dict[str, set[_Waiter]] = {}
        #: calls heard on the wake channel, per semaphore, since this listener started
        self._called: dict[str, int] = {}
        self._wake_channel = WAKE_CHANNEL_PREFIX + uuid.uuid4().hex
        self._mutex = async_mutex()
        self._stop = async_event()
        self._runner: Any = None
        self._connection: Any = None
        self._failed_at = -RETRY_AFTER
        #: names whose channel this connection LISTENs to, and when a waiter last wanted each name
        self._subscribed: set[str] = set()
        self._wanted_at: dict[str, float] = {}
        #: when a waiter of this store last waited in a fair queue (the wake channel is LISTENed till LINGER)
        self._calls_wanted_at = -LINGER
        self._wake_subscribed = False

    @property
    def wake_channel(self) -> str | None:
        """This store's own channel, for its waiters' places in fair queues; ``None`` while not LISTENed
        (a place recorded without one is never called, and its waiter polls)."""
        return self._wake_channel if self._runner is not None and self._wake_subscribed else None

    def want_calls(self) -> None:
        """A waiter of this store holds a place in a fair queue: LISTEN on the wake channel (within
        ``SUBSCRIBE_EVERY``), and until ``LINGER`` after the last such waiter. Only then: PostgreSQL
        signals every backend that LISTENs to anything at each NOTIFY in the database, whatever the
        channel, so an idle listener still costs the server at every release (docs/benchmarks.md)."""
        with self._mutex:
            self._calls_wanted_at = monotonic()

    def called(self, names: Sequence[str]) -> int | None:
        """How many calls about ``names`` the wake channel has had so far, for ``wait``'s ``since``;
        ``None`` while it is not LISTENed."""
        with self._mutex:
            if self._runner is None or not self._wake_subscribed:
                return None
            return sum(self._called.get(name, 0) for name in names)

    async def wait(self, names: Sequence[str], seconds: float, since: int | None = None) -> bool:
        """Return when one of ``names`` got permits back (True), or after ``seconds`` (False). With
        ``since`` (from ``called``), wait for a call on the wake channel instead, counting from ``since``.
        Also True when the listener stops (its connection broke, or it was closed): what it would have
        heard meanwhile is lost, so the waiter should ask again."""
        waiter = _Waiter(async_event(), names, since)
        with self._mutex:
            for name in names:
                self._waiting.setdefault(name, set()).add(waiter)
                if since is None:  # hearing every release needs the semaphore's channel
                    self._wanted_at[name] = monotonic()
            if since is not None:
                self._calls_wanted_at = monotonic()
            if since is not None and sum(self._called.get(name, 0) for name in names) > since:
                waiter.event.set()  # called while the waiter was still asking
        try:
            # On the event even when not listening yet: another waiter may be connecting the listener just
            # now (``_listening`` says no meanwhile), and once it runs it wakes this waiter too. A plain
            # sleep here left a waiter deaf for its whole delay (tests/conformance/test_wakeups.py, under
            # load). Where no listener comes up, nothing sets the event, and this is the sleep.
            await self._listening()
            return bool(await async_wait(waiter.event, seconds))
        finally:
            with self._mutex:
                for name in names:
                    waiters = self._waiting.get(name)
                    if waiters is not None:
                        waiters.discard(waiter)
                        if not waiters:
                            del self._waiting[name]

    async def start(self) -> bool:
        """Connect and listen on the wake channel now, if not yet (True: listening)."""
        return await self._listening()

    async def close(self) -> None:
        self._stop.set()
        if self._runner is not None:
            await async_join(self._runner)

    async def _listening(self) -> bool:
        if self._runner is not None or self._stop.is_set():
            return self._runner is not None
        if monotonic() - self._failed_at < RETRY_AFTER:
            return False
        self._failed_at = monotonic()  # also keeps a second waiter from connecting meanwhile
        try:
            connection = await psycopg.AsyncConnection.connect(self._conninfo, autocommit=True, connect_timeout=5)
        except psycopg.Error as exc:
            logger.warning("cannot LISTEN for released permits (waiters poll meanwhile): %s", exc)
            return False
        try:
            # A mark is one short write: at a stricter default isolation, a row written by a grant since the
            # statement's snapshot would fail it with a serialization error instead of being marked.
            await connection.execute("SET default_transaction_isolation = 'read committed'")
        except psycopg.Error as exc:
            logger.warning("cannot LISTEN for released permits (waiters poll meanwhile): %s", exc)
            with contextlib.suppress(psycopg.Error):
                await connection.close()
            return False
        self._connection = connection
        self._subscribed = set()
        self._marked_at = {}
        self._wake_subscribed = False
        self._failed_at = -RETRY_AFTER
        self._runner = async_spawn(self._run, "permits-listener")
        return True

    async def _subscribe_while_wanted(self) -> None:
        """LISTEN to a semaphore's channel only while some waiter of it listens, and a little longer.
        Waiters of a heavily contended semaphore stop listening (see ``permits._pacing``): every release
        would wake every one of them, and receiving the notifications alone would cost each waiting
        process more than polling does."""
        now = monotonic()
        with self._mutex:
            for name, waiters in self._waiting.items():
                if any(w.since is None for w in waiters):
                    self._wanted_at[name] = now
                elif waiters:
                    self._calls_wanted_at = now
            for name in [n for n, at in self._wanted_at.items() if now - at >= LINGER]:
                del self._wanted_at[name]
            wanted = set(self._wanted_at)
            wake_wanted = now - self._calls_wanted_at < LINGER
        changes = [f"LISTEN {channel_for(n)}" for n in sorted(wanted - self._subscribed)]
        changes += [f"UNLISTEN {channel_for(n)}" for n in sorted(self._subscribed - wanted)]
        if wake_wanted != self._wake_subscribed:
            changes.append(f"{'' if wake_wanted else 'UN'}LISTEN {self._wake_channel}")
        if changes:
            await self._connection.execute("; ".join(changes))
            with self._mutex:
                self._subscribed = wanted
                self._wake_subscribed = wake_wanted
        await self._mark(wanted, now)

    async def _mark(self, subscribed: set[str], now: float) -> None:
        """Mark the subscribed semaphores as listened to: those just subscribed, and the rest once a quarter
        of ``MARK_SECONDS``. After the LISTEN, so that a release committed after the mark is heard."""
        for name in [n for n in self._marked_at if n not in subscribed]:
            del self._marked_at[name]
        due = sorted(n for n in subscribed if now - self._marked_at.get(n, -MARK_SECONDS) >= MARK_SECONDS / 4)
        if self._mark_sql is None or not due or now - self._mark_failed_at < MARK_RETRY_SECONDS:
            return
        try:
            cursor = await self._connection.execute(
                self._mark_sql, {"names": due, "mark_ms": round(MARK_SECONDS * 1000)}
            )
            # The names whose row was locked by another transaction: still due, tried again next turn.
            skipped = {row[0] for row in await cursor.fetchall()}
        except psycopg.Error as exc:
            if self._connection.broken:
                raise  # the connection is gone: the listener reconnects
            logger.warning("cannot mark semaphores as listened to (their releases may go unheard): %s", exc)
            self._mark_failed_at = now
            return
        for name in due:
            if name not in skipped:
                self._marked_at[name] = now

    async def _run(self) -> None:
        try:
            while not self._stop.is_set():
                await self._subscribe_while_wanted()
                # A timeout, so that a stop or a waiter of a new semaphore is noticed soon even when
                # nothing is released.
                async for note in self._connection.notifies(timeout=SUBSCRIBE_EVERY):
                    called = note.channel == self._wake_channel
                    with self._mutex:
                        if called:
                            self._called[note.payload] = self._called.get(note.payload, 0) + 1
                        # A call wakes the waiters that wait for one; a release, those that do not.
                        ready = [w for w in self._waiting.get(note.payload, ()) if (w.since is not None) == called]
                    for waiter in ready:
                        waiter.event.set()
        except psycopg.Error as exc:
            # The first line: libpq's hint after it ("This probably means the server terminated...") is
            # two more lines of guessing in an operator's log, or on a CLI user's terminal.
            logger.warning("the LISTEN connection broke (waiters poll meanwhile): %s", str(exc).partition("\n")[0])
            self._failed_at = monotonic()
        finally:
            with self._mutex:
                self._runner = None
                self._wake_subscribed = False
                # Whatever was released or called while the connection was going is unheard: every waiter
                # asks again now, and from then on polls (or waits for the listener that reconnects),
                # rather than sleep out a delay chosen on the promise of a notification.
                deaf = {waiter for waiters in self._waiting.values() for waiter in waiters}
            for waiter in deaf:
                waiter.event.set()
            with contextlib.suppress(psycopg.Error):
                await self._connection.close()
