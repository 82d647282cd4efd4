"""The seats in the server's lines (``LINE_SEATS``): the sync store's threads share one count of them.

A lost update of that count would stay for the store's whole life: too high, and its waiters never queue in
the line again; too low, and more of them hold pooled connections while they wait than the bound allows.
The count is taken and given back under a lock. Under CPython's GIL an unlocked check and increment would
not be interrupted either (no thread switch inside them), so this test cannot catch a missing lock there;
it checks the bound and the return of every seat, and it would catch a lost update on a free-threaded build.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from permits._config import Settings
from permits._pacing import LINE_SEATS
from permits._sync.store import SQLStore


@pytest.fixture
def tiny_switch_interval() -> Iterator[None]:
    # Threads switch after almost every bytecode, so that a read-modify-write without a lock loses updates.
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def test_threads_never_take_more_seats_than_there_are_and_give_them_all_back(
    tmp_path: Path, tiny_switch_interval: None
) -> None:
    store = SQLStore(
        Settings.build(
            f"sqlite:///{tmp_path / 'seats.db'}",
            owner="seats",
            ttl=30,
            lock_wait_timeout=5,
            retries=3,
            auto_upgrade=False,
        )
    )
    most = 0
    most_lock = threading.Lock()

    def sit_and_leave() -> None:
        nonlocal most
        for _ in range(3000):
            if store._take_line_seat():
                with most_lock:
                    most = max(most, store._in_line_now)
                store._leave_line_seat()

    threads = [threading.Thread(target=sit_and_leave) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert 0 < most <= LINE_SEATS
        assert store._in_line_now == 0
    finally:
        store.close()
