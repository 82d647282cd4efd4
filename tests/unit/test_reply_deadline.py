"""The deadline on a database reply (``permits._io``): an overdue wait is cut as a lost connection, and a
wait that ended in time leaves its socket alone. Disarming tells which happened: the store then ends the
cut connection's server session before it retries."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

import permits
from permits import _config
from permits._io import (
    async_lock,
    async_try_lock,
    async_unwatch_reply,
    async_watch_reply,
    sync_lock,
    sync_try_lock,
    sync_unwatch_reply,
    sync_watch_reply,
)


def test_an_overdue_read_is_cut_as_a_lost_connection() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        began = time.monotonic()
        watch = sync_watch_reply(ours.fileno(), 0.2)
        assert ours.recv(1) == b""  # shut down: the read ends as if the peer had gone
        assert sync_unwatch_reply(watch) is True
        assert 0.2 <= time.monotonic() - began < 3


def test_a_reply_in_time_leaves_the_socket_alone() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"a")
        watch = sync_watch_reply(ours.fileno(), 0.2)
        assert ours.recv(1) == b"a"
        assert sync_unwatch_reply(watch) is False
        time.sleep(1.0)  # past the deadline, and past the watch's tick
        theirs.sendall(b"b")
        assert ours.recv(1) == b"b"


def test_no_socket_no_deadline() -> None:
    assert sync_watch_reply(None, 0.0) == 0
    assert sync_unwatch_reply(0) is False
    assert async_unwatch_reply(None) is False


def test_the_asyncio_twin_cuts_an_overdue_read_and_spares_a_timely_one() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        with ours, theirs:
            theirs.sendall(b"a")
            watch = async_watch_reply(ours.fileno(), 0.2)
            assert await loop.sock_recv(ours, 1) == b"a"
            assert async_unwatch_reply(watch) is False
            await asyncio.sleep(0.4)
            began = loop.time()
            watch = async_watch_reply(ours.fileno(), 0.2)
            assert await loop.sock_recv(ours, 1) == b""
            assert async_unwatch_reply(watch) is True
            assert 0.2 <= loop.time() - began < 3

    asyncio.run(scenario())


# ---- the deadline a client is given: reply_timeout


def test_the_default_deadline_is_two_lock_waits_and_the_grace(tmp_path: Path) -> None:
    with permits.connect(f"sqlite:///{tmp_path / 'p.db'}", lock_wait_timeout=2) as client:
        assert client._settings.reply_timeout == 2 * 2 + _config.REPLY_GRACE_SECONDS


def test_a_chosen_deadline_is_used(tmp_path: Path) -> None:
    with permits.connect(f"sqlite:///{tmp_path / 'p.db'}", lock_wait_timeout=1, reply_timeout=2.5) as client:
        assert client._settings.reply_timeout == 2.5


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(10, id="two-lock-waits"),  # a statement waiting its turn for two locks would be cut
        pytest.param(0, id="zero"),
        pytest.param(-1, id="negative"),
        pytest.param(float("nan"), id="nan"),
        pytest.param(float("inf"), id="infinite"),
        pytest.param("30", id="string"),
        pytest.param(True, id="bool"),
    ],
)
def test_a_deadline_that_cannot_work_is_refused(value: object, tmp_path: Path) -> None:
    for connect in (permits.connect, permits.connect_async):
        with pytest.raises(permits.InvalidArgument) as refused:
            connect(f"sqlite:///{tmp_path / 'p.db'}", lock_wait_timeout=5, reply_timeout=value)  # type: ignore[arg-type]
        assert refused.value.details["field"] == "reply_timeout"


def test_the_service_refuses_a_deadline_that_cannot_work_at_start() -> None:
    from permits.server.config import ServerConfig

    with pytest.raises(permits.ConfigurationError, match="reply_timeout") as refused:
        ServerConfig.load(lock_wait_timeout=5, reply_timeout=10)
    assert refused.value.details["field"] == "reply_timeout"
    assert ServerConfig.load(lock_wait_timeout=5, reply_timeout=10.5).reply_timeout == 10.5


def test_try_lock_takes_a_free_lock_and_never_waits_for_a_held_one() -> None:
    """What a caller uses to end another caller's cut session only if nobody is ending it already."""
    lock = sync_lock()
    assert sync_try_lock(lock) is True
    assert sync_try_lock(lock) is False
    lock.release()

    async def main() -> None:
        held = async_lock()
        assert await async_try_lock(held) is True
        assert await async_try_lock(held) is False
        held.release()
        assert await async_try_lock(held) is True

    asyncio.run(main())
