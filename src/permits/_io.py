"""The few primitives where sync and async differ. The generated ``_sync`` modules use the ``sync_*``
names where the ``_async`` sources use ``async_*`` (see scripts/unasync.py)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from permits._deadline import detached

T = TypeVar("T")
logger = logging.getLogger("permits")


#: Set, on a worker thread, while it runs an operation for an asyncio caller (stores/threaded.py): once the
#: caller is cancelled, the operation tries no more, and the caller waits only for the try under way.
GIVEN_UP: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("permits_given_up", default=None)


class GivenUp(Exception):
    """An operation stopped before another try, because its caller was cancelled (``GIVEN_UP``)."""


def check_given_up() -> None:
    given_up = GIVEN_UP.get()
    if given_up is not None and given_up.is_set():
        raise GivenUp()


async def async_sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


def sync_sleep(seconds: float) -> None:
    time.sleep(seconds)


async def async_shield(awaitable: Awaitable[T]) -> T:
    """Finish ``awaitable`` even if the calling task is cancelled: a release must not be cut in half."""
    return await asyncio.shield(awaitable)


def sync_shield(value: T) -> T:
    return value


def monotonic() -> float:
    return time.monotonic()


# ---- what the lease watchdog runs on: an event, a background runner, and the caller to interrupt


def async_event() -> asyncio.Event:
    return asyncio.Event()


def sync_event() -> threading.Event:
    return threading.Event()


async def async_wait(event: asyncio.Event, seconds: float) -> bool:
    """Wait until ``event`` is set or ``seconds`` pass; True if it was set."""
    try:
        await asyncio.wait_for(event.wait(), timeout=max(0.0, seconds))
    except TimeoutError:
        return False
    return True


def sync_wait(event: threading.Event, seconds: float) -> bool:
    return event.wait(max(0.0, seconds))


def async_spawn(run: Callable[[], Coroutine[Any, Any, None]], name: str) -> asyncio.Task[None]:
    # Background work outlives the call that starts it: not to that call's deadline (a thread's starts
    # with a context of its own already).
    return asyncio.get_running_loop().create_task(run(), name=name, context=detached())


def sync_spawn(run: Callable[[], None], name: str) -> threading.Thread:
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


async def async_join(task: asyncio.Task[None]) -> None:
    await asyncio.gather(task, return_exceptions=True)


def sync_join(thread: threading.Thread) -> None:
    if thread is not threading.current_thread():
        thread.join()


def async_current() -> asyncio.Task[Any] | None:
    """The task to cancel when its lease is lost."""
    return asyncio.current_task()


def sync_current() -> Any:
    """Threads cannot be cancelled: the sync watchdog tells its holder through the flag and the callback."""
    return None


def async_loop() -> Any:
    """The running event loop, which an asyncio store's connections may belong to."""
    return asyncio.get_running_loop()


def sync_loop() -> Any:
    return None


def async_interrupt(task: Any) -> bool:
    """Cancel ``task``; whether a cancellation was asked for."""
    return task is not None and not task.done() and bool(task.cancel())


def sync_interrupt(task: Any) -> bool:
    return False


def async_take_back_cancel(task: Any, cancelling_before: int, exc: BaseException | None) -> bool:
    """Take back the cancellation ``async_interrupt`` asked of ``task``, as ``asyncio.timeout()`` does its
    own: whether ``exc`` is that cancellation and no other was asked for since (``task.cancelling()`` was
    ``cancelling_before`` before it), so that the caller may raise its own error in its place. Another
    cancellation (the task's group torn down, say) stays a cancellation."""
    return task.uncancel() <= cancelling_before and isinstance(exc, asyncio.CancelledError)


def sync_take_back_cancel(task: Any, cancelling_before: int, exc: BaseException | None) -> bool:
    return False


def async_cancelling(task: Any) -> int:
    """How many cancellations of ``task`` are pending."""
    return 0 if task is None else int(task.cancelling())


def sync_cancelling(task: Any) -> int:
    return 0


def async_mutex() -> contextlib.AbstractContextManager[Any]:
    """Guards state shared with the background runner: nothing to guard on one event loop."""
    return contextlib.nullcontext()


def sync_mutex() -> threading.Lock:
    return threading.Lock()


def async_lock() -> asyncio.Lock:
    """A lock held across awaits: the tasks of one event loop interleave there, where a mutex needs none."""
    return asyncio.Lock()


def sync_lock() -> threading.Lock:
    return threading.Lock()


async def async_try_lock(lock: asyncio.Lock) -> bool:
    """Take ``lock`` if nobody holds it; never wait for it."""
    # Just released, a lock is not ``locked()`` while the waiter it woke is still queued, and ``acquire``
    # would queue behind that waiter: so free means neither held nor waited for.
    if lock.locked() or getattr(lock, "_waiters", None):
        return False
    # Free, so taken at once: an asyncio lock that nobody holds or waits for does not yield to the loop.
    return await lock.acquire()


def sync_try_lock(lock: threading.Lock) -> bool:
    return lock.acquire(blocking=False)


async def async_lock_within(lock: asyncio.Lock, seconds: float | None) -> bool:
    """Take ``lock``, waiting ``seconds`` at most (``None``: for as long as it takes); whether it was taken.
    (A lock handed over just as the wait is cut is passed on to the next waiter: asyncio's ``acquire``
    takes it only once it resumes.)"""
    if seconds is None:
        await lock.acquire()
        return True
    try:
        async with asyncio.timeout(max(0.0, seconds)):
            await lock.acquire()
    except TimeoutError:
        return False
    return True


def sync_lock_within(lock: threading.Lock, seconds: float | None) -> bool:
    # Capped: a wait past threading.TIMEOUT_MAX (about 292 years) raises OverflowError, not a wait.
    return lock.acquire(timeout=-1 if seconds is None else min(max(0.0, seconds), threading.TIMEOUT_MAX))


# ---- a deadline on a database reply: a link or a server that hangs without failing


# ---- fork(): a child must not use its parent's connections

#: How many times this process's line of descent has forked: 0 in the process that imported permits.
_forks = 0
#: What a forked child dropped of its parent's: kept, never closed (see ``forks``).
_inherited: list[Any] = []


def forks() -> int:
    """A number that changes in a forked child. A client that finds it changed since it opened its
    connections uses them no more: they are its parent's, and a statement or request sent on one by both
    interleaves on the wire, each side reading the other's replies (MariaDB: "Packet sequence number
    wrong"; PostgreSQL: a reply to another's statement). It opens its own instead.

    The hook that counts runs in every child, also in the one ``subprocess`` forks to exec a command with a
    ``preexec_fn`` (``permits run``), while other threads may hold locks in this process: so it only counts,
    and the client renews itself on its next operation."""
    return _forks


def keep_inherited(thing: Any) -> None:
    """Keep what a child dropped of its parent's (a pool and its connections) from being collected: closing
    them would end them for the parent too (a MariaDB connection's quit, a SQLite file's last connection
    checkpointing the parent's WAL), and a child must not touch them."""
    _inherited.append(thing)


def _count_fork() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):  # POSIX only
    os.register_at_fork(after_in_child=_count_fork)


def shut_down(fd: int) -> bool:
    """End the connection on socket ``fd`` as a network failure would: a read pending on it, in any thread,
    fails at once with the error of a lost connection (a driver's: the store drops the connection and
    retries). Only the socket is shut down, through a copy of ``fd``: its owner still closes it, and keeps
    what it holds above the socket (TLS state). False: it could not be (no file descriptor left to copy it
    with, say), and the read waits on."""
    try:
        copy = os.dup(fd)
    except OSError:
        return False
    try:
        duplicate = socket.socket(fileno=copy)
    except OSError:  # not a socket: nothing to shut down
        os.close(copy)
        return False
    with duplicate:
        try:
            duplicate.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
    return True


class _ReplyWatch:
    """One thread per process that ends the connections whose reply is overdue. Arming and disarming are a
    dict operation each (disarming under a lock) and never wake the thread: it looks at the armed sockets
    every ``_WATCH_TICK`` seconds while any was armed lately, so an overdue reply is cut up to a tick late."""

    _WATCH_TICK = 0.5
    _IDLE_TICKS = 60  # ticks with nothing armed before the thread sleeps until the next arm

    def __init__(self) -> None:
        self._reset()
        # A forked child has no watch thread, whatever the parent's state said: it starts its own.
        if hasattr(os, "register_at_fork"):  # POSIX only
            os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[int, tuple[int, float]] = {}
        #: arms that went off but whose socket could not be shut down
        self._missed: set[int] = set()
        self._tokens = itertools.count(1)
        self._sleeping = True
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def arm(self, fd: int, seconds: float) -> int:
        # No lock: taking a number and setting a key are each atomic under the GIL, and the thread copies
        # the dict in one step (under the lock, against disarm).
        token = next(self._tokens)
        self._armed[token] = (fd, time.monotonic() + seconds)
        if self._sleeping:
            with self._lock:
                self._sleeping = False
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._run, name="permits-reply-watch", daemon=True)
                    self._thread.start()
                self._wake.set()
        return token

    def disarm(self, token: int) -> bool:
        """True if the socket was shut down (the arm is gone from the dict only then)."""
        # Under the lock: once this returns, the socket is never shut down on this arm's account, so the
        # caller may hand the connection back (and its fd be reused) at once.
        with self._lock:
            if self._armed.pop(token, None) is not None:
                return False
            if token in self._missed:
                self._missed.discard(token)
                return False
            return True

    def _run(self) -> None:
        try:
            self._watch()
        except BaseException:  # pragma: no cover - a bug: say so, and let the next arm start a new thread
            logger.exception("the reply watch stopped")
            raise
        finally:
            self._sleeping = True

    def _watch(self) -> None:
        idle = 0
        while True:
            self._wake.wait(self._WATCH_TICK)
            self._wake.clear()
            with self._lock:
                now = time.monotonic()
                for token, (fd, deadline) in list(self._armed.items()):
                    if deadline <= now:
                        del self._armed[token]
                        if not shut_down(fd):
                            self._missed.add(token)
                idle = 0 if self._armed else idle + 1
                if idle < self._IDLE_TICKS:
                    continue
                self._sleeping = True
            # An arm that read ``_sleeping`` before it was set did not wake this thread, but its socket is in
            # the dict by then (it is added first): look once more before sleeping.
            if self._armed:
                self._sleeping = False
                continue
            idle = 0
            self._wake.wait()


_REPLY_WATCH = _ReplyWatch()


class _ReplyTimer:
    """One armed deadline on the event loop, and whether it went off."""

    __slots__ = ("fd", "fired", "handle")

    def __init__(self, fd: int, seconds: float) -> None:
        self.fd = fd
        self.fired = False
        self.handle = asyncio.get_running_loop().call_later(seconds, self._fire)

    def _fire(self) -> None:
        self.fired = shut_down(self.fd)


def async_watch_reply(fd: int | None, seconds: float) -> _ReplyTimer | None:
    """Shut the socket ``fd`` down unless ``async_unwatch_reply`` comes within ``seconds``: a statement whose
    reply does not come (a stalled link, a hung server) then fails as a lost connection, instead of holding
    its caller until TCP gives up, about 15 minutes later. ``fd`` None (SQLite): nothing to watch. A pair of
    calls rather than a context manager: it runs around every statement, and costs a third less so."""
    return None if fd is None else _ReplyTimer(fd, seconds)


def async_unwatch_reply(watch: _ReplyTimer | None) -> bool:
    """Disarm; True if the deadline had shut the socket down (the statement's fate is then unknown, and its
    server session may still run it when the link comes back)."""
    if watch is None:
        return False
    watch.handle.cancel()
    return watch.fired


def sync_watch_reply(fd: int | None, seconds: float) -> int:
    """``async_watch_reply`` for threads: the process's watch thread shuts the socket down. 0: nothing to
    watch."""
    return 0 if fd is None else _REPLY_WATCH.arm(fd, seconds)


def sync_unwatch_reply(token: int) -> bool:
    return bool(token) and _REPLY_WATCH.disarm(token)
