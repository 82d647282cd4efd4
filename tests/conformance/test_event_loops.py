"""An AsyncClient made outside any event loop (at import time, say) and used by two event loops in turn
(two ``asyncio.run`` calls): through a service and on PostgreSQL and SQLite it serves both; on MariaDB and
MySQL the driver's pooled connections belong to the first loop, and the second gets a UsageError that says
so, not the driver's RuntimeError from deep inside it."""

from __future__ import annotations

import asyncio

import pytest

import permits


def test_an_async_client_used_by_two_event_loops_in_turn(client_url: str, via: str, backend: str, ns: str) -> None:
    client = permits.connect_async(client_url, owner=f"{ns}o")

    async def hold(turn: int) -> int:
        await client.create_semaphore(f"{ns}s", 1, exist_ok=True)
        async with client.lease(f"{ns}s", key=f"{ns}turn{turn}", ttl=30) as lease:
            return lease.token

    if via == "db" and backend == "mysql":
        # The first loop is kept open, so that its connections can be closed in it at the end.
        first_loop, second_loop = asyncio.new_event_loop(), asyncio.new_event_loop()
        try:
            first_loop.run_until_complete(hold(1))
            with pytest.raises(permits.UsageError, match="another event loop"):
                second_loop.run_until_complete(hold(2))
            first_loop.run_until_complete(client.aclose())
        finally:
            first_loop.close()
            second_loop.close()
        return
    first = asyncio.run(hold(1))
    assert asyncio.run(hold(2)) > first
    asyncio.run(client.aclose())
