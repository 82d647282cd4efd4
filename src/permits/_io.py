"""The few primitives where sync and async differ. The generated ``_sync`` modules use the ``sync_*``
names where the ``_async`` sources use ``async_*`` (see scripts/unasync.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

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
