"""A client opens once, whatever the number of its callers at first use: the schema check, the cluster
probe on MariaDB and the server functions on PostgreSQL run one at a time, so that no caller sets the
statements from a probe of its own over what another caller's probe found."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import permits

CALLERS = 8


def _count_openings(store: Any) -> list[int]:
    """Counts the schema checks ``store`` makes, each slowed down so that the callers' first uses overlap."""
    calls: list[int] = []
    check = store._schema_revision
    if asyncio.iscoroutinefunction(check):

        async def counted_async() -> Any:
            calls.append(1)
            await asyncio.sleep(0.2)
            return await check()

        store._schema_revision = counted_async
    else:

        def counted() -> Any:
            calls.append(1)
            time.sleep(0.2)
            return check()

        store._schema_revision = counted
    return calls


def test_threads_that_start_at_once_open_the_client_once(db_url: str) -> None:
    client = permits.connect(db_url)  # not entered: entering opens it
    try:
        calls = _count_openings(client._store)
        start = threading.Barrier(CALLERS)
        failures: list[BaseException] = []

        def first_use() -> None:
            start.wait()
            try:
                client._store.open()
            except BaseException as exc:  # reported by the test below
                failures.append(exc)

        threads = [threading.Thread(target=first_use) for _ in range(CALLERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert failures == []
        assert len(calls) == 1
    finally:
        client.close()


def test_tasks_that_start_at_once_open_the_client_once(db_url: str) -> None:
    async def main() -> int:
        client = permits.connect_async(db_url)  # not entered: entering opens it
        try:
            store = client._store
            calls = _count_openings(getattr(store, "_inner", store))  # SQLite's runs the sync store on a thread
            await asyncio.gather(*(store.open() for _ in range(CALLERS)))
            return len(calls)
        finally:
            await client.aclose()

    assert asyncio.run(main()) == 1
