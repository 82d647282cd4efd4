"""Wake-ups on PostgreSQL: LISTEN for the permits that come back, instead of only polling.

Every statement that gives permits back on PostgreSQL (a release, the return of an ended lease's
permits, a capacity change) ends with ``pg_notify('permits_room', <semaphore name>)``; notifications are
sent at commit. One listener connection per store receives them and wakes the waiters of that semaphore
at once. Waiters still poll with backoff as well, so a lost notification or a broken listener costs
latency, never a grant: the database decides every grant either way.
"""

from __future__ import annotations

import contextlib
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
CHANNEL = "permits_room"
#: After a failed connection, wait this long before trying to listen again (meanwhile: polling only).
RETRY_AFTER = 5.0
#: Stay subscribed this long after the last waiter that listened: a hot semaphore's waiters come and go
#: many times a second, and each LISTEN or UNLISTEN is a round trip.
LINGER = 2.0


class AsyncRoomListener:
    def __init__(self, conninfo: str) -> None:
        self._conninfo = conninfo
        self._waiting: dict[str, set[Any]] = {}
        self._mutex = async_mutex()
        self._stop = async_event()
        self._runner: Any = None
        self._connection: Any = None
        self._failed_at = -RETRY_AFTER
        self._subscribed = False
        self._wanted_at = monotonic()

    async def wait(self, names: Sequence[str], seconds: float) -> bool:
        """Return when one of ``names`` got permits back (True), or after ``seconds`` (False)."""
        event = async_event()
        with self._mutex:
            self._wanted_at = monotonic()
            for name in names:
                self._waiting.setdefault(name, set()).add(event)
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
            await connection.execute(f"LISTEN {CHANNEL}")
        except psycopg.Error as exc:
            logger.warning("cannot LISTEN for released permits (waiters poll meanwhile): %s", exc)
            return False
        self._connection = connection
        self._subscribed = True
        self._failed_at = -RETRY_AFTER
        self._runner = async_spawn(self._run, "permits-listener")
        return True

    async def _subscribe_while_wanted(self) -> None:
        """LISTEN only while some waiter listens. Waiters of a heavily contended semaphore stop listening
        (see ``permits._pacing``): every release would wake every one of them, and on a busy server
        receiving the notifications alone costs each waiting process more than polling does."""
        with self._mutex:
            wanted = bool(self._waiting) or monotonic() - self._wanted_at < LINGER
        if wanted != self._subscribed:
            await self._connection.execute(f"LISTEN {CHANNEL}" if wanted else f"UNLISTEN {CHANNEL}")
            self._subscribed = wanted

    async def _run(self) -> None:
        try:
            while not self._stop.is_set():
                await self._subscribe_while_wanted()
                # A timeout, so that a stop (or a new waiter, when unsubscribed) is noticed soon even
                # when nothing is released.
                async for note in self._connection.notifies(timeout=1.0 if self._subscribed else 0.1):
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
