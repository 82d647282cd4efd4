"""The deadline on a database reply (``permits._io``): an overdue wait is cut as a lost connection, and a
wait that ended in time leaves its socket alone."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator

from permits._io import async_unwatch_reply, async_watch_reply, sync_unwatch_reply, sync_watch_reply


@contextlib.contextmanager
def sync_reply_deadline(fd: int | None, seconds: float) -> Iterator[None]:
    token = sync_watch_reply(fd, seconds)
    try:
        yield
    finally:
        sync_unwatch_reply(token)


@contextlib.contextmanager
def async_reply_deadline(fd: int | None, seconds: float) -> Iterator[None]:
    watch = async_watch_reply(fd, seconds)
    try:
        yield
    finally:
        async_unwatch_reply(watch)


def test_an_overdue_read_is_cut_as_a_lost_connection() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        began = time.monotonic()
        with sync_reply_deadline(ours.fileno(), 0.2):
            assert ours.recv(1) == b""  # shut down: the read ends as if the peer had gone
        assert 0.2 <= time.monotonic() - began < 3


def test_a_reply_in_time_leaves_the_socket_alone() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"a")
        with sync_reply_deadline(ours.fileno(), 0.2):
            assert ours.recv(1) == b"a"
        time.sleep(1.0)  # past the deadline, and past the watch's tick
        theirs.sendall(b"b")
        assert ours.recv(1) == b"b"


def test_no_socket_no_deadline() -> None:
    with sync_reply_deadline(None, 0.0):
        time.sleep(0.01)


def test_the_asyncio_twin_cuts_an_overdue_read_and_spares_a_timely_one() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        with ours, theirs:
            theirs.sendall(b"a")
            with async_reply_deadline(ours.fileno(), 0.2):
                assert await loop.sock_recv(ours, 1) == b"a"
            await asyncio.sleep(0.4)
            began = loop.time()
            with async_reply_deadline(ours.fileno(), 0.2):
                assert await loop.sock_recv(ours, 1) == b""
            assert 0.2 <= loop.time() - began < 3

    asyncio.run(scenario())
