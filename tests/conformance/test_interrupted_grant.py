"""An acquire interrupted while its grant is with the database: cancelled (asyncio) or Ctrl-C'd (sync) while
the statement waits for the semaphore's row lock (MariaDB, PostgreSQL) or for SQLite's write lock, held by
another session. The database may carry the grant out once the lock comes free, after the caller has
moved on and released what it could find under the key it made up: a lease nobody knows of would then
hold the permit until its TTL. Whatever the moment, nothing may be left held, and the interrupted caller
must not wait for the other session's lock to come free."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

import permits
from tests.conftest import sqlalchemy_url

#: (how long the other session keeps the lock, the client's lock wait). The lock is kept past the
#: interruption, so that the grant it held up would be carried out after the caller's clean-up: within the
#: lock wait, so that the statement waiting for it commits once it has it; and past it, so that the grant
#: is tried again after its first try's wait runs out (a cancelled caller's store must try no more).
TIMINGS = pytest.mark.parametrize(("hold", "lock_wait"), [(2.0, 5.0), (2.5, 1.0)], ids=["within", "past"])


@contextlib.contextmanager
def _lock_held(db_url: str, name: str, hold: float) -> Iterator[threading.Event]:
    """Another session holds the lock a grant of ``name`` waits for, for ``hold`` seconds; the event is set
    once it has let go."""
    taken, done = threading.Event(), threading.Event()

    def keep() -> None:
        if db_url.startswith("sqlite"):
            conn = sqlite3.connect(make_url(db_url).database or "", isolation_level=None)
            conn.execute("BEGIN IMMEDIATE")
            taken.set()
            time.sleep(hold)
            conn.execute("COMMIT")
            conn.close()
        else:
            engine = create_engine(sqlalchemy_url(db_url))
            with engine.begin() as conn:
                conn.execute(text("SELECT used FROM permits_semaphore WHERE name = :n FOR UPDATE"), {"n": name})
                taken.set()
                time.sleep(hold)
            engine.dispose()
        done.set()

    thread = threading.Thread(target=keep, daemon=True)
    thread.start()
    assert taken.wait(20)
    try:
        yield done
    finally:
        thread.join(30)


@TIMINGS
def test_a_cancelled_acquire_whose_grant_waits_for_a_lock_leaves_nothing_held(
    db_url: str, ns: str, hold: float, lock_wait: float
) -> None:
    name = f"{ns}s"

    async def scenario() -> tuple[float, int, list[permits.Lease]]:
        async with permits.connect_async(db_url, owner=f"{ns}o", lock_wait_timeout=lock_wait) as client:
            await client.create_semaphore(name, 1)
            with _lock_held(db_url, name, hold) as done:
                task = asyncio.create_task(client.acquire(name, ttl=120, timeout=30))
                await asyncio.sleep(0.5)  # its grant is with the database, waiting for the lock
                began = time.monotonic()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                took = time.monotonic() - began
                assert await asyncio.to_thread(done.wait, 30)
            await asyncio.sleep(1.0)  # time for a grant the database carried out late to commit
            sem = await client.get_semaphore(name)
            return took, sem.used, await client.holders(name)

    took, used, holders = asyncio.run(scenario())
    assert (used, holders) == (0, []), holders
    assert took < hold + 1.0, took


@TIMINGS
def test_an_acquire_interrupted_by_ctrl_c_while_its_grant_waits_for_a_lock_leaves_nothing_held(
    db_url: str, ns: str, hold: float, lock_wait: float
) -> None:
    """The sync client's twin: a process whose acquire gets SIGINT while the database holds its grant."""
    name = f"{ns}s"
    # The process starts, opens its client and reports, and only then is the lock taken and the process
    # told to ask: its start (Python, its imports, the connection) took longer than the lock was held on a
    # loaded machine, and its acquire then found the lock gone, succeeded, and the signal came as it exited.
    code = (
        "import signal, sys, permits\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "with permits.connect(sys.argv[1], owner=sys.argv[3], lock_wait_timeout=float(sys.argv[4])) as client:\n"
        "    client.ping()\n"
        "    print('ready', flush=True)\n"
        "    sys.stdin.readline()\n"
        "    print('asking', flush=True)\n"
        "    client.acquire(sys.argv[2], ttl=120, timeout=30)\n"
    )
    with permits.connect(db_url, owner=f"{ns}h") as client:
        client.create_semaphore(name, 1)
        child = subprocess.Popen(
            [sys.executable, "-c", code, db_url, name, f"{ns}o", str(lock_wait)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdin is not None and child.stdout is not None
            assert child.stdout.readline() == "ready\n", child.communicate()
            with _lock_held(db_url, name, hold) as done:
                child.stdin.write("go\n")
                child.stdin.flush()
                assert child.stdout.readline() == "asking\n"
                time.sleep(0.5)  # its grant is with the database, waiting for the lock
                child.send_signal(signal.SIGINT)
                assert child.wait(timeout=30) != 0
                assert child.stderr is not None and "KeyboardInterrupt" in child.stderr.read()
                assert done.wait(30)
        finally:
            if child.poll() is None:  # it failed: leave no process behind
                child.kill()
                child.wait()
        time.sleep(1.0)  # time for a grant the database carried out late to commit
        assert (client.get_semaphore(name).used, client.holders(name)) == (0, [])
