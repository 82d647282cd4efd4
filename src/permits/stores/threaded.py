"""SQLite's asyncio store: each operation runs whole on a worker thread, over the sync SQL store.

SQLite's driver is synchronous. Through aiosqlite every cursor call is a hop to the connection's own
thread and back, several per statement, so an acquire and a release on the asyncio store cost about four
times what they cost on the sync one (10 ms against 2.3 ms per cycle, measured on this project's 2-core
machine). Running the whole transaction on a worker thread costs one hop per operation instead. The
event loop never blocks: the loop's default executor runs the calls, and SQLite serialises writers
itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

from permits._config import Settings
from permits._io import GIVEN_UP
from permits._sync.store import SQLStore


class ThreadedSQLStore:
    """The ``AsyncStore`` protocol over a ``SQLStore``; every method is a coroutine run on a thread."""

    def __init__(self, settings: Settings) -> None:
        self._inner = SQLStore(settings)

    @property
    def url(self) -> str:
        return self._inner.url

    @property
    def default_ttl_ms(self) -> int | None:
        return None  # the client's own

    @property
    def dialect_name(self) -> str:
        return self._inner.dialect_name

    @property
    def connections_in_use(self) -> int:
        return self._inner.connections_in_use

    @property
    def on_retry(self) -> Callable[[str], None] | None:
        return self._inner.on_retry

    @on_retry.setter
    def on_retry(self, hook: Callable[[str], None] | None) -> None:
        self._inner.on_retry = hook

    @property
    def on_reply_cut(self) -> Callable[[str], None] | None:
        return self._inner.on_reply_cut

    @on_reply_cut.setter
    def on_reply_cut(self, hook: Callable[[str], None] | None) -> None:
        self._inner.on_reply_cut = hook

    def wake_calls(self, names: Any) -> int | None:
        return None  # SQLite: nothing to hear

    async def wait_for_room(self, names: Any, seconds: float, since: int | None = None) -> bool:
        await asyncio.sleep(seconds)  # never hold a worker thread just to wait
        return False

    async def try_acquire(self, *args: Any, **kwargs: Any) -> Any:
        # Cancelled, the attempt goes on, on its thread (see __getattr__), but tries no more after the one
        # under way (GIVEN_UP); the cancellation waits for that one to end, so that what the caller does next
        # (give its place in a fair queue up, release a lease under a key it made up) sees what it did. A
        # place committed after the caller's give-up held the queue up until it lapsed, and a grant committed
        # after its release was held, by nobody, until its TTL ran out. One try waits for the write lock
        # for a lock wait at most.
        given_up = threading.Event()

        def attempt() -> Any:
            GIVEN_UP.set(given_up)  # in the worker's own copy of the context (asyncio.to_thread)
            return self._inner.try_acquire(*args, **kwargs)

        running = asyncio.ensure_future(asyncio.to_thread(attempt))
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            given_up.set()
            with contextlib.suppress(Exception):
                await asyncio.shield(running)
            raise

    def queues_in_line(self, wants: Any) -> bool:
        # A semaphore's line beside the database (stores/host_lines.py) would hold a worker thread for each
        # waiter while it waits its turn: the asyncio client's waiters wait as before. Their writes still
        # take turns in the write line, on the thread that runs them.
        return False

    def queue_short(self, owner: str, key: str) -> int | None:
        result: int | None = self._inner.queue_short(owner, key)  # a memory lookup: no thread needed
        return result

    def holds_place(self, owner: str, key: str) -> bool:
        return bool(self._inner.holds_place(owner, key))  # a memory lookup: no thread needed

    def place_called(self, owner: str, key: str) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._inner, name)
        if not callable(method):
            return method

        @functools.wraps(method)
        async def on_a_thread(*args: Any, **kwargs: Any) -> Any:
            # A cancelled caller does not stop the thread: the operation commits or rolls back whole,
            # and its key (or the lease's state) makes a retry safe either way.
            return await asyncio.to_thread(method, *args, **kwargs)

        return on_a_thread
