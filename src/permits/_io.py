"""The few primitives where sync and async differ. The generated ``_sync`` modules use the ``sync_*``
names where the ``_async`` sources use ``async_*`` (see scripts/unasync.py)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


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


def async_spawn(run: Callable[[], Awaitable[None]], name: str) -> asyncio.Task[None]:
    return asyncio.ensure_future(run())


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


def async_interrupt(task: Any) -> None:
    if task is not None and not task.done():
        task.cancel()


def sync_interrupt(task: Any) -> None:
    pass


def async_mutex() -> contextlib.AbstractContextManager[Any]:
    """Guards state shared with the background runner: nothing to guard on one event loop."""
    return contextlib.nullcontext()


def sync_mutex() -> threading.Lock:
    return threading.Lock()
