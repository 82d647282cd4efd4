"""A client opens once, whatever the number of its callers at first use: the schema check, the cluster
probe on MariaDB and the server functions on PostgreSQL run one at a time, so that no caller sets the
statements from a probe of its own over what another caller's probe found."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import pytest

import permits

CALLERS = 8


def _count_openings(store: Any) -> list[object]:
    """The callers (threads, or tasks) that check ``store``'s schema, each check slowed down so that the
    callers' first uses overlap. Callers, not calls: a retried check is one caller's."""
    callers: list[object] = []
    check = store._schema_revision
    if asyncio.iscoroutinefunction(check):

        async def counted_async() -> Any:
            callers.append(asyncio.current_task())
            await asyncio.sleep(0.2)
            return await check()

        store._schema_revision = counted_async
    else:

        def counted() -> Any:
            callers.append(threading.get_ident())
            time.sleep(0.2)
            return check()

        store._schema_revision = counted
    return callers


def _distinct(callers: list[object]) -> int:
    return len(set(callers))


def _first_uses_at_once(store: Any) -> list[BaseException | None]:
    """CALLERS threads call ``store.open()`` at the same moment; what each got (None: it opened)."""
    start = threading.Barrier(CALLERS)
    outcomes: list[BaseException | None] = []

    def first_use() -> None:
        start.wait()
        try:
            store.open()
            outcomes.append(None)
        except BaseException as exc:  # reported by the test
            outcomes.append(exc)

    threads = [threading.Thread(target=first_use) for _ in range(CALLERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    return outcomes


def test_threads_that_start_at_once_open_the_client_once(db_url: str) -> None:
    client = permits.connect(db_url)  # not entered: entering opens it
    try:
        calls = _count_openings(client._store)
        assert _first_uses_at_once(client._store) == [None] * CALLERS
        assert _distinct(calls) == 1
    finally:
        client.close()


def test_tasks_that_start_at_once_open_the_client_once(db_url: str) -> None:
    async def main() -> int:
        client = permits.connect_async(db_url)  # not entered: entering opens it
        try:
            store = client._store
            calls = _count_openings(getattr(store, "_inner", store))  # SQLite's runs the sync store on a thread
            await asyncio.gather(*(store.open() for _ in range(CALLERS)))
            return _distinct(calls)
        finally:
            await client.aclose()

    assert asyncio.run(main()) == 1


def test_callers_that_waited_for_a_failed_opening_get_its_error(ns: str) -> None:
    """The database is down: the callers that waited while the first of them tried to open the client get
    what it got, at once, rather than each try in turn (the last of eight would wait eight failures)."""
    with socket.socket() as unused:  # a port nobody listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    client = permits.connect(f"postgresql://postgres@127.0.0.1:{port}/test", retries=0)
    try:
        store = client._store
        opened = store._open
        openings: list[int] = []

        def slow_open() -> None:
            openings.append(threading.get_ident())
            time.sleep(0.3)  # the others are waiting meanwhile
            opened()

        store._open = slow_open
        outcomes = _first_uses_at_once(store)
        assert all(isinstance(outcome, permits.StorageUnavailable) for outcome in outcomes), outcomes
        assert len(outcomes) == CALLERS
        assert len(openings) == 1
        # A caller that comes after the failure tries again itself.
        with pytest.raises(permits.StorageUnavailable):
            store.open()
        assert len(openings) == 2
    finally:
        client.close()
