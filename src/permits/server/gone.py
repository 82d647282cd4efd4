"""A waiting request whose client goes away stops waiting.

A request that waits for room (``wait`` > 0) is a long poll. If its client closes the connection (a
timeout of its own, Ctrl-C, a process that died), nobody will read the answer: were the service to go on
waiting, it could grant a lease nobody knows of, held until its TTL ran out and keeping others out
meanwhile. So the route watches the connection (``watching``) while it waits, and the waits (the
instance's wake-ups, its lines) end with ``ClientGone`` when the client has gone, at a point where no
attempt is in flight: one already sent to the database decides, as it would for any waiter.

Nothing is released on the client's behalf: a client whose connection dropped may be asking again under
the same key, on this instance or another, and a lease its retry was given must not be taken from it. The
watch only stops the asking.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import Any

from starlette.types import Receive

from permits._exceptions import AcquireTimeout

#: The current request's "client has gone" event, for the waits it runs into; ``None`` outside a watch.
CLIENT_GONE: ContextVar[asyncio.Event | None] = ContextVar("permits_client_gone", default=None)


class ClientGone(AcquireTimeout):
    """The client closed its connection while its request waited for room: it was not granted. Nobody
    reads this answer; the route counts the request as ``gone``."""


def gone_event() -> asyncio.Event | None:
    return CLIENT_GONE.get()


@contextlib.asynccontextmanager
async def watching(receive: Receive) -> AsyncIterator[asyncio.Event]:
    """Set the event it yields when the client disconnects, while the block runs. ``receive`` must have
    given the whole body already: what comes next is the disconnect."""
    gone = asyncio.Event()

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
                return

    watcher = asyncio.ensure_future(watch())
    token = CLIENT_GONE.set(gone)
    try:
        yield gone
    finally:
        CLIENT_GONE.reset(token)
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher


def watching_if(waits: bool, receive: Receive) -> contextlib.AbstractAsyncContextManager[asyncio.Event | None]:
    """``watching(receive)`` for a request that ``waits`` for room; nothing for one that does not."""
    return watching(receive) if waits else contextlib.nullcontext()


async def first_of(waits: set[asyncio.Future[Any]], seconds: float | None) -> None:
    """``asyncio.wait`` for the first of ``waits``, or the client going away, within ``seconds``."""
    gone = gone_event()
    watch = asyncio.ensure_future(gone.wait()) if gone is not None else None
    try:
        watched = waits | ({watch} if watch is not None else set())
        await asyncio.wait(watched, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if watch is not None:
            watch.cancel()


def has_gone() -> bool:
    """Whether the current request's client has gone away."""
    gone = gone_event()
    return gone is not None and gone.is_set()


def raise_if_gone() -> None:
    if has_gone():
        raise ClientGone("the client went away while its request waited for room", timeout=0.0)
