"""Wake-ups on PostgreSQL: LISTEN for the permits that come back, instead of only polling.

Every statement that gives permits back on PostgreSQL (a release, the return of an ended lease's
permits, a capacity change) ends with ``pg_notify(<the semaphore's channel>, <its name>)``; notifications
are sent at commit. Each semaphore has a channel of its own (``channel_for``), so a process hears only of
the semaphores its waiters wait for, not of every release on the server. One listener connection per
store subscribes to those channels and wakes the waiters of a semaphore at once. Waiters still poll with
backoff as well, so a lost notification or a broken listener costs latency, never a grant: the database
decides every grant either way.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import psycopg

from permits._io import (
    async_event,
    async_join,
    async_mutex,
    async_sleep,
    async_spawn,
    async_wait,
    monotonic,
)

logger = logging.getLogger("permits.listener")
CHANNEL_PREFIX = "permits_room_"
#: After a failed connection, wait this long before trying to listen again (meanwhile: polling only).
RETRY_AFTER = 5.0
#: Stay subscribed this long after the last waiter that listened: a hot semaphore's waiters come and go
#: many times a second, and each LISTEN or UNLISTEN is a round trip.
LINGER = 2.0
#: How often the listener looks at which channels its waiters want, when no notification arrives.
SUBSCRIBE_EVERY = 0.1


def channel_for(name: str) -> str:
    """A semaphore's channel: the md5 of its name in hex, as the SQL computes it with ``md5(name)``. An
    identifier of 45 characters, within PostgreSQL's 63, whatever the name."""
    return CHANNEL_PREFIX + hashlib.md5(name.encode("utf-8"), usedforsecurity=False).hexdigest()


class AsyncRoomListener:
    def __init__(self, conninfo: str) -> None:
        self._conninfo = conninfo
        self._waiting: dict[str, set[Any]] = {}
        self._mutex = async_mutex()
        self._stop = async_event()
        self._runner: Any = None
        self._connection: Any = None
        self._failed_at = -RETRY_AFTER
        #: names whose channel this connection LISTENs to, and when a waiter last wanted each name
        self._subscribed: set[str] = set()
        self._wanted_at: dict[str, float] = {}

    async def wait(self, names: Sequence[str], seconds: float) -> bool:
        """Return when one of ``names`` got permits back (True), or after ``seconds`` (False)."""
        event = async_event()
        with self._mutex:
            for name in names:
                self._waiting.setdefault(name, set()).add(event)
                self._wanted_at[name] = monotonic()
        try:
            if await self._listening():
                return bool(await async_wait(event, seconds))
            await async_sleep(seconds)
            return False
        finally:
            with self._mutex:
                for name in names:
                    events = self._waiting.get(name)
                    if events is not None:
                        events.discard(event)
                        if not events:
                            del self._waiting[name]

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
        self._connection = connection
        self._subscribed = set()
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
            for name in self._waiting:
                self._wanted_at[name] = now
            for name in [n for n, at in self._wanted_at.items() if now - at >= LINGER]:
                del self._wanted_at[name]
            wanted = set(self._wanted_at)
        changes = [f"LISTEN {channel_for(n)}" for n in sorted(wanted - self._subscribed)]
        changes += [f"UNLISTEN {channel_for(n)}" for n in sorted(self._subscribed - wanted)]
        if changes:
            await self._connection.execute("; ".join(changes))
            self._subscribed = wanted

    async def _run(self) -> None:
        try:
            while not self._stop.is_set():
                await self._subscribe_while_wanted()
                # A timeout, so that a stop or a waiter of a new semaphore is noticed soon even when
                # nothing is released.
                async for note in self._connection.notifies(timeout=SUBSCRIBE_EVERY):
                    with self._mutex:
                        events = list(self._waiting.get(note.payload, ()))
                    for event in events:
                        event.set()
        except psycopg.Error as exc:
            logger.warning("the LISTEN connection broke (waiters poll meanwhile): %s", exc)
            self._failed_at = monotonic()
        finally:
            self._runner = None
            with contextlib.suppress(psycopg.Error):
                await self._connection.close()
