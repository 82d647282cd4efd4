"""SQLite: a write lock held elsewhere (another process's BEGIN IMMEDIATE) is a typed, retried conflict.

Every writing transaction starts with BEGIN IMMEDIATE, sent on the sqlite3 cursor by the store's direct
transactions (permits/stores/direct.py). A busy database there must reach the caller as permits' own error
after the retries, never as the driver's exception, and a waiting acquire rides it out within its timeout.
"""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest

import permits


def _hold_write_lock(path: str, seconds: float, taken: threading.Event) -> None:
    other = sqlite3.connect(path, isolation_level=None, timeout=5)
    other.execute("BEGIN IMMEDIATE")
    taken.set()
    time.sleep(seconds)
    other.execute("ROLLBACK")
    other.close()


def test_a_held_write_lock_is_a_storage_conflict_then_a_grant(tmp_path: pytest.TempPathFactory, ns: str) -> None:
    path = f"{tmp_path}/busy.db"
    url = f"sqlite:///{path}"
    with permits.connect(url, owner=f"{ns}w", lock_wait_timeout=0.2, retries=1) as client:
        client.create_semaphore(f"{ns}s", 1)
        taken = threading.Event()
        holder = threading.Thread(target=_hold_write_lock, args=(path, 2.0, taken))
        holder.start()
        taken.wait(5)
        with pytest.raises(permits.StorageConflict):
            client.try_acquire(f"{ns}s")
        # A waiting acquire keeps trying through the conflicts and is granted once the lock is let go.
        lease = client.acquire(f"{ns}s", timeout=10)
        holder.join(10)
        assert lease.counts == {f"{ns}s": 1}
        client.release(lease)


def test_a_timeout_spent_waiting_for_the_lock_says_so(tmp_path: pytest.TempPathFactory, ns: str) -> None:
    """The semaphore had room, but the lock held elsewhere kept every attempt from asking: the
    AcquireTimeout says what held it up, not only "no room", which would send its reader looking for holders
    that do not exist."""
    path = f"{tmp_path}/busy.db"
    with permits.connect(f"sqlite:///{path}", owner=f"{ns}w", lock_wait_timeout=0.2, retries=1) as client:
        client.create_semaphore(f"{ns}s", 1)
        taken = threading.Event()
        holder = threading.Thread(target=_hold_write_lock, args=(path, 3.0, taken))
        holder.start()
        taken.wait(5)
        with pytest.raises(permits.AcquireTimeout, match="held up") as raised:
            client.acquire(f"{ns}s", timeout=0.5)
        holder.join(10)
        assert isinstance(raised.value.__cause__, permits.StorageConflict)
        assert client.get_semaphore(f"{ns}s").used == 0
