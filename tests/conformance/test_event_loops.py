"""An AsyncClient made outside any event loop (at import time, say) and used by two event loops in turn
(two ``asyncio.run`` calls, or a test framework's loop per test): it serves both, on every backend and
through a service. On MariaDB and MySQL the driver's connections belong to the loop that made them: the
first loop's are let go once it has closed, their server sessions ended, and nothing is printed as they
are collected. Used by a second loop while the first is still open, such a client says so (UsageError)
rather than fail with the driver's RuntimeError from deep inside it."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

import permits
from tests.conftest import _Servers, mariadb_session


def test_an_async_client_used_by_two_event_loops_in_turn(client_url: str, via: str, backend: str, ns: str) -> None:
    client = permits.connect_async(client_url, owner=f"{ns}o")

    async def hold(turn: int) -> int:
        await client.create_semaphore(f"{ns}s", 1, exist_ok=True)
        async with client.lease(f"{ns}s", key=f"{ns}turn{turn}", ttl=30) as lease:
            return lease.token

    first = asyncio.run(hold(1))
    assert asyncio.run(hold(2)) > first
    assert asyncio.run(hold(3)) > first
    asyncio.run(client.aclose())
    gc.collect()  # a connection that tried its closed loop as it was collected would fail the test here


def test_on_mariadb_the_closed_loops_sessions_end_when_the_next_loop_comes(servers: _Servers, ns: str) -> None:
    """The first loop's connections are not left for the server's idle timeout: their sessions end as the
    second loop takes over."""
    mysql_url = servers.url_for("mysql").render_as_string(hide_password=False)
    client = permits.connect_async(mysql_url, owner=f"{ns}o")

    async def hold_and_name_the_sessions(turn: int) -> set[int]:
        await client.create_semaphore(f"{ns}s", 2, exist_ok=True)
        # Two leases at once: two connections in the pool, so more than one session is let go.
        async with (
            client.lease(f"{ns}s", key=f"{ns}a{turn}", ttl=30),
            client.lease(f"{ns}s", key=f"{ns}b{turn}", ttl=30),
        ):
            pass
        return {int(session["id"]) for session in client._store._sessions.values()}

    def alive(sessions: set[int]) -> set[int]:
        with mariadb_session(mysql_url) as admin, admin.cursor() as cursor:
            cursor.execute("SELECT ID FROM information_schema.PROCESSLIST")
            return sessions & {int(row[0]) for row in cursor.fetchall()}

    firsts = asyncio.run(hold_and_name_the_sessions(1))
    assert firsts and alive(firsts) == firsts
    seconds = asyncio.run(hold_and_name_the_sessions(2))
    assert seconds and not seconds & firsts
    deadline = time.monotonic() + 5
    while alive(firsts):
        assert time.monotonic() < deadline, f"the first loop's sessions {alive(firsts)} are still open"
        time.sleep(0.05)
    asyncio.run(client.aclose())
    gc.collect()


def test_on_mariadb_a_loop_cannot_use_a_client_another_open_loop_uses(servers: _Servers, ns: str) -> None:
    mysql_url = servers.url_for("mysql").render_as_string(hide_password=False)
    client = permits.connect_async(mysql_url, owner=f"{ns}o")

    async def hold() -> int:
        await client.create_semaphore(f"{ns}s", 1, exist_ok=True)
        async with client.lease(f"{ns}s", ttl=30) as lease:
            return lease.token

    first_loop, second_loop = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        first_loop.run_until_complete(hold())
        with pytest.raises(permits.UsageError, match="in use in another event loop, which is still open"):
            second_loop.run_until_complete(hold())
        with pytest.raises(permits.UsageError, match="still open"):
            second_loop.run_until_complete(client.aclose())
        # Not closed by that: closed in its own loop, where its connections close.
        first_loop.run_until_complete(client.aclose())
        assert client._store._closed
    finally:
        first_loop.close()
        second_loop.close()


def test_on_mariadb_a_connection_a_closed_loop_left_in_use_is_let_go_too(servers: _Servers, ns: str) -> None:
    """A loop closed without cancelling its tasks (``run_until_complete``, then ``close``) leaves a waiter
    with a connection checked out: the next loop lets that one go too, and collecting it warns of nothing."""
    mysql_url = servers.url_for("mysql").render_as_string(hide_password=False)
    client = permits.connect_async(mysql_url, owner=f"{ns}o")
    left: list[asyncio.Task[object]] = []

    async def hold_and_leave_a_waiter() -> None:
        await client.create_semaphore(f"{ns}s", 1, exist_ok=True)
        await client.acquire(f"{ns}s", key=f"{ns}held", ttl=30)
        left.append(asyncio.ensure_future(client.acquire(f"{ns}s", key=f"{ns}waiter", ttl=30, timeout=30)))
        await asyncio.sleep(0.5)  # the waiter waits in the semaphore's line, on a connection of its own

    first_loop = asyncio.new_event_loop()
    first_loop.run_until_complete(hold_and_leave_a_waiter())
    first_loop.close()  # the waiter's task never ends: it is dropped with its loop

    async def release_and_close() -> None:
        assert await client.release(f"{ns}held") == "released"
        await client.aclose()

    asyncio.run(release_and_close())
    left.clear()
    gc.collect()
